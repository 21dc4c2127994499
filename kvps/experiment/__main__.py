"""python -m kvps.experiment: the same as `kvps experiment` (see kvps/experiment/cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
