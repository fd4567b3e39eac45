"""The meter (hsgd._core.meter): one object per mode for its byte counts and its phases."""

import time

import pytest
import torch

from hsgd import HierarchicalSGD
from hsgd._core.meter import Meter
from hsgd._core.traffic import Traffic


def test_counts_bytes_per_level():
    meter = Meter()
    assert isinstance(meter, Traffic) and meter.as_dict() == {"intra_bytes": 0, "inter_bytes": 0}
    meter.add_intra(10)
    meter.add_inter(3)
    meter.add_intra(5.0)  # counted as an int, as Traffic does
    assert meter.as_dict() == {"intra_bytes": 15, "inter_bytes": 3}
    assert type(meter.intra_bytes) is int


def test_a_phase_reports_its_name_and_times():
    heard = []
    meter = Meter(on_phase=lambda *record: heard.append(record))
    before = time.perf_counter()
    with meter.phase("intra"):
        inside = time.perf_counter()
    with meter.phase("inter"):
        pass
    after = time.perf_counter()
    assert [name for name, _, _ in heard] == ["intra", "inter"]
    (_, start, end), (_, start2, end2) = heard
    assert before <= start <= inside <= end <= start2 <= end2 <= after
    meter.report("inter", 1.0, 2.0)  # work that completed in the background
    assert heard[-1] == ("inter", 1.0, 2.0)


def test_without_a_listener_nothing_is_reported_and_the_callback_can_change():
    meter = Meter()
    with meter.phase("intra"):
        pass
    meter.report("inter", 0.0, 1.0)
    heard = []
    meter.on_phase = lambda name, start, end: heard.append(name)
    with meter.phase("inter"):
        pass
    meter.on_phase = None
    with meter.phase("intra"):
        pass
    assert heard == ["inter"]


def test_a_phase_that_raises_is_not_reported():
    heard = []
    meter = Meter(on_phase=lambda name, start, end: heard.append(name))
    with pytest.raises(ValueError, match="boom"), meter.phase("intra"):
        raise ValueError("boom")
    assert heard == []


def test_a_phase_shows_in_torchs_profiler():
    meter = Meter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with meter.phase("inter"):
            torch.ones(4).add_(1)
    assert "hsgd::inter" in {event.key for event in prof.key_averages()}


def test_a_mode_gives_its_meter_to_every_part():
    """``opt.traffic`` and ``opt.on_phase`` are the meter's, and the engine, the averager and both
    levels record into that one meter (one process: one node, no bytes move)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    opt = HierarchicalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model)
    try:
        meter = opt.meter
        assert opt.engine.meter is meter and opt.averager.meter is meter
        assert opt.averager.slots.meter is meter and opt.averager.inter.meter is meter
        assert opt.on_phase is None
        heard = []
        opt.on_phase = lambda name, start, end: heard.append(name)
        assert meter.on_phase is opt.on_phase
        model(torch.ones(3, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        assert heard == ["intra"] and opt.traffic == meter.as_dict() == {"intra_bytes": 0, "inter_bytes": 0}
    finally:
        opt.close()


@pytest.mark.parametrize("mode", ["ElasticSGD", "GossipSGD"])
def test_the_other_families_record_into_the_modes_meter(mode):
    import hsgd

    model = torch.nn.Linear(4, 2)
    opt = getattr(hsgd, mode)(torch.optim.SGD(model.parameters(), lr=0.1), model)
    try:
        assert opt.engine.meter is opt.meter
        if mode == "ElasticSGD":
            assert opt.box.meter is opt.meter and opt.box.traffic is opt.meter
            heard = []
            opt.on_phase = lambda name, start, end: heard.append(name)
            model(torch.ones(3, 4)).sum().backward()
            opt.step()  # one process: W_g's one owner is on this node
            assert heard == ["intra"] and opt.traffic["intra_bytes"] > 0 == opt.traffic["inter_bytes"]
    finally:
        opt.close()
