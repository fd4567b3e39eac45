"""Layer 4: hosts emulated on this machine (:mod:`lab.hosts`), a real TCP network between nodes.

Every test here gets its hosts from the ``emulated_hosts`` factory, which
removes them (with every process on them) however the test ends; a test
process killed outright leaves them to the guard process of
:class:`~lab.hosts.EmulatedHosts`. Making hosts needs root (network and UTS
namespaces): elsewhere these tests skip with the reason, except under
``CI=true``, where a missing capability fails them.
"""

import os

import pytest

from lab.hosts import EmulatedHosts, HostsUnavailable

IN_CI = os.environ.get("CI", "").strip().lower() == "true"


@pytest.fixture
def emulated_hosts():
    """``make(count=2, link="1gbit")`` -> an :class:`EmulatedHosts`, removed after the test."""
    made = []

    def make(count=2, link="1gbit"):
        try:
            hosts = EmulatedHosts(count, link)
        except HostsUnavailable as exc:
            if IN_CI:
                pytest.fail(f"CI=true, but emulated hosts cannot be made here: {exc}")
            pytest.skip(f"emulated hosts: {exc}")
        made.append(hosts)
        return hosts

    yield make
    for hosts in made:
        hosts.close()
