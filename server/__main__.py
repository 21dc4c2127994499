"""python -m kvps.server: run a server (see `kvps server --help`)."""
import sys

from kvps.cli import main

if __name__ == "__main__":
    sys.exit(main(["server", *sys.argv[1:]]))
