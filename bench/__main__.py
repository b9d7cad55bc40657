"""`python -m bench`: the lab's command (bench/cli.py)."""

import sys

from bench.cli import main

sys.exit(main())
