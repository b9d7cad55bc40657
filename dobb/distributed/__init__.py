"""Distributed helpers: communication accounting."""

from dobb.distributed.comm import CommEvent, CommRecorder

__all__ = ["CommEvent", "CommRecorder"]
