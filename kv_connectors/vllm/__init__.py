"""Host adapter: the only package that imports vLLM."""
