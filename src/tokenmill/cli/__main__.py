"""`python -m tokenmill.cli`: the console script."""
import sys

from tokenmill.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
