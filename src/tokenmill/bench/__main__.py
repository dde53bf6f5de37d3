import sys

from tokenmill.bench.cli import main

sys.exit(main())
