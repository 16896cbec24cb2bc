"""Example PD proxy for xPyD fleets: `python examples/proxy.py --prefill URL [SIDE_CHANNEL] --decode URL ...`.

The same as the installed `kv-connectors-proxy` command (`pip install 'kv-connectors[proxy]'`): the
code is the `kv_connectors.proxy` package; `--help` lists every flag.
"""

from __future__ import annotations

from kv_connectors.proxy import main

if __name__ == "__main__":
    main()
