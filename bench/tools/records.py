"""The lab's JSON records read under today's optimizer names.

An entry renamed in the library's registry (``dobb.registry.RENAMED``: ``dobb2s`` is now
``dobb_sign``) keeps its old name in the records written before: results keyed by it, run
names (``dobb2s-lr0.008``), commands (``--optimizers dobb2s``), record fields
(``dobb2s_row_blocks``). ``read_record`` reads a record with every such name, in keys and
in string values, replaced by the new one, so that reports render an old record as they
render a new one (a test renders RESULTS.md from its JSON written under the old names).
"""

import json
import re
from pathlib import Path
from typing import Any

from dobb.registry import RENAMED

# an old name as a whole word: not inside a longer name, though a field may extend it
# (``dobb2s_row_blocks``)
OLD_NAMES = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, RENAMED)) + r")(?![A-Za-z0-9])")


def current_names(text: str) -> str:
    """``text`` with each old optimizer name replaced by its new one."""
    return OLD_NAMES.sub(lambda m: RENAMED[m.group(1)], text)


def _renamed(value: Any) -> Any:
    if isinstance(value, str):
        return current_names(value)
    if isinstance(value, list):
        return [_renamed(v) for v in value]
    if isinstance(value, dict):
        return {current_names(k): _renamed(v) for k, v in value.items()}
    return value


def read_record(path: Path) -> Any:
    """The JSON in ``path``, under today's optimizer names."""
    return _renamed(json.loads(Path(path).read_text()))
