"""`python -m dobb`: the `dobb` command."""

from dobb.cli import main

raise SystemExit(main())
