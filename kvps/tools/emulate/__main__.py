"""python -m kvps.tools.emulate: the same as `kvps emulate` (see kvps/tools/emulate/cli.py)."""
import sys

from kvps.tools.emulate.cli import main

if __name__ == "__main__":
    sys.exit(main())
