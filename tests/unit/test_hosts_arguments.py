"""lab.hosts without making hosts: rates, and what bad arguments get (no root needed)."""

import pytest

from lab.hosts import EmulatedHosts, format_rate, parse_rate
from lab.hosts.__main__ import main
from lab.hosts._mpi import launch_command


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


def test_launcher_options_go_before_the_program_and_an_mca_replaces_the_default():
    state = {"hosts": [{"address": "10.9.0.2"}, {"address": "10.9.0.3"}], "subnet": "10.9.0.0/24", "bridge": "br"}
    cmd = launch_command(state, "RSH", "mpiexec", "openmpi", [2, 1], ["prog", "--x"],
                         ["--with-ft", "ulfm", "--mca", "btl", "tcp,self", "--prtemca", "rml_base_radix", "2"])
    words = " ".join(cmd)
    assert words.count("--mca btl ") == 1 and "--mca btl tcp,self" in words, cmd
    assert "--with-ft ulfm --prtemca rml_base_radix 2" in words and "--mca pml ob1" in words, cmd
    assert cmd[-2:] == ["prog", "--x"] and cmd.index("--prtemca") < cmd.index("sh"), cmd  # sh: the rank's prefix
    mpich = launch_command(state, "RSH", "mpiexec", "mpich", [1, 1], ["prog"], ["-genv", "A", "1"])
    assert mpich[mpich.index("-genv"):][:3] == ["-genv", "A", "1"] and mpich.index("-genv") < mpich.index("sh"), mpich
