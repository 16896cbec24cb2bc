"""`python -m kv_connectors.proxy ...`: the same as the `kv-connectors-proxy` command."""

from kv_connectors.proxy import main

main()
