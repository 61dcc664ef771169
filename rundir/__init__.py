"""The run directory: the one owner of its layout (see :mod:`clipforge.rundir.run`)."""

from .checkpoints import CheckpointIndex
from .record import HEADLINE_METRICS, InputShape, RunRecord
from .run import RunDir, RunDirError

__all__ = ["HEADLINE_METRICS", "CheckpointIndex", "InputShape", "RunDir", "RunDirError", "RunRecord"]
