"""`python -m parity ARGS`: the `parity` command where its console script is not installed."""

import sys

from parity.cli import main

sys.exit(main())
