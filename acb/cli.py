"""``python -m acb.cli`` and the ``acb`` command: the command line lives in :mod:`acb.serving.cli`."""

import sys

from .serving.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
