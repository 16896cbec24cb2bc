"""Example PD proxy for xPyD fleets: `python examples/proxy.py --prefill URL [SIDE_CHANNEL] --decode URL ...`.

The code lives in the `pd_proxy` package next to this script; `--help` lists every flag.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pd_proxy import main  # noqa: E402

if __name__ == "__main__":
    main()
