"""Reading a DCP checkpoint that holds Dobb's state in the keys written up to commit d368fca.

``Dobb.load_state_dict`` renames those keys (``cov``, ``cov_tail``, ``row_basis``, ...:
``dobb.optim.dobb_layout.LEGACY_KEYS``) itself; DCP never shows it the saved keys: it
reads each entry of the state dict it is given (today's keys, from
``get_optimizer_state_dict``) by that entry's name, and an old checkpoint has none by that
name. ``LegacyKeysLoadPlanner`` reads such an entry from the old name instead::

    dcp.load(state, checkpoint_id=path, planner=LegacyKeysLoadPlanner())

Imported on its own (``torch.distributed.checkpoint`` is not imported by ``dobb``).
"""

from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan

from dobb.optim.dobb_layout import OLD_NAMES


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
