"""kv-connectors: KV-cache transfer connectors for vLLM prefill/decode disaggregation."""

__version__ = "0.2.0.dev0"
