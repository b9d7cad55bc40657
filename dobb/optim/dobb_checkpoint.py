"""Reading a DCP checkpoint that holds Dobb's state in the keys written up to commit d368fca.

``Dobb.load_state_dict`` renames those keys (``cov``, ``cov_tail``, ``row_basis``, ...:
``dobb.optim.dobb_layout.LEGACY_KEYS``) itself; DCP never shows it the saved keys: it
reads each entry of the state dict it is given (today's keys, from
``get_optimizer_state_dict``) by that entry's name, and an old checkpoint has none by that
name. ``LegacyKeysLoadPlanner`` reads such an entry from the old name instead::

    dcp.load(state, checkpoint_id=path, planner=LegacyKeysLoadPlanner())

A loader that takes no planner (torchtitan's ``CheckpointManager``) needs the checkpoint
converted once instead: ``convert_legacy_checkpoint(old_dir, new_dir)`` writes a copy in
today's keys (in one process, holding the whole checkpoint in memory; DCP reshards it on
load as any other).

Imported on its own (``torch.distributed.checkpoint`` is not imported by ``dobb``).
"""

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.planner import LoadPlan

from dobb.optim.dobb_layout import LEGACY_KEYS, OLD_NAMES


class LegacyKeysLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner``, but an entry ``<path>.<key>`` of Dobb's state that the
    checkpoint lacks is read, in place, from ``<path>.<old name of key>`` where the
    checkpoint has that (``OLD_NAMES``: ``input_cov_0`` from ``cov``, ``row_basis_1`` from
    ``row_basis_tail``, ...). A checkpoint in today's keys loads as with the default."""

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        for key in [k for k in self.state_dict if k not in saved]:
            path, _, name = key.rpartition(".")
            old = f"{path}.{OLD_NAMES.get(name)}"
            if name in OLD_NAMES and old in saved:
                self.state_dict[old] = self.state_dict.pop(key)
                if key in self.mappings:  # its place in the nested dict (flatten_state_dict)
                    self.mappings[old] = self.mappings.pop(key)
        return super().create_local_plan()


def convert_legacy_checkpoint(old: str | Path, new: str | Path) -> int:
    """Write the DCP checkpoint ``old`` to ``new`` with every Dobb matrix state's old keys
    renamed (``LEGACY_KEYS``); returns how many entries were renamed. A Dobb matrix state
    is a dict holding ``momentum`` and ``stats_steps``; nothing else is touched."""
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(old, whole)
        state = torch.load(whole, weights_only=False)
        renamed = _rename_legacy_keys(state)
        torch.save(state, whole)
        torch_save_to_dcp(whole, new)
    return renamed


def _rename_legacy_keys(tree: Any) -> int:
    """Rename the old keys of every Dobb matrix state in the nested dict ``tree``."""
    if not isinstance(tree, dict):
        return 0
    if {"momentum", "stats_steps"} <= tree.keys():
        old = [key for key in tree if key in LEGACY_KEYS]
        for key in old:
            tree[LEGACY_KEYS[key]] = tree.pop(key)
        return len(old)
    return sum(_rename_legacy_keys(value) for value in tree.values())
