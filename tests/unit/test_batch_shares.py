"""Per-rank batch sizes (shares of the global batch) in the read plan."""

import numpy as np
import pytest
from _plans import batch_indices

from hsgd import InputValueError
from hsgd._io.plan import plan_epoch, rank_range


@pytest.mark.parametrize("drop_last", [True, False])
def test_shares_tile_the_stream_with_equal_batch_counts(drop_last):
    shares, n = [5, 1, 3], 1000
    ranges = [rank_range(n, 3, r, 3, drop_last=drop_last, shares=shares) for r in range(3)]
    batches = (n // 9) if drop_last else -(-n // 9)
    assert [count for _, count in ranges] == [batches * b for b in shares]
    assert [start for start, _ in ranges] == [0, batches * 5, batches * 6]
    plans = [plan_epoch(n, 3, r, 3, block_size=64, drop_last=drop_last, shares=shares) for r in range(3)]
    assert [p.num_batches for p in plans] == [batches] * 3
    assert [len(batch_indices(p)[0]) for p in plans] == shares
    every = np.concatenate([p.indices() for p in plans])
    assert len(every) == batches * 9
    if drop_last:
        assert len(np.unique(every)) == len(every)  # no sample twice in an epoch


@pytest.mark.parametrize("shares", [[1, 2], [0, 3, 3], [1.5, 2, 2], [True, 2, 2]])
def test_bad_shares_are_refused(shares):
    with pytest.raises(InputValueError, match="shares"):
        rank_range(100, 3, 0, 2, shares=shares)
