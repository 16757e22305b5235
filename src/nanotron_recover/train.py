"""``python -m nanotron_recover.train --config C``: the per-rank entry point mpirun starts."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
