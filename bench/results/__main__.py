"""`python -m bench.results`: see ``bench.results``."""

import sys

from bench.results import main

main(sys.argv[1:])
