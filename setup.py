"""Install entry for kv-connectors (`pip install -e .`); the metadata is in pyproject.toml (PEP 621)."""

from setuptools import setup

setup()
