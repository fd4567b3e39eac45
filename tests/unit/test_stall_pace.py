"""The stall inspector's pace (``abort_pace``): the wait after which a rank ends the job,
from its own recent steps."""

import math

from hsgd.faults.stall import ABORT_PACE_ENV, PACE_FLOOR_S, Pace


class Clock:
    """A rank entering synchronizations, its steps ``seconds`` long."""

    def __init__(self, pace):
        self.pace, self.now = pace, 0.0
        pace.entered(self.now)

    def steps(self, *seconds):
        """The limits after each step."""
        limits = []
        for s in seconds:
            self.now += s
            limits.append(self.pace.entered(self.now))
        return limits


def test_no_limit_before_8_steps_or_without_a_factor():
    assert Clock(Pace(20.0)).steps(*[0.01] * 7) == [math.inf] * 7
    assert Clock(Pace(0.0)).steps(*[0.01] * 100)[-1] == math.inf


def test_k_times_the_slowest_of_the_last_64_steps_at_least_the_floor():
    rank = Clock(Pace(40.0))  # steps of exact binary fractions: exact sums
    assert rank.steps(*[1 / 128] * 8)[-1] == PACE_FLOOR_S  # 40 x 1/128 s is below the floor
    limits = rank.steps(0.5, *[0.125] * 63)
    assert limits[0] == limits[-1] == 40 * 0.5  # the slow step is among the last 64
    assert rank.steps(0.125)[0] == 40 * 0.125  # ... and now it is not
    assert Pace(2.0, floor=0.4).floor == 0.4


def test_the_supervisors_name_for_it_is_the_inspectors():
    from hsgd._supervisor import supervisor

    assert supervisor.ABORT_PACE_ENV == ABORT_PACE_ENV
