"""python -m kvps.tools.experiment: the same as `kvps experiment` (see kvps/tools/experiment/cli.py)."""
import sys

from kvps.tools.experiment.cli import main

if __name__ == "__main__":
    sys.exit(main())
