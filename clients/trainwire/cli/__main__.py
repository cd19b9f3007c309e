"""``python -m trainwire.cli``: the same as the ``trainwire`` console script."""

from __future__ import annotations

import sys

from trainwire.cli import main

if __name__ == "__main__":
    sys.exit(main())
