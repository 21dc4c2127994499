"""python -m kvps.scheduler: run a scheduler (see `kvps scheduler --help`)."""
import sys

from kvps.cli import main

if __name__ == "__main__":
    sys.exit(main(["scheduler", *sys.argv[1:]]))
