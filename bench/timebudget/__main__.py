"""`python -m bench.timebudget`: see ``bench.timebudget``."""

import sys

from bench.timebudget import main

main(sys.argv[1:])
