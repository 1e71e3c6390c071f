"""`python -m kvgate.bench`: the same as `kvgate bench`."""

import sys

from kvgate.bench.cli import main

sys.exit(main())
