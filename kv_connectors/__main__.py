"""`python -m kv_connectors`: the `kv-connectors` command (see kv_connectors/cli.py)."""

from kv_connectors.cli import main

raise SystemExit(main())
