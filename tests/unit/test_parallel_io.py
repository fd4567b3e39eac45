"""Layer 1: the contiguous-read loader without mpiexec.

Planning is pure arithmetic, so every world size 1-5 is simulated in one
process; loader tests use a fake communicator (``FakeComm``) that plays one
rank of a world whose other ranks agree with it.
"""

import gc
import subprocess
import sys
import threading

import h5py
import numpy as np
import pytest
import torch
from _plans import batch_indices

from hsgd import InputError
from hsgd._io import h5source as _h5source
from hsgd._io import prefetch as _prefetch
from hsgd._io.loader_setup import check_settings_agree
from hsgd._io.plan import default_window_blocks
from hsgd.parallel_io import ContiguousH5Loader, default_block_size, plan_epoch, shard_range


class FakeComm:
    """Rank ``rank`` of ``size`` ranks that all hold the same values."""

    def __init__(self, rank=0, size=1):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def allgather(self, value):
        return [value] * self.size


def make_h5(path, n=257, shape=(5,), dtype=np.float32, layout="chunked", y_dtype=np.int32):
    x = (np.arange(n * int(np.prod(shape))) % 251).astype(dtype).reshape(n, *shape)
    y = (np.arange(n) % 10).astype(y_dtype)
    options = {"contiguous": {}, "chunked": {"chunks": (16, *shape)},
               "gzip": {"chunks": (16, *shape), "compression": "gzip"}}[layout]
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, **options)
        f.create_dataset("y", data=y, **({} if layout == "contiguous" else {"chunks": (16,)}))
    return x, y


def loader(path, rank=0, size=1, **kw):
    if "global_batch" not in kw:
        kw.setdefault("batch_size", 8)
    kw.setdefault("return_indices", True)
    return ContiguousH5Loader(path, comm=FakeComm(rank, size), **kw)


def epoch_indices(ld):
    return [idx.numpy().copy() for _, _, idx in ld]


# ---- planning arithmetic -------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n,batch,block", [(97, 3, 7), (103, 4, 10), (1000, 8, 64),
                                           (61, 2, 1), (50, 5, 500)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_plan_permutation_and_equal_counts(world, n, batch, block, drop_last):
    for epoch in (0, 3):
        plans = [plan_epoch(n, world, r, batch, block, seed=5, epoch=epoch,
                            drop_last=drop_last) for r in range(world)]
        counts = {p.num_batches for p in plans}
        assert len(counts) == 1
        per_rank = counts.pop() * batch
        assert all(p.num_samples == per_rank for p in plans)
        seen = np.concatenate([p.indices() for p in plans])
        if drop_last:
            assert len(np.unique(seen)) == len(seen) == world * per_rank
            assert 0 <= n - len(seen) < world * batch
        else:
            assert np.array_equal(np.unique(seen), np.arange(n))
            assert 0 <= len(seen) - n < world * batch
        for p in plans:
            assert all(len(b) == batch for b in batch_indices(p))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_plan_segments_are_within_one_block(world):
    n, block = 1003, 37
    for rank in range(world):
        plan = plan_epoch(n, world, rank, 4, block, seed=1, epoch=2, drop_last=False)
        segs = plan.segments
        assert np.all(segs[:, 1] > segs[:, 0])
        assert np.all(segs[:, 0] // block == (segs[:, 1] - 1) // block)
        for w in range(plan.num_windows):  # one stream range per window: range ends, rotation, short block
            assert len(plan.window_segments(w)) <= plan.window_size(w) // block + 3


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_plan_eval_mode_covers_each_sample_once(world):
    n = 101
    plans = [plan_epoch(n, world, r, 8, 9, drop_last=False, pad=False) for r in range(world)]
    seen = np.concatenate([p.indices() for p in plans])
    assert np.array_equal(np.sort(seen), np.arange(n))
    assert max(p.num_samples for p in plans) - min(p.num_samples for p in plans) <= 1
    for r in range(world):  # without shuffling, each rank reads one contiguous shard
        plan = plan_epoch(n, world, r, 8, 9, drop_last=False, pad=False, shuffle=False)
        assert np.array_equal(plan.indices(), np.arange(*shard_range(n, world, r)))


def test_plan_order_depends_on_seed_and_epoch_only():
    def order(seed, epoch):
        return plan_epoch(500, 3, 1, 4, 16, seed=seed, epoch=epoch).indices()
    assert np.array_equal(order(7, 2), order(7, 2))
    assert not np.array_equal(order(7, 2), order(7, 3))
    assert not np.array_equal(order(7, 2), order(8, 2))


def test_plan_without_shuffle_is_file_order():
    plan = plan_epoch(100, 2, 1, 4, 16, shuffle=False)  # global batches of 8: rank 1 takes their second half
    assert np.array_equal(plan.indices(), (np.arange(12)[:, None] * 8 + np.arange(4, 8)).reshape(-1))


def test_plan_rejects_too_few_samples_and_says_how_many():
    with pytest.raises(ValueError, match=r"fewer than world_size x batch_size = 4 x 8 = 32"):
        plan_epoch(31, 4, 0, 8, 10)
    plan_epoch(31, 4, 0, 8, 10, drop_last=False, pad=False)  # evaluation needs no minimum


def test_plan_locate():
    plan = plan_epoch(200, 1, 0, 10, 25, window_blocks=2)
    sizes = [plan.window_size(w) for w in range(plan.num_windows)]
    assert plan.locate(0) == (0, 0)
    assert plan.locate(5) == (1, 50 - sizes[0])
    with pytest.raises(ValueError):
        plan.locate(plan.num_batches + 1)


def test_default_block_size_is_a_few_mib_of_whole_chunks():
    assert default_block_size(160) == (4 << 20) // 160
    rows = default_block_size(12288, chunk_rows=85)
    assert rows % 85 == 0 and 2 << 20 < rows * 12288 < 6 << 20
    assert default_block_size(64 << 20, chunk_rows=3) == 3


def test_default_window_holds_1024_samples_within_16_mib():
    assert default_window_blocks(26214, 160) == 1
    assert default_window_blocks(341, 12288) == 4            # 1364 samples, 16 MiB
    assert default_window_blocks(100, 12288 * 4) == 3        # capped by bytes
    assert default_window_blocks(5, 1 << 30) == 1


# ---- the loader ----------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "chunked", "gzip"])
@pytest.mark.parametrize("shape,dtype", [((5,), np.float32), ((3, 4, 4), np.uint8),
                                         ((), np.float64), ((2, 3), np.int16)])
def test_batches_hold_the_file_rows(tmp_path, layout, shape, dtype):
    x, y = make_h5(tmp_path / "d.h5", shape=shape, dtype=dtype, layout=layout)
    with loader(tmp_path / "d.h5", block_size=20) as ld:
        batches = list(ld)  # keep every batch: none may be overwritten later
    assert len(batches) == len(ld) == 257 // 8
    for xb, yb, idx in batches:
        assert xb.dtype == torch.from_numpy(x[:1]).dtype and xb.shape == (8, *shape)
        assert yb.dtype == torch.int64 and idx.dtype == torch.int64
        np.testing.assert_array_equal(xb.numpy(), x[idx.numpy()])
        np.testing.assert_array_equal(yb.numpy(), y[idx.numpy()])


@pytest.mark.parametrize("layout,shuffle", [("chunked", True), ("gzip", False), ("contiguous", True)])
def test_labels_per_position_come_with_their_rows(tmp_path, layout, shuffle):
    """Token data: y holds one label per position, (N, T) uint8, and is batched as (b, T) int64."""
    tokens = (np.arange(257 * 6 + 1) * 7 % 256).astype(np.uint8)
    x, y = tokens[:-1].reshape(257, 6), tokens[1:].reshape(257, 6)
    options = {} if layout == "contiguous" else {"chunks": (16, 6), "compression": "gzip" if layout == "gzip" else None}
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f.create_dataset("x", data=x, **options)
        f.create_dataset("y", data=y, **options)
    with loader(tmp_path / "t.h5", block_size=20, shuffle=shuffle) as ld:
        assert ld.sample_shape == (6,) and ld.label_shape == (6,)
        batches = list(ld)
    for xb, yb, idx in batches:
        assert xb.dtype == torch.uint8 and yb.dtype == torch.int64 and yb.shape == (8, 6)
        np.testing.assert_array_equal(yb.numpy(), y[idx.numpy()])
        np.testing.assert_array_equal(xb.numpy()[:, 1:], yb.numpy()[:, :-1])


def test_buffer_pool_reuses_only_unreferenced_arrays(tmp_path):
    make_h5(tmp_path / "d.h5")
    with loader(tmp_path / "d.h5") as ld:
        pool = _prefetch._BufferPool(ld._source, capacity=10, keep=2)
        x1, _ = pool.get(10)
        held = torch.from_numpy(x1[2:4])
        del x1
        x2, _ = pool.get(8)
        assert not np.shares_memory(x2, held.numpy())
        del held
        x3, _ = pool.get(10)
        assert np.shares_memory(x3, pool.free[0][0])  # the first one is free again
        assert len(pool.free) == 2 and pool.get(11)[0].shape[0] == 11


def test_dropped_batches_let_the_loader_reuse_its_arrays(tmp_path, monkeypatch):
    make_h5(tmp_path / "d.h5", n=2000)
    sizes = []
    real = _h5source.H5Source.empty
    monkeypatch.setattr(_h5source.H5Source, "empty",
                        lambda self, rows: sizes.append(rows) or real(self, rows))
    with loader(tmp_path / "d.h5", block_size=16, window_blocks=2, prefetch=0) as ld:
        for _ in ld:
            pass
        windows = ld.plan(0).num_windows
        assert windows > 20 and len([r for r in sizes if r > 0]) <= 1 + 3  # scratch + pool
        sizes.clear()
        ld.prefetch = 2  # with a thread, timing may cost a spare array now and then
        for _ in ld:
            pass
        assert len([r for r in sizes if r > 0]) < windows / 2


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last,pad", [(True, True), (False, True), (False, False)])
def test_loader_ranks_together_see_a_permutation(tmp_path, world, drop_last, pad):
    make_h5(tmp_path / "d.h5", n=263)
    per_rank = []
    for rank in range(world):
        with loader(tmp_path / "d.h5", rank, world, batch_size=5, block_size=16,
                    drop_last=drop_last, pad=pad) as ld:
            per_rank.append(epoch_indices(ld))
            assert len(per_rank[-1]) == len(ld)
    seen = np.concatenate([np.concatenate(b) for b in per_rank])
    if pad:
        assert len({len(b) for b in per_rank}) == 1
    if drop_last:
        assert len(np.unique(seen)) == len(seen) and 263 - len(seen) < world * 5
    elif pad:
        assert np.array_equal(np.unique(seen), np.arange(263))
    else:
        assert np.array_equal(np.sort(seen), np.arange(263))


@pytest.mark.parametrize("layout", ["contiguous", "chunked", "gzip"])
def test_every_read_is_one_planned_range_within_a_block(tmp_path, monkeypatch, layout):
    make_h5(tmp_path / "d.h5", n=500, layout=layout)
    reads = []
    original = _h5source.H5Source.read

    def recording_read(self, start, stop, x_out, y_out):
        reads.append((start, stop))
        return original(self, start, stop, x_out, y_out)

    monkeypatch.setattr(_h5source.H5Source, "read", recording_read)
    with loader(tmp_path / "d.h5", 1, 3, batch_size=4, block_size=32) as ld:
        list(ld)
        plan = ld.plan(epoch=0)
    assert reads == [tuple(s) for s in plan.segments.tolist()]
    assert all(a // 32 == (b - 1) // 32 for a, b in reads)
    assert sum(b - a for a, b in reads) == plan.num_samples
    assert sum(b - a < 32 for a, b in reads) <= 5  # range ends, rotation, last block


def test_read_direct_gets_one_contiguous_hyperslab(tmp_path, monkeypatch):
    make_h5(tmp_path / "d.h5", n=300)
    selections = []
    original = h5py.Dataset.read_direct

    def spy(self, dest, source_sel=None, dest_sel=None):
        selections.append(source_sel)
        assert dest.flags.c_contiguous
        return original(self, dest, source_sel, dest_sel)

    monkeypatch.setattr(h5py.Dataset, "read_direct", spy)
    with loader(tmp_path / "d.h5", batch_size=4, block_size=50, direct_reads=False) as ld:
        list(ld)
    assert len(selections) == 2 * len(ld.plan(0).segments)
    assert all(isinstance(s, slice) and s.step is None for s in selections)


# ---- direct reads (os.preadv at the data's file offsets) ----------------

@pytest.mark.parametrize("layout,options,direct", [
    ("contiguous", {}, True),
    ("chunked", {"chunks": (16, 5)}, True),
    ("userblock", {"chunks": (16, 5)}, True),
    ("gzip", {"chunks": (16, 5), "compression": "gzip"}, False),
    ("split chunks", {"chunks": (16, 2)}, False),
    ("big-endian", {"dtype": ">f4"}, False),
])
def test_direct_reads_where_the_layout_allows_and_same_batches(tmp_path, layout, options,
                                                                direct):
    x = np.random.default_rng(0).random((300, 5), dtype=np.float32)
    extra = {"userblock_size": 512} if layout == "userblock" else {}
    with h5py.File(tmp_path / "d.h5", "w", **extra) as f:
        f.create_dataset("x", data=x, **options)
        f.create_dataset("y", data=np.arange(300) % 3)
    with loader(tmp_path / "d.h5", block_size=40) as fast, \
            loader(tmp_path / "d.h5", block_size=40, direct_reads=False) as slow:
        assert fast._source.direct is direct and not slow._source.direct
        batches, fast_it, slow_it = 0, iter(fast), iter(slow)
        for (xa, ya, ia), (xb, yb, ib) in zip(fast_it, slow_it):  # pairwise: buffers are reused
            assert torch.equal(ia, ib) and torch.equal(ya, yb) and torch.equal(xa, xb)
            np.testing.assert_array_equal(xa.numpy(), x[ia.numpy()])
            batches += 1
        assert batches == len(fast) == 300 // 8  # neither reader dropped a batch ...
        assert next(fast_it, None) is None and next(slow_it, None) is None  # ... nor has one more


def test_direct_ranges_merge_adjacent_chunks():
    extents = _h5source._Extents(row_bytes=10, chunk_rows=4, offsets=np.array([100, 140, 500]))
    assert extents.ranges(1, 7) == [[110, 60]]          # chunks 0 and 1 are adjacent
    assert extents.ranges(6, 10) == [[160, 20], [500, 20]]


def test_direct_reads_survive_short_reads(tmp_path, monkeypatch):
    x, _ = make_h5(tmp_path / "d.h5", n=200, layout="contiguous")
    real = _h5source.os.preadv
    monkeypatch.setattr(_h5source.os, "preadv",
                        lambda fd, bufs, offset: real(fd, [bufs[0][:7]], offset))
    with loader(tmp_path / "d.h5", block_size=50) as ld:
        assert ld._source.direct
        for xb, _, idx in ld:
            np.testing.assert_array_equal(xb.numpy(), x[idx.numpy()])


def test_direct_reader_falls_back_when_offsets_disagree(tmp_path, monkeypatch, caplog):
    x, _ = make_h5(tmp_path / "d.h5", n=200)
    real = _h5source._extents

    def shifted(dset):
        extents = real(dset)
        if extents is not None:
            extents.offsets = extents.offsets + 4
        return extents

    monkeypatch.setattr(_h5source, "_extents", shifted)
    with loader(tmp_path / "d.h5", block_size=50) as ld:
        assert not ld._source.direct and "differ from h5py" in caplog.text
        for xb, _, idx in ld:
            np.testing.assert_array_equal(xb.numpy(), x[idx.numpy()])


def test_next_window_is_advised_to_the_kernel(tmp_path, monkeypatch):
    make_h5(tmp_path / "d.h5", n=400, layout="contiguous")
    advised = []
    monkeypatch.setattr(_h5source.os, "posix_fadvise",
                        lambda fd, offset, size, advice: advised.append(advice))
    with loader(tmp_path / "d.h5", block_size=16, window_blocks=2) as ld:
        list(ld)
        windows = ld.plan(0).num_windows
    assert advised and set(advised) == {_h5source.os.POSIX_FADV_WILLNEED}
    assert len(advised) >= windows - 1


def test_same_seed_same_order_and_epochs_differ(tmp_path):
    make_h5(tmp_path / "d.h5")
    with loader(tmp_path / "d.h5", seed=3) as a, loader(tmp_path / "d.h5", seed=3) as b:
        first, again = epoch_indices(a), epoch_indices(b)
        assert a.epoch == 1  # a finished epoch moves on by itself
        second = epoch_indices(a)
    assert len(first) == len(again) == len(second) == 257 // 8
    assert all(np.array_equal(p, q) for p, q in zip(first, again))
    assert not all(np.array_equal(p, q) for p, q in zip(first, second))


def test_set_epoch_same_epoch_keeps_position(tmp_path):
    make_h5(tmp_path / "d.h5")
    with loader(tmp_path / "d.h5") as ld:
        it = iter(ld)
        next(it), next(it)
        assert ld.position == 2
        ld.set_epoch(0)
        assert ld.position == 2
        ld.set_epoch(4)
        assert (ld.epoch, ld.position) == (4, 0)
        ld.set_epoch(0, position=5)
        assert (ld.epoch, ld.position) == (0, 5)
        assert len(list(ld)) == len(ld) - 5
        with pytest.raises(ValueError, match="epoch"):
            ld.set_epoch(-1)
        with pytest.raises(ValueError, match="position"):
            ld.set_epoch(1, position=len(ld) + 1)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("stop_after", [0, 1, 3, 7, 15, 16])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(tmp_path, shuffle, stop_after):
    make_h5(tmp_path / "d.h5", n=257)
    kw = dict(shuffle=shuffle, block_size=10, window_blocks=2, seed=11)
    with loader(tmp_path / "d.h5", 1, 2, **kw) as ld:
        ld.set_epoch(2)
        full = epoch_indices(ld)
        ld.set_epoch(2)  # back from epoch 3, which the finished epoch moved to
        for _ in zip(range(stop_after), ld):
            pass
        state = ld.state_dict()
    assert (state["epoch"], state["position"]) == (2, stop_after)
    with loader(tmp_path / "d.h5", 1, 2, **kw) as resumed:
        resumed.load_state_dict(state)
        resumed.set_epoch(2)  # the usual loop top must not undo the resume
        rest = epoch_indices(resumed)
    assert len(full) == 16 and len(rest) == 16 - stop_after
    assert all(np.array_equal(p, q) for p, q in zip(full[stop_after:], rest))


def test_load_state_dict_rejects_a_different_order(tmp_path):
    make_h5(tmp_path / "d.h5")
    with loader(tmp_path / "d.h5", 0, 2) as ld:
        state = ld.state_dict()
    with loader(tmp_path / "d.h5", 0, 3) as other:  # 8 per rank: a global batch of 24, not 16
        with pytest.raises(ValueError, match="global_batch=16"):
            other.load_state_dict(state)
    with loader(tmp_path / "d.h5", 0, 2, seed=1) as other:
        with pytest.raises(ValueError, match="seed=0"):
            other.load_state_dict(state)


def test_a_state_saved_at_two_ranks_goes_on_at_three_with_the_rest_of_the_epoch(tmp_path):
    """Global batches of 16: 8 + 8 at two ranks, then 6 + 5 + 5 at three; the batches after
    the stop hold the samples the two ranks had not taken, each once."""
    make_h5(tmp_path / "d.h5", n=257)
    kw = dict(global_batch=16, block_size=10, window_blocks=2, seed=4)
    before = []
    for rank in range(2):
        with loader(tmp_path / "d.h5", rank, 2, **kw) as ld:
            before.append([b for _, b in zip(range(5), epoch_indices(ld))])
            ld.set_epoch(0, position=5)
            state = ld.state_dict()
    assert (state["position"], state["samples"], state["world_size"]) == (5, 80, 2)
    after = []
    for rank in range(3):
        with loader(tmp_path / "d.h5", rank, 3, **kw) as ld:
            ld.load_state_dict(state)
            assert ld.batch_shares == [6, 5, 5] and len(ld) == 16
            after.append(epoch_indices(ld))
    assert [len(b) for b in after] == [11, 11, 11] and [len(b[0]) for b in after] == [6, 5, 5]
    used = np.concatenate([np.concatenate(b) for b in before + after])
    assert len(used) == 16 * 16 == len(np.unique(used))


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_prefetch_depths_give_the_same_batches(tmp_path, prefetch):
    make_h5(tmp_path / "d.h5")
    with loader(tmp_path / "d.h5", prefetch=prefetch, block_size=8) as ld:
        got = epoch_indices(ld)
    with loader(tmp_path / "d.h5", block_size=8) as ref:
        want = epoch_indices(ref)
    assert len(got) == len(want) == 257 // 8
    assert all(np.array_equal(p, q) for p, q in zip(got, want))


def test_train_and_test_loaders_on_one_file_interleave(tmp_path):
    rng = np.random.default_rng(1)
    x_train, x_test = rng.random((300, 4)), rng.random((90, 4))
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x_train"], f["y_train"] = x_train, np.arange(300) % 5
        f["x_test"], f["y_test"] = x_test, np.arange(90) % 5
    with loader(tmp_path / "d.h5", x_key="x_train", y_key="y_train", block_size=16) as train, \
            loader(tmp_path / "d.h5", x_key="x_test", y_key="y_test", block_size=16,
                   shuffle=False, drop_last=False, pad=False) as test:
        tests = iter(test)
        for (xa, _, ia), (xb, _, ib) in zip(train, tests):
            np.testing.assert_array_equal(xa.numpy(), x_train[ia.numpy()])
            np.testing.assert_array_equal(xb.numpy(), x_test[ib.numpy()])
        rest = [idx for _, _, idx in tests]
        assert len(rest) == len(test) - min(len(train), len(test))


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "hsgd-prefetch" and t.is_alive()]


def test_error_in_reader_thread_is_raised_in_the_consumer(tmp_path, monkeypatch):
    make_h5(tmp_path / "d.h5", n=400)
    calls = []

    def failing_read(self, start, stop, x_out, y_out):
        calls.append(start)
        if len(calls) == 3:
            raise OSError("disk on fire")

    monkeypatch.setattr(_h5source.H5Source, "read", failing_read)
    with loader(tmp_path / "d.h5", block_size=16) as ld:
        with pytest.raises(OSError, match="disk on fire"):
            list(ld)
    assert not _prefetch_threads()


def test_leaving_the_loop_early_stops_the_thread(tmp_path):
    make_h5(tmp_path / "d.h5", n=400)
    with loader(tmp_path / "d.h5", block_size=8, prefetch=1) as ld:
        for _ in ld:
            break
        gc.collect()
        assert not _prefetch_threads()
        next(iter(ld))
    assert not _prefetch_threads()
    with pytest.raises(RuntimeError, match="closed"):
        next(iter(ld))


def test_unclosed_loader_does_not_hang_interpreter_exit(tmp_path):
    make_h5(tmp_path / "d.h5", n=4000, shape=(64,))
    code = ("from hsgd.parallel_io import ContiguousH5Loader as L\n"
            f"it = iter(L({str(tmp_path / 'd.h5')!r}, batch_size=2, block_size=64, prefetch=4))\n"
            "next(it)\n")
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], timeout=120,
                          capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()


# h5py's atexit hook calls HDF5 without h5py's lock; a prefetch thread still
# inside H5Dread then (h5py releases the GIL there) crashed the process at exit
# (SIGSEGV, rarely). Deterministic check of the cause: the child puts a probe at
# the place of h5py's hook that reports the prefetch threads still alive.
_EXIT_ORDER_CHILD = """
import atexit, threading
from hsgd.parallel_io import ContiguousH5Loader as L
from h5py._conv import unregister_converters

def probe():
    alive = [t for t in threading.enumerate() if t.name == "hsgd-prefetch" and t.is_alive()]
    print("prefetch threads alive at h5py's exit hook:", len(alive), flush=True)
    unregister_converters()

atexit.unregister(unregister_converters)
atexit.register(probe)
its = [iter(L({path!r}, batch_size=2, block_size=64, prefetch=2, shuffle=s)) for s in (1, 0)]
for it in its:
    next(it)
"""


def test_unclosed_loader_stops_its_thread_before_h5py_exit_hook(tmp_path):
    make_h5(tmp_path / "d.h5", n=20000, shape=(64,))  # int32 labels: read through h5py
    code = _EXIT_ORDER_CHILD.format(path=str(tmp_path / "d.h5"))
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], timeout=120,
                          capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"prefetch threads alive at h5py's exit hook: 0\n" in proc.stdout, \
        proc.stdout.decode() + proc.stderr.decode()


# ---- bad input -----------------------------------------------------------

def _write(path, **datasets):
    with h5py.File(path, "w") as f:
        for name, data in datasets.items():
            f[name] = data
    return path


@pytest.mark.parametrize("datasets,kw,error,message", [
    ({"x": np.zeros((10, 2)), "y": np.zeros(10, int)}, {"x_key": "inputs"}, ValueError,
     r"no data set 'inputs'; it has: 'x' \(10, 2\) float64, 'y' \(10,\) int64; pass x_key="),
    ({"x": np.zeros((10, 2)), "y": np.zeros(9, int)}, {}, ValueError,
     "x 'x' has 10 samples but y 'y' has 9 labels"),
    ({"x": np.zeros((0, 2)), "y": np.zeros(0, int)}, {}, ValueError, "zero samples"),
    ({"x": np.zeros((10, 2)), "y": np.zeros(10, int)}, {"batch_size": 6, "size": 2}, ValueError,
     r"10 samples are fewer than world_size x batch_size = 2 x 6 = 12 needed for one batch "
     r"per rank; use batch_size <= 5"),
    ({"x": np.array([b"a", b"b"] * 8), "y": np.zeros(16, int)}, {}, ValueError,
     "not numeric"),
    ({"x": np.zeros((10, 2)), "y": np.zeros(10)}, {}, ValueError,
     "labels must be integer class indices"),
    ({"x": np.zeros((10, 2)), "y": np.array([0, 1, 2, -4, 0, 0, 0, 0, 0, 0])}, {},
     ValueError, "negative label -4 at sample 3"),
    ({"x": np.zeros((10, 2)), "y": np.int64(3)}, {}, ValueError, "'y' is a scalar; labels need one row"),
])
def test_bad_files_raise_clear_errors(tmp_path, datasets, kw, error, message):
    path = _write(tmp_path / "bad.h5", **datasets)
    with pytest.raises(error, match=message) as info:
        loader(path, **{"batch_size": 1, **kw})
    assert isinstance(info.value, InputError)  # agreed on by every rank, not a bug's abort


def test_missing_and_non_hdf5_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found.*python -m hsgd.data"):
        loader(tmp_path / "nope.h5")
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(ValueError, match="not an HDF5 file"):
        loader(tmp_path / "text.h5")


@pytest.mark.parametrize("kw,message", [
    ({"batch_size": 0}, "batch_size"), ({"seed": -1}, "seed"), ({"block_size": 0}, "block_size"),
    ({"prefetch": -1}, "prefetch"), ({"pad": False}, "pad=False only applies"),
    ({"global_batch": 16, "batch_size": 8}, "not both"),
])
def test_bad_arguments(tmp_path, kw, message):
    make_h5(tmp_path / "d.h5")
    with pytest.raises(ValueError, match=message):
        loader(tmp_path / "d.h5", **kw)


def test_ranks_with_different_settings_are_named():
    class Split(FakeComm):
        def allgather(self, value):  # rank 1 has another batch size, and agrees on errors
            other = {**value, "batch_size": 16} if isinstance(value, dict) else value
            return [value, other]
    with pytest.raises(ValueError, match="batch_size: rank 0 has 8, rank 1 has 16"):
        check_settings_agree(Split(0, 2), {"batch_size": 8, "seed": 0})
