"""The plumbing of emulated hosts: network namespaces, veth pairs, a bridge, tbf, UTS names.

Every emulated host ``i`` of a run ``ID`` is a network namespace ``hsgd-ID-hI`` whose
only interfaces are ``lo`` and ``eth0`` (address ``10.A.B.(I+2)/24``); a UTS namespace
with the hostname ``hsgd-ID-hI``, kept alive by a bind mount on
``/run/hsgd-hosts/ID/uts-I``, so that Open MPI and the logs see distinct host names; a
veth pair, ``eth0`` inside and ``hsgdvIDI`` outside on the bridge ``hsgdbID`` (address
``10.A.B.1``, where the launcher listens); and a link shaped by ``tc ... tbf`` on both
ends of the pair, like a full-duplex switch port. The outer end's counters say what the
host sent (``rx_bytes``) and received (``tx_bytes``), read from the root namespace.

Invariant: the run's state is written to ``/run/hsgd-hosts/ID/state.json`` *before*
anything is made, so :func:`teardown` can always remove whatever exists, from this
process, the guard process (:mod:`lab.hosts._guard`) or ``python -m lab.hosts clean``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["STATE_ROOT", "HostsError", "HostsUnavailable", "parse_rate", "format_rate", "missing_capability",
           "new_run", "make", "teardown", "counters", "owner_alive", "stale_runs"]

STATE_ROOT = Path(os.environ.get("HSGD_HOSTS_STATE", "/run/hsgd-hosts"))
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_UNITS = {"bit": 1, "kbit": 10 ** 3, "mbit": 10 ** 6, "gbit": 10 ** 9, "tbit": 10 ** 12}
_TBF_LATENCY = "100ms"  # the queue tbf keeps: rate x 100 ms + burst


class HostsError(RuntimeError):
    """Making or using emulated hosts failed (a command's error is in the message)."""


class HostsUnavailable(HostsError):
    """This machine or process cannot make emulated hosts (the reason is the message)."""


def parse_rate(rate: Optional[str]) -> Optional[int]:
    """``"1gbit"`` -> 1e9 bits/s (tc's decimal units: bit, kbit, mbit, gbit, tbit); ``None``
    or ``"none"``: an unshaped link. Anything else raises ``ValueError`` saying what to write."""
    if rate is None or (isinstance(rate, str) and rate.strip().lower() in ("", "none", "unshaped")):
        return None
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]+)\s*", str(rate).lower())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"invalid link rate {rate!r}: write a positive number and one of "
                         f"{', '.join(_UNITS)} (bits per second, as tc does), e.g. 1gbit or 100mbit, "
                         f"or 'none' for an unshaped link")
    bits = int(float(match.group(1)) * _UNITS[match.group(2)])
    if bits < 8000:
        raise ValueError(f"invalid link rate {rate!r}: at least 8kbit")
    return bits


def format_rate(bits: Optional[int]) -> str:
    if bits is None:
        return "unshaped"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits >= _UNITS[unit] and bits % (_UNITS[unit] // 1000 or 1) == 0:
            return f"{bits / _UNITS[unit]:g}{unit}"
    return f"{bits}bit"


def missing_capability() -> Optional[str]:
    """Why this process cannot make namespaces, or ``None`` if it looks able to."""
    if not Path("/proc/self/ns/net").exists():
        return "emulated hosts need Linux network namespaces (no /proc/self/ns/net here)"
    for tool in ("ip", "tc", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return (f"emulated hosts need '{tool}' on PATH (Debian: apt-get install iproute2 "
                    f"util-linux)")
    try:
        found = re.search(r"^CapEff:\s*([0-9a-f]+)$", Path("/proc/self/status").read_text(), re.M)
        caps = int(found.group(1), 16) if found is not None else 0
    except OSError:
        caps = 0
    if not (caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1):
        return ("emulated hosts need root (CAP_NET_ADMIN and CAP_SYS_ADMIN, to make network and "
                "UTS namespaces); this process does not have them")
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise HostsError(f"'{' '.join(cmd)}' failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def _free_subnet() -> str:
    """A 10.A.B.0/24 that no address or route of this machine uses: ``"10.A.B"``."""
    used = _run("ip", "-4", "-o", "addr").stdout + _run("ip", "-4", "route").stdout
    for _ in range(200):
        prefix = f"10.{secrets.choice(range(200, 250))}.{secrets.randbelow(256)}"
        if not re.search(rf"\b{re.escape(prefix)}\.", used):
            return prefix
    raise HostsError("found no free 10.A.B.0/24 subnet for the emulated hosts")


def _start_time(pid: int) -> Optional[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def new_run(num_hosts: int, rates: Sequence[Optional[int]]) -> Dict:
    """Reserve a run id and its state directory, and describe the run (nothing made yet).

    All names carry the run's random ``ID`` (6 hex digits; interface names stay within
    Linux's 15 characters), so that runs beside each other never collide."""
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        run_id = secrets.token_hex(3)
        try:
            (STATE_ROOT / run_id).mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise HostsError(f"could not reserve a run directory under {STATE_ROOT}")
    subnet = _free_subnet()
    state = {
        "id": run_id, "dir": str(STATE_ROOT / run_id), "subnet": f"{subnet}.0/24",
        "bridge": f"hsgdb{run_id}", "bridge_address": f"{subnet}.1",
        "owner": [os.getpid(), _start_time(os.getpid())],
        "hosts": [{"name": f"hsgd-{run_id}-h{i}", "netns": f"hsgd-{run_id}-h{i}", "address": f"{subnet}.{i + 2}",
                   "veth": f"hsgdv{run_id}{i}", "uts": str(STATE_ROOT / run_id / f"uts-{i}"), "rate": rates[i]}
                  for i in range(num_hosts)],
    }
    _write_state(state)
    return state


def _write_state(state: Dict) -> None:
    path = Path(state["dir"]) / "state.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def make(state: Dict) -> None:
    """Make the bridge and every host of ``state``; on failure, remove what was made and raise."""
    try:
        bridge = state["bridge"]
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{state['bridge_address']}/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        for host in state["hosts"]:
            ns, veth, inner = host["netns"], host["veth"], f"hsgdp{state['id']}{state['hosts'].index(host)}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", inner, "name", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{host['address']}/24", "dev", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("ip", "link", "set", veth, "master", bridge)
            _run("ip", "link", "set", veth, "up")
            if host["rate"] is not None:
                burst = str(max(32 * 1024, host["rate"] // 8 // 125))  # 8 ms of traffic: 1 MB at 1 Gbit/s
                shape = ["tc", "qdisc", "replace", "root", "tbf", "rate", f"{host['rate']}bit", "burst", burst,
                         "latency", _TBF_LATENCY]
                _run(*shape[:3], "dev", veth, *shape[3:])
                _run("ip", "netns", "exec", ns, *shape[:3], "dev", "eth0", *shape[3:])
            Path(host["uts"]).touch()
            _run("unshare", f"--uts={host['uts']}", "hostname", host["name"])
    except BaseException:
        teardown(state)
        raise


def _namespace_key(ns: str) -> Optional[Tuple[int, int]]:
    """The identity (device, inode) of network namespace ``ns``, or ``None`` if it is gone."""
    try:
        st = os.stat(f"/run/netns/{ns}")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _holders(key: Tuple[int, int]) -> List[int]:
    """The processes in the namespace ``key`` or holding a descriptor on it: a launch that is
    entering it (``ip netns exec`` between its open and its setns) holds one."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
            if (st.st_dev, st.st_ino) == key:
                found.append(int(entry.name))
                continue
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                try:
                    st = os.stat(fd.path)
                except OSError:  # closed meanwhile, or a descriptor that stat cannot follow
                    continue
                if (st.st_dev, st.st_ino) == key:
                    found.append(int(entry.name))
                    break
        except OSError:  # the process ended, or is a zombie
            continue
    return found


def _kill_holders(key: Tuple[int, int], timeout: float = 5.0) -> None:
    """SIGKILL every process in namespace ``key`` or holding it open, until none is left
    (up to ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = _holders(key)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in network namespace ``ns``; wait (up to 5 s) until they are gone."""
    key = _namespace_key(ns)
    if key is not None:
        _kill_holders(key)


def _remove_namespace(ns: str) -> bool:
    """Kill what runs in network namespace ``ns`` and delete it; False if it could not be deleted.

    A process that opened the namespace before the deletion can still enter it after (a launch
    through the remote shell racing the teardown), where ``ip netns pids`` no longer finds it:
    after the deletion no process can open it anymore, so the processes found in it or holding
    it then are the last ones."""
    key = _namespace_key(ns)
    if key is None:
        return True
    _kill_holders(key)
    if _run("ip", "netns", "del", ns, check=False).returncode:
        return False
    _kill_holders(key)
    return True


def teardown(state: Dict) -> List[str]:
    """Remove everything of ``state`` that exists, processes in the hosts included. Idempotent;
    never raises for what is already gone. Returns what could not be removed."""
    failed = []
    for host in state["hosts"]:
        if not _remove_namespace(host["netns"]):
            failed.append(f"netns {host['netns']}")
        if Path(f"/sys/class/net/{host['veth']}").exists():
            _run("ip", "link", "del", host["veth"], check=False)
        uts = Path(host["uts"])
        if uts.exists():
            _run("umount", str(uts), check=False)
            uts.unlink(missing_ok=True)
    if Path(f"/sys/class/net/{state['bridge']}").exists():
        if _run("ip", "link", "del", state["bridge"], check=False).returncode:
            failed.append(f"bridge {state['bridge']}")
    failed += [f"link {h['veth']}" for h in state["hosts"] if Path(f"/sys/class/net/{h['veth']}").exists()]
    if not failed:
        shutil.rmtree(state["dir"], ignore_errors=True)
    return failed


def counters(state: Dict) -> List[Dict[str, int]]:
    """Per host, the bytes it has ``sent`` and ``received`` through its link so far."""
    out = []
    for host in state["hosts"]:
        stats = Path(f"/sys/class/net/{host['veth']}/statistics")
        out.append({"sent": int((stats / "rx_bytes").read_text()), "received": int((stats / "tx_bytes").read_text())})
    return out


def owner_alive(state: Dict) -> bool:
    pid, started = state["owner"]
    return started is not None and _start_time(pid) == started


def stale_runs() -> List[Dict]:
    """The runs under :data:`STATE_ROOT` whose owner process is gone."""
    found = []
    for path in sorted(STATE_ROOT.glob("*/state.json")) if STATE_ROOT.is_dir() else ():
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not owner_alive(state):
            found.append(state)
    return found
