"""python -m kvps.emulate: the same as `kvps emulate` (see kvps/emulate/cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
