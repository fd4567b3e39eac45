"""hsgd's tensor collectives and rank helpers against their closed forms, at every world size."""

import pytest
import torch

import hsgd
from hsgd import InputTypeError, InputValueError, Topology

SHAPES = [(), (5,), (2, 3, 4)]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTEGERS = [torch.int32, torch.int64, torch.uint8]


def still_in_step(comm):
    """After an error every rank must still be at the same collective: no rank left behind."""
    assert hsgd.allreduce(torch.tensor([1.0]), op="sum", comm=comm).item() == comm.Get_size()


def test_rank_helpers(comm):
    assert (hsgd.rank(), hsgd.size()) == (comm.Get_rank(), comm.Get_size())
    with Topology.from_comm(comm) as topo:
        assert (hsgd.local_rank(), hsgd.local_size()) == (topo.local_rank, topo.local_size)
        dup = comm.Dup()  # another communicator: a topology of its own, built and freed per call
        assert (hsgd.local_rank(dup), hsgd.local_size(dup)) == (topo.local_rank, topo.local_size)
        dup.Free()
    hsgd.barrier()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOATS + INTEGERS)
def test_allreduce_of_rank_valued_tensors(comm, shape, dtype, device):
    size, rank = comm.Get_size(), comm.Get_rank()
    mine = torch.full(shape, rank + 1, dtype=dtype, device=device)
    ops = {"sum": size * (size + 1) / 2, "min": 1, "max": size}
    if dtype.is_floating_point:
        ops["mean"] = (size + 1) / 2
    for op, want in ops.items():
        got = hsgd.allreduce(mine, op=op)
        assert got.dtype == dtype and got.shape == mine.shape and got.device == mine.device, (op, got)
        assert torch.equal(got, torch.full(shape, want, dtype=dtype, device=device)), (op, got, want)
        assert torch.equal(mine, torch.full(shape, rank + 1, dtype=dtype, device=device))  # the input is untouched
        inplace = mine.clone()
        assert hsgd.allreduce_(inplace, op=op) is inplace and torch.equal(inplace, got)


def test_allreduce_in_place_on_a_non_contiguous_view(comm, device):
    size, rank = comm.Get_size(), comm.Get_rank()
    base = torch.full((3, 4), float(rank), dtype=torch.float64, device=device)
    view = base.t()
    hsgd.allreduce_(view, op="sum")
    assert torch.equal(base, torch.full((3, 4), size * (size - 1) / 2, dtype=torch.float64, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool])
def test_allgather_concatenates_rows_of_every_rank(comm, dtype, device):
    size, rank = comm.Get_size(), comm.Get_rank()
    rows = rank  # rank 0 gives none: first dimensions differ
    mine = torch.full((rows, 2), rank % 2 if dtype == torch.bool else rank, dtype=dtype, device=device)
    got = hsgd.allgather(mine)
    want = torch.cat([torch.full((r, 2), r % 2 if dtype == torch.bool else r, dtype=dtype, device=device)
                      for r in range(size)])
    assert got.dtype == dtype and got.device == mine.device and torch.equal(got, want), got
    scalars = hsgd.allgather(torch.tensor(rank * 10, dtype=dtype if dtype != torch.bool else torch.int64,
                                          device=device))
    assert scalars.tolist() == [r * 10 for r in range(size)]


@pytest.mark.parametrize("shape", SHAPES)
def test_broadcast_from_the_last_rank(comm, shape, device):
    size, rank = comm.Get_size(), comm.Get_rank()
    root = size - 1
    mine = torch.full(shape, float(rank), dtype=torch.float64, device=device)
    got = hsgd.broadcast(mine, root_rank=root)
    assert got.device == mine.device and torch.equal(got, torch.full(shape, float(root), dtype=torch.float64,
                                                                      device=device))
    assert torch.equal(mine, torch.full(shape, float(rank), dtype=torch.float64, device=device))  # a new tensor
    assert hsgd.broadcast_(mine, root_rank=root) is mine and torch.equal(mine, got)


def test_python_objects(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    assert hsgd.allreduce_object(rank) == (size - 1) / 2
    assert hsgd.allreduce_object(rank, op="sum") == size * (size - 1) // 2
    assert hsgd.allreduce_object(rank, op="max") == size - 1 and hsgd.allreduce_object(rank, op="min") == 0
    assert hsgd.allgather_object({"rank": rank}) == [{"rank": r} for r in range(size)]
    assert hsgd.broadcast_object(f"from {rank}", root_rank=size - 1) == f"from {size - 1}"
    with pytest.raises(InputTypeError, match="cannot reduce"):
        hsgd.allreduce_object(object(), op="mean")  # object() + object(), or object() / 1
    still_in_step(comm)


def test_bad_arguments_raise_the_same_error_on_every_rank(comm):
    size = comm.Get_size()
    with pytest.raises(InputValueError, match="unknown op 'avg'"):
        hsgd.allreduce(torch.ones(2), op="avg")
    with pytest.raises(InputTypeError, match="op='mean' of a torch.int64 tensor"):
        hsgd.allreduce(torch.ones(2, dtype=torch.int64))
    with pytest.raises(InputTypeError, match="takes a torch.Tensor"):
        hsgd.allreduce([1.0, 2.0])
    with pytest.raises(InputValueError, match=f"root_rank must be a rank from 0 to {size - 1}"):
        hsgd.broadcast(torch.ones(2), root_rank=size)
    with pytest.raises(InputValueError, match="root_rank"):
        hsgd.broadcast_object(1, root_rank=-1)
    still_in_step(comm)


def test_mismatches_between_ranks_raise_on_every_rank(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    last = rank == size - 1
    cases = [
        (lambda: hsgd.allreduce(torch.ones(3 if last else 2)), rf"shape=\(3,\) on rank {size - 1} but shape=\(2,\)"),
        (lambda: hsgd.allreduce(torch.ones(2, dtype=torch.float64 if last else torch.float32)),
         f"dtype='float64' on rank {size - 1} but dtype='float32' on rank 0"),
        (lambda: hsgd.allreduce(torch.ones(2), op="max" if last else "sum"), "op='max'"),
        (lambda: hsgd.allgather(torch.ones(2, 3 if last else 4)), "row shape"),
        (lambda: hsgd.broadcast(torch.ones(2), root_rank=1 if last else 0), "root_rank=1"),
        (lambda: hsgd.allreduce(torch.ones(2, dtype=torch.int64 if last else torch.float32)),
         "op='mean' of a torch.int64 tensor"),  # an error on one rank reaches all
    ]
    for call, message in cases:
        with pytest.raises((InputValueError, InputTypeError), match=message):
            call()
        still_in_step(comm)
