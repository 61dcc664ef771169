"""Rank 0 decides, every rank acts on the same answer: one value, or one user's-mistake error raised everywhere.

A job of many ranks must not have rank 0 refuse a bad input while the others wait in a collective
forever, nor have every rank hit the filesystem with the same check. Rank 0 runs the decision; the
answer (a value, or the :class:`UserError` it raised) is broadcast over the job's transport, torch's
process group or MPI, and every rank returns the value or raises the same error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from clipforge.base.errors import UserError

T = TypeVar("T")


def rank_zero_decides(
    decide: Callable[[], T],
    is_root: bool,
    share: Callable[[Any], Any],
    error: type[UserError] | None = None,
) -> T:
    """``decide()`` on the root, its value (or the ``UserError`` it raised) on every rank.

    Parameters
    ----------
    share:
        Broadcasts the root's answer and returns it on every rank: :func:`over_torch` or :func:`over_mpi`.
    error:
        Re-raise the root's refusal as this class (the caller's room's error), keeping its message.
    """
    answer: Any = None
    if is_root:
        try:
            answer = decide()
        except UserError as exc:
            answer = exc if error is None else error(str(exc))
    answer = share(answer)
    if isinstance(answer, UserError):
        raise answer
    return answer


def over_torch(value: Any) -> Any:
    """Broadcast ``value`` from rank 0 of torch's default process group (as is without one)."""
    import torch.distributed as dist

    from .distenv import collective_device

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=collective_device())
    return box[0]


def over_mpi(comm) -> Callable[[Any], Any]:
    """Broadcast from rank 0 of the MPI communicator ``comm``."""
    return lambda value: comm.bcast(value, root=0)
