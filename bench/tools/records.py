"""The lab's JSON records read under today's optimizer names.

Two kinds of rename reach the records written before them:

- An entry renamed in the library's registry (``dobb.registry.RENAMED``: ``dobb2s`` is now
  ``dobb_sign``) keeps its old name in them: results keyed by it, run names
  (``dobb2s-lr0.008``), commands (``--optimizers dobb2s``), record fields
  (``dobb2s_row_blocks``). The old name means nothing else, so every occurrence is replaced.
- A lab name given to another configuration (``LAB_RENAMED``): the lab's ``dobb`` was the
  paper's configuration, which is ``dobb_paper`` now, and ``dobb`` the library's default.
  Records the lab writes carry ``LAB_NAMES`` (``stamped``); in one without it, ``dobb``
  where a record names an optimizer (a key, a whole value, a run name ``dobb-...``, an
  ``--optimizers`` list, the call-time ratio's field) is read as ``dobb_paper``. Elsewhere
  (``python -m dobb train``) the word is the package and stays.

``read_record`` reads a record so, so that reports render an old record as they render a
new one (tests render RESULTS.md from JSON written under the old names).
"""

import json
import re
from pathlib import Path
from typing import Any

from dobb.registry import RENAMED

# an old name as a whole word: not inside a longer name, though a field may extend it
# (``dobb2s_row_blocks``)
OLD_NAMES = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, RENAMED)) + r")(?![A-Za-z0-9])")
LAB_RENAMED = {"dobb": "dobb_paper"}  # lab names given to another configuration: old -> new
LAB_NAMES = 2  # the lab's naming that its records carry (``stamped``); 1: before LAB_RENAMED
RATIO_FIELDS = {f"ratio_vs_{old}": f"ratio_vs_{new}" for old, new in LAB_RENAMED.items()}
RUN_NAME = re.compile(r"([a-z0-9_]+)(-\S*)")  # a run directory's name: optimizer-options-lr
OPTIMIZERS_ARG = re.compile(r"(--optimizers[ =])(\S+)")


def current_names(text: str) -> str:
    """``text`` with each old optimizer name replaced by its new one."""
    return OLD_NAMES.sub(lambda m: RENAMED[m.group(1)], text)


def stamped(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` marked as written under today's lab names (``LAB_NAMES``)."""
    return record | {"lab_names": LAB_NAMES}


def lab_name(text: str) -> str:
    """A string of a record written before ``LAB_RENAMED``, read under today's names: an
    optimizer's name, a run's name, or a command's ``--optimizers`` list."""
    if text in LAB_RENAMED:
        return LAB_RENAMED[text]
    run = RUN_NAME.fullmatch(text)
    if run and run.group(1) in LAB_RENAMED:
        return LAB_RENAMED[run.group(1)] + run.group(2)

    def names(m: re.Match) -> str:
        return m.group(1) + ",".join(LAB_RENAMED.get(n, n) for n in m.group(2).split(","))

    return OPTIMIZERS_ARG.sub(names, text)


def _renamed(value: Any, lab: bool) -> Any:
    """``value`` with registry renames applied, and (``lab``) the lab's ``LAB_RENAMED``."""
    if isinstance(value, str):
        return current_names(lab_name(value) if lab else value)
    if isinstance(value, list):
        return [_renamed(v, lab) for v in value]
    if isinstance(value, dict):
        return {_key(k, lab): _renamed(v, lab) for k, v in value.items()}
    return value


def _key(key: str, lab: bool) -> str:
    if lab:
        key = LAB_RENAMED.get(key, RATIO_FIELDS.get(key, key))
    return current_names(key)


def read_record(path: Path) -> Any:
    """The JSON in ``path``, under today's optimizer names."""
    record = json.loads(Path(path).read_text())
    lab = not (isinstance(record, dict) and record.get("lab_names") == LAB_NAMES)
    return _renamed(record, lab)
