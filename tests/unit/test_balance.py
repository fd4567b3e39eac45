"""``hsgd.balance.balanced_shares``: batch sizes that equalize modelled step times."""

import pytest

from hsgd.balance import balanced_shares


def step_times(fixed, per_sample, shares):
    return [a + c * b for a, c, b in zip(fixed, per_sample, shares)]


def test_without_fixed_costs_shares_follow_speed():
    per_sample = [1.0, 1.0, 3.0, 1.0]  # rank 2 three times slower
    shares = balanced_shares([0.0] * 4, per_sample, 1000)
    assert sum(shares) == 1000
    assert shares[2] == pytest.approx(1000 / 10, abs=1)  # speeds 1 : 1 : 1/3 : 1
    assert all(b == pytest.approx(300, abs=1) for r, b in enumerate(shares) if r != 2)


def test_fixed_costs_equalize_step_times_not_samples_per_second():
    fixed, per_sample = [3.4, 3.4, 10.2], [0.022, 0.022, 0.066]  # ms: rank 2 is 3x slower in both
    shares = balanced_shares(fixed, per_sample, 2048)
    times = step_times(fixed, per_sample, shares)
    assert sum(shares) == 2048
    assert max(times) - min(times) <= max(per_sample) + 1e-9  # equal up to one sample's cost
    assert shares[2] < 2048 / 7  # less than in proportion to speed at equal batches


def test_a_rank_whose_fixed_cost_alone_is_too_slow_gets_one_sample():
    shares = balanced_shares([1.0, 1.0, 50.0], [0.01, 0.01, 0.01], 256)
    assert shares == [128, 127, 1] or shares == [127, 128, 1]
    assert balanced_shares([0.0, 0.0], [1.0, 1e6], 2) == [1, 1]  # nobody below one sample


@pytest.mark.parametrize("total", [3, 7, 256, 1001])
def test_shares_are_whole_positive_and_sum_to_the_batch(total):
    shares = balanced_shares([0.1, 0.0, 2.0], [0.3, 0.7, 0.01], total)
    assert sum(shares) == total and min(shares) >= 1 and all(isinstance(b, int) for b in shares)
    assert balanced_shares([0.1, 0.0, 2.0], [0.3, 0.7, 0.01], total) == shares  # deterministic


@pytest.mark.parametrize("fixed,per_sample,total,match", [
    ([], [], 4, "one fixed and one per-sample"),
    ([0.0], [1.0, 1.0], 4, "one fixed and one per-sample"),
    ([0.0, 0.0], [1.0, 0.0], 4, "per-sample > 0"),
    ([-1.0, 0.0], [1.0, 1.0], 4, "fixed >= 0"),
    ([float("nan"), 0.0], [1.0, 1.0], 4, "finite"),
    ([0.0, 0.0], [1.0, 1.0], 1, "total"),
])
def test_bad_costs_are_refused(fixed, per_sample, total, match):
    with pytest.raises(ValueError, match=match):
        balanced_shares(fixed, per_sample, total)
