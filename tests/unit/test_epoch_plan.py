"""The epoch plan across world sizes: global batches that do not depend on the rank count,
unequal per-rank shares, and an epoch stopped at one rank count and finished at another.

Planning is pure arithmetic: every rank of every world size is simulated in one process.
"""

import numpy as np
import pytest
from _plans import batch_indices

from hsgd import InputValueError
from hsgd._io.plan import check_plan, epoch_batches, even_shares, plan_epoch, window_batches


def global_batches(n, shares, block=37, window_blocks=3, seed=3, epoch=1, drop_last=True, shuffle=True):
    """Every global batch of the epoch as the sorted sample indices its ranks take together,
    and each rank's part of it; ``shares``: the ranks' batch sizes."""
    per_rank = [batch_indices(plan_epoch(n, len(shares), r, 1, block, seed, epoch, drop_last, shuffle=shuffle,
                                         window_blocks=window_blocks, shares=shares))
                for r in range(len(shares))]
    assert len({len(b) for b in per_rank}) == 1  # every rank takes part in every global batch
    parts = list(zip(*per_rank))
    assert all([len(p) for p in part] == list(shares) for part in parts)
    return [np.sort(np.concatenate(part)) for part in parts], parts


def test_even_shares_split_the_global_batch():
    assert even_shares(256, 6) == [43, 43, 43, 43, 42, 42]
    assert even_shares(256, 4) == [64] * 4 and even_shares(5, 5) == [1] * 5
    with pytest.raises(InputValueError):
        even_shares(4, 6)  # a rank without a sample


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_global_batches_are_the_same_at_every_rank_count(drop_last, shuffle):
    n, batch = 1003, 50
    one, _ = global_batches(n, [batch], drop_last=drop_last, shuffle=shuffle)
    assert len(one) == epoch_batches(n, batch, drop_last) == (20 if drop_last else 21)
    seen = np.concatenate(one)
    if drop_last:  # each sample at most once, N mod G dropped
        assert len(np.unique(seen)) == len(seen) == 1000
    else:  # every sample, the stream wrapping around for the last batch
        assert np.array_equal(np.unique(seen), np.arange(n)) and len(seen) == 1050
    for shares in ([25, 25], even_shares(batch, 3), even_shares(batch, 6), [1, 30, 2, 17], [1] * 50):
        got, _ = global_batches(n, shares, drop_last=drop_last, shuffle=shuffle)
        assert len(got) == len(one)
        for k, (a, b) in enumerate(zip(one, got)):
            assert np.array_equal(a, b), (shares, k)


def test_without_shuffle_global_batches_are_file_order():
    _, parts = global_batches(100, [3, 5], shuffle=False)
    assert np.array_equal(parts[0][0], [0, 1, 2]) and np.array_equal(parts[0][1], [3, 4, 5, 6, 7])
    assert np.array_equal(parts[2][1], [19, 20, 21, 22, 23])


@pytest.mark.parametrize("before,after", [(6, 4), (4, 6), (6, 5), (3, 1), (1, 7)])
@pytest.mark.parametrize("stop", [1, 9, 13])
def test_an_epoch_stopped_at_one_rank_count_and_finished_at_another_uses_every_sample_once(before, after, stop):
    """Global batches ``[0, stop)`` at ``before`` ranks, the rest at ``after`` (unequal shares
    where the rank count does not divide 64): together the epoch's samples, each once."""
    n, batch = 1000, 64
    _, old = global_batches(n, even_shares(batch, before), window_blocks=2)
    _, new = global_batches(n, even_shares(batch, after), window_blocks=2)
    used = np.concatenate([np.concatenate(p) for p in old[:stop] + new[stop:]])
    assert len(used) == (n // batch) * batch == len(np.unique(used))
    for r in range(after):  # a rank starting at `stop` reads from there on
        plan = plan_epoch(n, after, r, 1, 37, 3, 1, window_blocks=2, shares=even_shares(batch, after))
        window, skip = plan.locate(stop)
        rest = np.concatenate([plan.window_indices(window)[skip:]] +
                              [plan.window_indices(w) for w in range(window + 1, plan.num_windows)])
        assert np.array_equal(rest, np.concatenate([p[r] for p in new[stop:]]))


def test_a_rank_reads_one_stream_range_per_window():
    n, block, shares = 5000, 64, even_shares(96, 5)
    per_window = window_batches(96, block, 4)
    assert per_window == 3  # 4 blocks of 64 samples: 3 global batches of 96
    for r in range(5):
        plan = plan_epoch(n, 5, r, 1, block, seed=2, epoch=0, window_blocks=4, shares=shares)
        assert plan.num_windows == -(-(n // 96) // per_window)
        for w in range(plan.num_windows):
            segs = plan.window_segments(w)
            assert np.all(segs[:, 0] // block == (segs[:, 1] - 1) // block)  # each inside one block
            assert len(segs) <= plan.window_size(w) // block + 3  # range ends, rotation, short block


def test_the_window_order_does_not_depend_on_the_rank_count_but_on_seed_and_epoch():
    def first_batch(seed, epoch, world=2):
        return global_batches(700, even_shares(32, world), seed=seed, epoch=epoch)[0][0]
    assert np.array_equal(first_batch(7, 2), first_batch(7, 2, world=5))
    assert not np.array_equal(first_batch(7, 2), first_batch(7, 3))
    assert not np.array_equal(first_batch(7, 2), first_batch(8, 2))


def test_plans_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match=r"fewer than world_size x batch_size = 4 x 8 = 32"):
        plan_epoch(31, 4, 0, 8, 10)
    with pytest.raises(ValueError, match=r"fewer than the global batch of 40"):
        check_plan(31, 2, 0, 1, shares=[20, 20])
    plan_epoch(31, 4, 0, 8, 10, drop_last=False, pad=False)  # evaluation needs no minimum
    with pytest.raises(ValueError, match="shares need pad=True"):
        check_plan(31, 2, 0, 1, drop_last=False, pad=False, shares=[1, 2])


@pytest.mark.parametrize("shares", [[1, 2], [0, 3, 3], [1.5, 2, 2], [True, 2, 2]])
def test_bad_shares_are_refused(shares):
    with pytest.raises(InputValueError, match="shares"):
        check_plan(100, 3, 0, 2, shares=shares)
