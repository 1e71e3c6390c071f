"""`python -m kvgate ...` runs the `kvgate` command (the console script pip installs)."""

import sys

from kvgate.cli import main

sys.exit(main())
