"""`python -m pd_proxy ...` (from examples/) is the same as `python examples/proxy.py ...`."""

from . import main

main()
