"""The one import of DTensor and its mesh types, at the bottom of the tree.

torch can be built without distributed support. There ``DTensor`` and ``DeviceMesh`` are
empty tuples, so ``isinstance(x, DTensor)`` is False for every tensor and the code paths
that need the placement types (``Replicate``, ``Shard``, ``distribute_tensor``, all None
there) are never reached. Every module of dobb imports these names from here.
"""

from torch import Tensor

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    # FSDP2's shard of a dim another mesh axis already split (FSDP x TP, FSDP x EP): the
    # placement torch reports first there; not a ``Shard`` subclass in torch 2.13
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
except ImportError:  # torch built without distributed support: nothing is a DTensor
    DTensor = DeviceMesh = ()
    Replicate = Shard = StridedShard = distribute_tensor = None

__all__ = [
    "DTensor",
    "DeviceMesh",
    "Replicate",
    "Shard",
    "StridedShard",
    "distribute_tensor",
    "local",
]


def local(t: Tensor) -> Tensor:
    """The rank-local tensor behind a DTensor; a plain tensor unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t
