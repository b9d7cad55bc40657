"""The Dobb configurations tests pin: the paper's (``dobb.registry.PAPER_DOBB``: one-sided,
16 input blocks, the sign, statistics averaged on refresh steps), which most of Dobb's
invariants, references and counts are written for, whatever the class's defaults (the
recommended two-sided configuration) are."""

import dobb
from dobb.registry import PAPER_DOBB

PAPER = {k: v for k, v in PAPER_DOBB.items() if k != "lr"}


def paper(**options) -> dict:
    """The paper's options under ``options`` (a block width replaces its block count)."""
    base = dict(PAPER)
    if options.get("block_size") is not None:
        base.pop("num_blocks")
    return base | options


def PaperDobb(params, **options) -> dobb.Dobb:
    """``dobb.Dobb`` in the paper's configuration, ``options`` on top."""
    return dobb.Dobb(params, **paper(**options))
