"""Which device each rank trains on: the CPU, or a GPU agreed on by every rank.

A job whose ranks disagree (one sees a GPU, another does not) would otherwise hang or
fail on one rank only; :func:`pick_device` decides collectively. Example::

    >>> try:
    ...     device = hsgd.pick_device("cuda")      # or "cpu", "auto"
    ... except hsgd.InputError as exc:              # raised on every rank alike
    ...     sys.exit(f"error: {exc}")
    >>> model = Net().to(device)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import torch

from ._core.agree import collective_error
from .errors import InputValueError

if TYPE_CHECKING:  # importing mpi4py.MPI initializes MPI: not at import time
    from mpi4py import MPI

__all__ = ["pick_device", "on_host", "DEVICES"]

#: What :func:`pick_device` takes.
DEVICES = ("cpu", "cuda", "auto")


def on_host(comm: Optional[MPI.Comm] = None) -> Tuple[int, int]:
    """This rank's index among the ranks of ``comm`` (default: the world) on its host (the
    physical machine, whatever ``HSGD_RANKS_PER_NODE`` makes the nodes), and their number.
    Collective."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return host.Get_rank(), host.Get_size()
    finally:
        host.Free()


def pick_device(choice: str = "auto", comm: Optional[MPI.Comm] = None,
                host_rank: Optional[int] = None) -> torch.device:
    """The device this rank trains on, the same kind on every rank of ``comm`` (default: the
    world). Collective.

    ``choice``: ``"cpu"``; ``"cuda"``: a GPU, and an :class:`~hsgd.errors.InputValueError` on
    every rank if torch sees none on some rank (``torch.cuda.is_available()``, the minimum over
    the ranks); ``"auto"``: a GPU where every rank sees one, else the CPU. With a GPU, each rank
    takes GPU ``host_rank % torch.cuda.device_count()`` of its host (``torch.cuda.set_device``;
    ``host_rank`` default: ``hsgd.devices.on_host()``'s), so that the ranks of a host spread over its GPUs
    and share them when there are fewer GPUs than ranks.
    """
    if choice not in DEVICES:
        raise InputValueError(f"unknown device {choice!r}; use one of {', '.join(DEVICES)}")
    if choice == "cpu":
        return torch.device("cpu")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    everywhere = comm.allreduce(int(torch.cuda.is_available()), op=MPI.MIN)
    if not everywhere:
        if choice == "cuda":
            raise collective_error(InputValueError, "--device cuda, but torch sees no GPU on at least "
                                   "one rank; use --device cpu or auto")
        return torch.device("cpu")
    if host_rank is None:
        host_rank = on_host(comm)[0]
    index = host_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
