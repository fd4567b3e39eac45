"""The read pacer: piece sizes follow the measured rate of a read, between its bounds."""

import doctest

import pytest

from hsgd.remote import pacing
from hsgd.remote.pacing import LEAST_BYTES, TARGET_S, Pacer


def test_first_piece_before_anything_is_measured():
    assert Pacer(most=4 << 20).next_bytes() == pacing.FIRST_BYTES
    assert Pacer(most=4 << 20, first=1).next_bytes() == LEAST_BYTES  # never below least
    assert Pacer(most=100_000, least=1000, first=1 << 20).next_bytes() == 100_000  # nor above most


@pytest.mark.parametrize("rate, expected", [
    (12.5e6, LEAST_BYTES),                # 100 Mbit/s: 0.5 ms is below the least piece
    (1.25e9, int(1.25e9 * TARGET_S)),     # 10 Gbit/s: the target's worth of bytes
    (12.5e9, 4 << 20),                    # 100 Gbit/s: capped at most
])
def test_piece_is_the_target_time_at_the_measured_rate(rate, expected):
    p = Pacer(most=4 << 20)
    p.begin(now=10.0)
    for i in range(1, 5):  # four pieces of 1 MB at `rate`, whatever their sizes
        p.arrived(1_000_000, now=10.0 + i * 1e6 / rate)
    assert p.rate == pytest.approx(rate)
    assert p.next_bytes() == pytest.approx(expected, rel=1e-6)


def test_rate_is_over_the_whole_read_not_single_pieces():
    p = Pacer(most=4 << 20)
    p.begin(now=0.0)
    p.arrived(100_000, now=0.01)
    p.arrived(100_000, now=0.01)  # arrived together with the one before: no infinite rate
    assert p.rate == pytest.approx(200_000 / 0.01)
    p.begin(now=5.0)              # the next read starts over, keeping the rate until it measures
    assert p.rate == pytest.approx(200_000 / 0.01)
    p.arrived(50_000, now=5.01)
    assert p.rate == pytest.approx(50_000 / 0.01)


@pytest.mark.parametrize("kwargs", [dict(most=0), dict(most=100, least=200), dict(most=100, target=0.0)])
def test_bad_bounds_say_what_is_wrong(kwargs):
    with pytest.raises(ValueError, match="least <= most"):
        Pacer(**kwargs)


def test_docstring_example_holds():
    assert doctest.testmod(pacing).failed == 0
