"""Layer 2: the contiguous-read loader on however many ranks mpiexec started.

Rank 0 writes the files into the ``shared_dir`` fixture's directory (conftest);
every file is complete before any rank opens it (:func:`write_on_root`
agrees on rank 0's outcome, which also orders the write before the reads).
"""

import numpy as np
import pytest
from _files import write_on_root
from mpi4py import MPI

from hsgd.parallel_io import ContiguousH5Loader

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def data(n):
    return np.arange(n * 3, dtype=np.float32).reshape(n, 3), np.arange(n) % 10


@pytest.mark.parametrize("drop_last,pad", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_together_see_a_permutation(shared_dir, drop_last, pad, shuffle):
    n, batch = 263, 5
    x, y = data(n)
    path = write_on_root(shared_dir / "perm.h5", x=x, y=y)
    with ContiguousH5Loader(path, batch_size=batch, block_size=16, drop_last=drop_last,
                            pad=pad, shuffle=shuffle, seed=4, return_indices=True) as loader:
        mine = []
        for xb, yb, idx in loader:
            np.testing.assert_array_equal(xb.numpy(), x[idx.numpy()])
            np.testing.assert_array_equal(yb.numpy(), y[idx.numpy()])
            mine.append(idx.numpy())
        lengths = COMM.allgather((len(loader), len(mine)))
    assert all(expected == got for expected, got in lengths)
    seen = np.concatenate(COMM.allgather(np.concatenate(mine)))
    if pad:
        assert len(set(lengths)) == 1  # equal batch counts: nobody waits for an extra step
    if drop_last:
        assert len(np.unique(seen)) == len(seen) and 0 <= n - len(seen) < SIZE * batch
    elif pad:
        assert np.array_equal(np.unique(seen), np.arange(n))
        assert 0 <= len(seen) - n < SIZE * batch
    else:
        assert np.array_equal(np.sort(seen), np.arange(n))


def test_epochs_differ_and_agree_across_ranks(shared_dir):
    x, y = data(120)
    path = write_on_root(shared_dir / "epochs.h5", x=x, y=y)
    with ContiguousH5Loader(path, batch_size=2, block_size=8, return_indices=True) as loader:
        epochs = [np.concatenate([b[2].numpy() for b in loader]) for _ in range(2)]
    everyone = COMM.allgather(epochs)
    for epoch in range(2):
        union = np.concatenate([e[epoch] for e in everyone])
        assert len(np.unique(union)) == len(union)
    assert not any(np.array_equal(first, second) for first, second in everyone)


def test_a_topology_or_a_comm_gives_the_same_loader(shared_dir):
    from hsgd.topology import Topology

    x, y = data(60)
    path = write_on_root(shared_dir / "topo.h5", x=x, y=y)
    topology = Topology.from_comm()  # a collective close(): at the end, not in a with-block
    with ContiguousH5Loader(path, batch_size=2, topology=topology) as a, \
            ContiguousH5Loader(path, batch_size=2, comm=COMM) as b:
        assert (a.rank, a.world_size, len(a)) == (b.rank, b.world_size, len(b))
        assert np.array_equal(a.plan().indices(), b.plan().indices())
    topology.close()


def outcome(build):
    """``(built-in type name, message)`` of what ``build()`` raised, or None."""
    try:
        build().close()
    except Exception as exc:  # noqa: BLE001 - compared across ranks below
        builtin = next(c for c in type(exc).__mro__ if c.__module__ == "builtins")
        return builtin.__name__, str(exc)
    return None


def assert_same_error_everywhere(build, kind, text):
    everyone = COMM.allgather(outcome(build))
    assert everyone[0] is not None and everyone[0][0] == kind and text in everyone[0][1]
    assert all(o == everyone[0] for o in everyone), everyone


def test_bad_input_raises_the_same_error_on_every_rank(shared_dir):
    x, y = data(40)
    good = write_on_root(shared_dir / "good.h5", x=x, y=y)
    assert_same_error_everywhere(
        lambda: ContiguousH5Loader(good, "inputs", batch_size=1), "ValueError",
        "no data set 'inputs'; it has: 'x' (40, 3) float32")
    assert_same_error_everywhere(
        lambda: ContiguousH5Loader(good, batch_size=40 // SIZE + 1), "ValueError",
        "needed for one batch per rank")


def test_one_rank_with_a_bad_input_does_not_hang_the_others(shared_dir):
    x, y = data(40)
    good = write_on_root(shared_dir / "good1.h5", x=x, y=y)
    y_bad = y.copy()
    y_bad[-1] = -2  # only the last rank's label shard holds it
    bad = write_on_root(shared_dir / "neg.h5", x=x, y=y_bad)
    missing = shared_dir / "missing.h5"
    last = SIZE - 1
    assert_same_error_everywhere(
        lambda: ContiguousH5Loader(missing if RANK == last else good, batch_size=1),
        "FileNotFoundError", "data file not found")
    assert_same_error_everywhere(
        lambda: ContiguousH5Loader(bad, batch_size=1), "ValueError",
        "negative label -2 at sample 39")
    if SIZE > 1:  # the same decision on every rank: SIZE is global
        assert_same_error_everywhere(
            lambda: ContiguousH5Loader(good, batch_size=2 if RANK == last else 1),
            "ValueError", f"batch_size: rank 0 has 1, rank {last} has 2")


def test_batch_shares_split_each_global_batch_by_rank(shared_dir):
    """set_shares: rank r gets shares[r] samples per batch; together the ranks' batches
    are the same global batches, with the same count on every rank; state_dict keeps them."""
    n, batch = 263, 4
    x, y = data(n)
    path = write_on_root(shared_dir / "shares.h5", x=x, y=y)
    with ContiguousH5Loader(path, batch_size=batch, comm=COMM, return_indices=True) as loader:
        equal = [idx for _, _, idx in loader]  # epoch 0, equal batches
    with ContiguousH5Loader(path, batch_size=batch, comm=COMM, return_indices=True) as loader:
        shares = [1 + r for r in range(SIZE)]
        shares[0] += batch * SIZE - sum(shares)
        loader.set_shares(shares)
        assert loader.rank_batch_size == shares[RANK] and len(loader) == len(equal)
        shared = [idx for _, _, idx in loader]  # epoch 0, uneven batches
        assert len(shared) == len(equal) and all(len(idx) == shares[RANK] for idx in shared)
        every = np.concatenate(COMM.allgather(np.concatenate(shared)))
        whole = np.concatenate(COMM.allgather(np.concatenate(equal)))
        assert len(np.unique(every)) == len(every)  # no sample twice
        assert np.array_equal(np.sort(every), np.sort(whole))  # the epoch's samples, split otherwise
        state = loader.state_dict()
        assert state["shares"] == shares
        with pytest.raises(Exception, match="sum to"):
            loader.set_shares([s + 1 for s in shares])
