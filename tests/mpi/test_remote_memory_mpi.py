"""RemoteMemory under mpiexec: closed-form results, atomic sums, the lock, progress, bad input.

No ``with RemoteMemory(...)``: close is collective, so after a failed assertion on one
rank it would hang; the conftest aborts the job instead.
"""

import time

import numpy as np
import pytest
import torch

from hsgd import InputTypeError, InputValueError, RemoteMemory, Topology

# 64-byte chunks: every transfer of more than 16 float32 / 8 float64 elements is split
SMALL_CHUNK = 64


@pytest.mark.parametrize("owners", [None, [0], "two"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_write_read_accumulate_closed_form(comm, owners, dtype):
    rank, size = comm.Get_rank(), comm.Get_size()
    if owners == "two":
        if size == 1:
            pytest.skip("two owners need two ranks")
        owners = [0, size - 1]
    per = 37  # a slice per rank: crosses chunk and (with two owners) shard borders
    numel = per * size + 5
    mem = RemoteMemory(comm, numel, dtype=dtype, owners=owners, chunk_bytes=SMALL_CHUNK)
    assert mem.version == 0
    out = torch.full((numel,), -1, dtype=dtype)
    mem.read(0, out)
    assert torch.equal(out, torch.zeros(numel, dtype=dtype))  # starts zero-filled
    comm.Barrier()
    mem.write(rank * per, torch.full((per,), rank + 1.0, dtype=dtype))
    mem.accumulate(0, torch.full((numel,), float(rank + 1), dtype=dtype))
    comm.Barrier()
    want = torch.full((numel,), size * (size + 1) / 2, dtype=dtype)
    # a write and the accumulates hit the same elements in no fixed order; read
    # only the 5-element tail nobody wrote, and check the written parts separately below
    tail = torch.empty(5, dtype=dtype)
    mem.read(per * size, tail)
    assert torch.equal(tail, want[:5])
    assert mem.version == 2 * size
    comm.Barrier()
    # written slices, with no concurrent accumulate: exact values
    mem.write(rank * per, torch.full((per,), rank + 1.0, dtype=dtype))
    comm.Barrier()
    whole = torch.empty(2, numel // 2, dtype=dtype)  # any shape; reads the first 2 * (numel // 2)
    mem.read(0, whole)
    expect = torch.cat([torch.full((per,), r + 1.0, dtype=dtype) for r in range(size)]
                       + [want[:5]])[:whole.numel()]
    assert torch.equal(whole.reshape(-1), expect)
    # a read of a few elements in the middle of a shard and across the border
    for start in (1, per - 3, numel - 7):
        piece = torch.empty(7, dtype=dtype)
        mem.read(start, piece)
        full = torch.cat([expect, want[:numel - expect.numel()]])
        assert torch.equal(piece, full[start:start + 7]), start
    comm.Barrier()
    mem.close()


def test_concurrent_accumulates_lose_no_update(comm):
    size = comm.Get_size()
    rounds, numel = 200, 24
    mem = RemoteMemory(comm, numel, owners=sorted({0, size - 1}), chunk_bytes=SMALL_CHUNK)
    comm.Barrier()
    one = torch.ones(numel)
    for _ in range(rounds):
        mem.accumulate(0, one)
    comm.Barrier()
    out = torch.empty(numel)
    mem.read(0, out)
    assert torch.equal(out, torch.full((numel,), float(rounds * size)))
    assert mem.version == rounds * size
    comm.Barrier()
    mem.close()


def test_lock_excludes_a_read_modify_write(comm):
    """Increment one element with plain read and write under the lock: no increment is lost."""
    size, rounds = comm.Get_size(), 15
    mem = RemoteMemory(comm, 4, dtype=torch.float64, owners=[size - 1])
    comm.Barrier()
    value = torch.empty(1, dtype=torch.float64)
    for _ in range(rounds):
        with mem.lock():
            mem.read(2, value)
            mem.write(2, value + 1)
    comm.Barrier()
    mem.read(2, value)
    assert value.item() == rounds * size
    comm.Barrier()
    mem.close()


def test_lock_held_one_second_delays_the_others_one_to_two_seconds(comm):
    rank = comm.Get_rank()
    if comm.Get_size() == 1:
        pytest.skip("needs a second rank to wait")
    mem = RemoteMemory(comm, 8)
    held = mem.lock()
    if rank == 0:
        held.__enter__()
    start = time.monotonic()  # before the barrier: rank 0 sleeps after it, so waits are >= 1.05 s
    comm.Barrier()
    if rank == 0:
        time.sleep(1.05)
        held.__exit__(None, None, None)
    else:
        with mem.lock():
            waited = time.monotonic() - start
        assert 1.0 <= waited <= 2.0, waited
    comm.Barrier()
    mem.close()


def test_lock_is_not_reentrant_and_release_needs_the_holder(comm):
    mem = RemoteMemory(comm, 8)
    with mem.lock():
        with pytest.raises(RuntimeError, match="not re-entrant"):
            with mem.lock():
                pass
    comm.Barrier()
    with pytest.raises(RuntimeError, match="not held by this rank"):
        mem._ctl.release()  # the lock word, released without holding it
    comm.Barrier()
    mem.close()


def test_operations_progress_while_the_owner_computes(comm):
    """The owner runs no MPI call: it spins on its own memory until every other rank's mark arrives."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("needs ranks other than the owner")
    numel = 1 << 16  # larger than one chunk below
    mem = RemoteMemory(comm, numel, owners=[0], chunk_bytes=1 << 14)
    comm.Barrier()
    if rank == 0:
        shard = np.frombuffer(mem._win.tomemory(), dtype=np.float32)
        deadline = time.monotonic() + 60
        while shard[-1] != size - 1 and time.monotonic() < deadline:
            pass  # pure computation: no MPI call until all marks are in
        assert shard[-1] == size - 1, "the other ranks' operations waited for the owner"
    else:
        data = torch.full((numel - 1,), float(rank))
        mem.write(0, data)
        back = torch.empty(numel - 1)
        mem.read(0, back)
        with mem.lock():
            mem.accumulate(numel - 1, torch.ones(1))  # the mark
    comm.Barrier()
    mem.close()


def test_emulated_nodes_default_to_one_owner_per_node(comm):
    size = comm.Get_size()
    topo = Topology.from_comm(comm, ranks_per_node=2)
    mem = RemoteMemory(comm, 100, topology=topo)
    leaders = list(range(0, size, 2))
    assert list(mem.owners) == leaders
    assert [s[0] for s in mem.shards] == leaders and mem.shards[-1][2] == 100
    mine = topo.rank - topo.local_rank
    direct_owners = [owner for owner in mem.owners if mem.direct_view(owner) is not None]
    assert set(direct_owners) <= {mine}  # only its own node's owner, if any
    if topo.is_leader:
        assert mine in direct_owners  # its own shard, always
    mem.accumulate(0, torch.ones(100))
    comm.Barrier()
    out = torch.empty(100)
    mem.read(0, out)
    assert torch.equal(out, torch.full((100,), float(size)))
    inter = mem.traffic.inter_bytes
    local_share = 0 if mine not in mem.owners else (mem.shards[leaders.index(mine)][2]
                                                     - mem.shards[leaders.index(mine)][1])
    assert inter == 2 * (100 - local_share) * 4  # accumulate + read, the other nodes' shards
    comm.Barrier()
    mem.close()
    topo.close()


@pytest.mark.parametrize("kwargs,error,text", [
    ({"numel": 0}, InputValueError, "numel"),
    ({"numel": 10, "dtype": torch.float16}, InputTypeError, "dtype"),
    ({"numel": 10, "owners": [99]}, InputValueError, "owners holds rank 99"),
    ({"numel": 10, "owners": [0, 0]}, InputValueError, "twice"),
    ({"numel": 10, "owners": []}, InputValueError, "at least one"),
    ({"numel": 10, "owners": "0"}, InputTypeError, "sequence"),
    ({"numel": 10, "chunk_bytes": 2}, InputValueError, "chunk_bytes"),
])
def test_bad_arguments_raise_on_every_rank(comm, kwargs, error, text):
    with pytest.raises(error, match=text):
        RemoteMemory(comm, **kwargs)
    comm.Barrier()


def test_different_arguments_on_ranks_raise_on_every_rank(comm):
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(InputValueError, match="different RemoteMemory arguments"):
        RemoteMemory(comm, 10 + comm.Get_rank())
    comm.Barrier()


def test_bad_operations_raise_before_any_mpi_call(comm):
    mem = RemoteMemory(comm, 10)
    with pytest.raises(ValueError, match=r"\[8, 12\) are outside"):
        mem.write(8, torch.ones(4))
    with pytest.raises(ValueError, match="outside"):
        mem.read(-1, torch.empty(2))
    with pytest.raises(TypeError, match="float64"):
        mem.accumulate(0, torch.ones(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="offset must be an int"):
        mem.write(1.0, torch.ones(2))
    with pytest.raises(TypeError, match="torch.Tensor"):
        mem.write(0, [1.0, 2.0])
    mem.close()
    mem.close()  # idempotent
    for call in (lambda: mem.write(0, torch.ones(1)), lambda: mem.read(0, torch.empty(1)),
                 lambda: mem.accumulate(0, torch.ones(1)), lambda: mem.version):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    with pytest.raises(RuntimeError, match="closed"):
        with mem.lock():
            pass


def test_no_communicator_means_the_world(comm):
    mem = RemoteMemory(None, 4, dtype=torch.float64)
    assert mem.comm == comm
    mem.accumulate(0, torch.ones(4, dtype=torch.float64))
    comm.Barrier()
    out = torch.empty(4, dtype=torch.float64)
    mem.read(0, out)
    assert out.tolist() == [comm.Get_size()] * 4
    mem.close()
