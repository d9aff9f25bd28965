"""`python -m zero3.cli`: the `zero3` command."""

import sys

from zero3.cli.parser import main

if __name__ == "__main__":
    sys.exit(main())
