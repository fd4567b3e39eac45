"""lab.hosts without making hosts: rates, and what bad arguments get (no root needed)."""

import pytest

from lab.hosts import EmulatedHosts, format_rate, parse_rate
from lab.hosts.__main__ import main


@pytest.mark.parametrize("text,bits", [("1gbit", 10 ** 9), ("100mbit", 10 ** 8), ("2.5Gbit", 25 * 10 ** 8),
                                       ("none", None), (None, None), ("64kbit", 64000)])
def test_rates_in_tc_units(text, bits):
    assert parse_rate(text) == bits
    if bits is not None:
        assert parse_rate(format_rate(bits)) == bits


@pytest.mark.parametrize("bad", ["1gbps", "fast", "-1gbit", "0mbit", "1 gb", "10bit"])
def test_bad_rates_say_what_to_write(bad):
    with pytest.raises(ValueError, match="rate"):
        parse_rate(bad)


@pytest.mark.parametrize("kwargs,text", [
    ({"count": 0}, "host count"),
    ({"count": True}, "host count"),
    ({"count": 2, "link": ["1gbit"] * 3}, "3 link rates for 2 hosts"),
    ({"count": 2, "link": "1gb"}, "invalid link rate"),
])
def test_bad_arguments_are_refused_before_anything_is_made(kwargs, text):
    with pytest.raises(ValueError, match=text):
        EmulatedHosts(**kwargs)


@pytest.mark.parametrize("argv,text", [
    (["run", "--hosts", "2"], "no program to run"),
    (["run", "--hosts", "0", "--", "true"], "--hosts"),
    (["run", "--hosts", "3", "--ranks-per-host", "1,2", "--", "true"], "2 values for 3 hosts"),
    (["run", "--link", "fast", "--", "true"], "invalid link rate"),
    (["run", "--ranks-per-host", "0", "--", "true"], "at least one rank"),
])
def test_the_command_refuses_bad_options_with_one_error_line(argv, text, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m lab.hosts") and text in err[-1], err
