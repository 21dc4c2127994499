"""python -m kvps.tools.simulate: the same as `kvps simulate` (see kvps/tools/simulate/cli.py)."""
import sys

from kvps.tools.simulate.cli import main

if __name__ == "__main__":
    sys.exit(main())
