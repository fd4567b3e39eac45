"""python -m hsgd.run without MPI jobs: bad input gets one line and exit 2, and which ends of a job
are restarted on which hosts (the job and the probe replaced by stand-ins)."""

import json
import os
import subprocess
import sys
import time

import pytest

from hsgd import report, run
from hsgd._supervisor.hostlist import Host
from hsgd._supervisor.jobs import launch_command, probe_command, run_job
from hsgd._supervisor.journal import JobRecords, Journal
from hsgd._supervisor.supervisor import Supervisor


def hosts_file(tmp_path, text="127.0.0.1:2\nlocalhost:2  # a comment\n\n"):
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


def one_error_line(capsys):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("python -m hsgd.run: error: "), err
    return lines[0]


@pytest.mark.parametrize("args,message", [
    (["--min-nodes", "3"], "--min-nodes 3 is more than the 2 hosts in"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
    (["--probe-timeout", "0"], "--probe-timeout must be positive"),
    (["--stall-abort-pace", "-1"], "--stall-abort-pace must be a number >= 0"),
    (["--startup-timeout", "-1"], "--startup-timeout must be seconds >= 0"),
    (["--startup-timeout", "inf"], "--startup-timeout must be seconds >= 0"),
])
def test_bad_settings_get_one_line_and_exit_2(tmp_path, capsys, monkeypatch, args, message):
    code = run.main(["--hosts-file", hosts_file(tmp_path), *args, "--", "--run-dir", str(tmp_path / "run")])
    assert code == 2 and message in one_error_line(capsys)


@pytest.mark.parametrize("text,message", [
    ("127.0.0.1\nno-such-host.invalid:2\n", "unknown host 'no-such-host.invalid' in"),
    ("127.0.0.1:0\n", "is not host or host:ranks"),
    ("127.0.0.1\n127.0.0.1\n", "listed twice"),
    ("# nobody\n", "names no host"),
])
def test_a_bad_hosts_file_gets_one_line_and_exit_2(tmp_path, capsys, text, message):
    code = run.main(["--hosts-file", hosts_file(tmp_path, text), "--", "--run-dir", str(tmp_path / "run")])
    assert code == 2 and message in one_error_line(capsys)


def test_no_run_dir_no_hosts_no_file_each_get_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert run.main(["--hosts-file", hosts_file(tmp_path), "--", "--epochs", "1"]) == 2
    assert "need --run-dir" in one_error_line(capsys)
    assert run.main(["--", "--run-dir", str(tmp_path)]) == 2
    assert "--hosts-file FILE, or --slurm" in one_error_line(capsys)
    assert run.main(["--hosts-file", str(tmp_path / "none"), "--", "--run-dir", str(tmp_path)]) == 2
    assert "no hosts file" in one_error_line(capsys)


def test_the_supervisor_starts_no_torch_and_no_mpi():
    code = "import sys, hsgd.run; sys.exit(bool({'torch', 'mpi4py.MPI'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# --- which ends are restarted, on which hosts ------------------------------------------------

A, B, C = Host("127.0.0.1", 2), Host("localhost", 2), Host("127.0.0.2", 2)
END = {"event": "end", "step": 10, "stopped": None}  # the trainer's last record


def supervise(tmp_path, monkeypatch, jobs, answers, extra=()):
    """Run the loop with ``jobs``, a list of (exit status, fault records) the job ends with in turn
    (``END`` among them: the trainer's end record),
    and ``answers``, the hosts that answer at each probe; returns (exit status, hosts of each
    start, the run's records)."""
    args = run.build_parser().parse_args(["--hosts-file", hosts_file(tmp_path, "127.0.0.1:2\nlocalhost:2\n"
                                          "127.0.0.2:2\n"), *extra, "--", "--run-dir", str(tmp_path / "run")])
    supervisor = Supervisor(args)
    started, answers = [], list(answers)

    def launch(hosts, first, journal, on_records):
        started.append([h.name for h in hosts])
        code, faults = jobs[len(started) - 1]
        records = JobRecords()
        if faults == "hung":  # killed by the supervisor: no start record within --startup-timeout
            records.startup_timed_out, faults = 300.0, []
        for fault in faults:
            records.take({"event": "fault", **fault})
        return code, records, None
    monkeypatch.setattr(supervisor, "launch", launch)
    monkeypatch.setattr(supervisor, "answering", lambda: answers.pop(0))
    code = supervisor.loop()
    path = tmp_path / "run" / "metrics.jsonl"
    return code, started, [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_lost_host_restarts_the_job_on_the_others_and_a_host_back_joins_the_next(tmp_path, monkeypatch):
    code, started, records = supervise(tmp_path, monkeypatch, [(9, []), (1, [{"cause": "stall", "missing": [2, 3]}]),
                                                               (0, [END])],
                                       [[A, B, C], [A, B], [A, C]])
    assert code == 0
    assert started == [["127.0.0.1", "localhost", "127.0.0.2"], ["127.0.0.1", "localhost"], ["127.0.0.1", "127.0.0.2"]]
    assert [(r["lost_hosts"], r["lost_ranks"], r["world_size"]) for r in records] == [
        (["127.0.0.2"], [], 4), (["localhost"], [2, 3], 4)]


@pytest.mark.parametrize("job,answers,want", [
    ((1, [{"cause": "exception", "rank": 3, "host": "h", "error": "RuntimeError: a bug"}]), [[A]], 1),
    ((2, []), [[A]], 2),      # bad input
    ((75, []), [[A]], 75),    # stopped by a signal, checkpointed
    ((9, []), [[A, B, C]], 9),  # a killed process, every host answers: no host was lost
    ((9, []), [[A]], 75),     # one host left, --min-nodes 2: a batch script requeues
    ((0, [END]), [], 0),      # done
    ((0, []), [[A, B, C]], 0),  # status 0 without the end record, every host answers: not restarted
])
def test_ends_that_are_not_restarted(tmp_path, monkeypatch, job, answers, want):
    code, started, records = supervise(tmp_path, monkeypatch, [job], [[A, B, C], *answers], ["--min-nodes", "2"])
    assert (code, len(started), records) == (want, 1, [])


def test_status_0_without_the_trainers_end_record_is_checked_for_a_lost_host(tmp_path, monkeypatch):
    # Open MPI's launcher exits 0 when it ends a job after losing a host
    code, started, records = supervise(tmp_path, monkeypatch, [(0, []), (0, [END])], [[A, B, C], [A, B]])
    assert code == 0 and len(started) == 2 and [r["lost_hosts"] for r in records] == [["127.0.0.2"]]


def test_a_job_hung_in_its_start_up_is_started_again_even_when_every_host_answers(tmp_path, monkeypatch):
    code, started, records = supervise(tmp_path, monkeypatch, [(-9, "hung"), (0, [END])], [[A, B, C], [A, B, C]])
    assert code == 0 and len(started) == 2
    assert [(r["lost_hosts"], r["startup_timed_out"], r["world_size"]) for r in records] == [([], 300.0, 6)]
    assert "did not start in 300 s" in report.restart_line(records[0])


def test_run_job_kills_a_job_without_a_start_record_after_the_startup_timeout(tmp_path):
    """The launcher and what it started are killed; a job that wrote its start record is left to run."""
    journal = Journal(tmp_path)
    child = tmp_path / "child.pid"
    hang = [sys.executable, "-c", f"import subprocess, time; p = subprocess.Popen(['sleep', '600']); "
            f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(600)"]
    code, records, received = run_job(hang, dict(os.environ), journal, startup_timeout=1.0)
    assert (code, records.startup_timed_out, records.start, received) == (-9, 1.0, None, None)
    stat = f"/proc/{int(child.read_text())}/stat"
    for _ in range(100):  # gone, or a zombie where nothing reaps orphans
        if not os.path.exists(stat) or open(stat).read().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the hung job's child is still running")
    start = json.dumps({"event": "start", "wall": 0.0})
    writes = [sys.executable, "-c", f"import time; open({str(tmp_path / 'metrics.jsonl')!r}, 'a').write("
              f"{start + chr(10)!r}); time.sleep(2)"]
    # 60 s: a busy machine's interpreter start-up must not count as a hang
    code, records, received = run_job(writes, dict(os.environ), Journal(tmp_path), startup_timeout=60.0)
    assert (code, records.startup_timed_out, records.start) == (0, None, {"event": "start", "wall": 0.0})


def test_the_supervisor_kills_a_launch_that_hangs_and_starts_it_again(tmp_path, capsys):
    """The whole loop with a stand-in launcher (a script): the probes' ``true`` runs, the first
    launch of the trainer hangs (as MPICH's did once after a host came back), the second
    writes the trainer's start and end records."""
    launcher = tmp_path / "mpiexec"
    launcher.write_text(f"""#!{sys.executable}
import json, os, sys, time
program = sys.argv[sys.argv.index("-n") + 2:]
if program == ["true"]:
    sys.exit(0)
run_dir = program[program.index("--run-dir") + 1]
marker = os.path.join(run_dir, "launched")
if not os.path.exists(marker):
    open(marker, "w").close()
    time.sleep(600)
with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({{"event": "start", "wall": time.time()}}) + "\\n")
    f.write(json.dumps({{"event": "end", "step": 1, "stopped": None}}) + "\\n")
""")
    launcher.chmod(0o755)
    (tmp_path / "run").mkdir()
    code = run.main(["--hosts-file", hosts_file(tmp_path), "--launcher", "mpich", "--mpiexec", str(launcher),
                     "--startup-timeout", "5", "--", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "did not start within --startup-timeout 5 s (no start record; raise it if" in err
    assert "the job ended well" in err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    restart = [r for r in records if r["event"] == "restart"]
    assert [(r["lost_hosts"], r["startup_timed_out"], r["world_size"]) for r in restart] == [([], 5.0, 4)]


def test_max_restarts_ends_the_loop_with_the_jobs_status(tmp_path, monkeypatch):
    code, started, records = supervise(tmp_path, monkeypatch, [(9, []), (9, [])], [[A, B, C], [A, B], [A]],
                                       ["--max-restarts", "1"])
    assert code == 9 and len(started) == 2 and len(records) == 1


def test_each_launcher_gets_the_hosts_its_way():
    hosts, program = [Host("a", 2), Host("b", 2)], ["python", "-m", "hsgd.train"]
    assert launch_command("mpich", "mpiexec", ["-iface", "ib0"], hosts, program) == \
        ["mpiexec", "-iface", "ib0", "-hosts", "a:2,b:2", "-n", "4", *program]
    assert launch_command("openmpi", "mpirun", [], hosts, program) == \
        ["mpirun", "--host", "a:2,b:2", "-n", "4", *program]
    assert launch_command("srun", "srun", ["--mpi=pmi2"], hosts, program) == \
        ["srun", "--mpi=pmi2", "--nodelist", "a,b", "--nodes", "2", "--ntasks-per-node", "2", "--ntasks", "4", *program]
    assert probe_command("mpich", "mpiexec", [], Host("b", 2)) == ["mpiexec", "-hosts", "b:1", "-n", "1", "true"]


def test_the_job_runs_with_a_stall_abort_pace_that_the_user_may_set(tmp_path, monkeypatch):
    """A host lost without a connection reset is seen by the stall inspector alone: the jobs get
    HSGD_STALL_ABORT_PACE (20, the user's environment, or --stall-abort-pace), and Open MPI's
    launcher, which passes on only what -x names, every HSGD_ variable."""
    from hsgd._supervisor import supervisor as module

    for name in [name for name in os.environ if name.startswith("HSGD_")]:
        monkeypatch.delenv(name)

    def job_env(*extra, env=None):
        monkeypatch.delenv(module.ABORT_PACE_ENV, raising=False)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        args = run.build_parser().parse_args(["--hosts-file", hosts_file(tmp_path), "--launcher", "openmpi",
                                              "--mpiexec", sys.executable, *extra, "--", "--run-dir", "r"])
        supervisor, seen = Supervisor(args), []
        monkeypatch.setattr(module, "run_job",
                            lambda cmd, env, journal, on, timeout: seen.append((cmd, env)) or (0, None, None))
        supervisor.launch([A], True, None, None)
        return seen[0]
    cmd, env = job_env()
    assert env["HSGD_STALL_ABORT_PACE"] == "20" and cmd[1:5] == ["-x", "HSGD_STALL_ABORT_PACE", "--host", "127.0.0.1:2"]
    assert job_env(env={"HSGD_STALL_ABORT_PACE": "50", "HSGD_STALL_TIMEOUT": "9"})[1]["HSGD_STALL_ABORT_PACE"] == "50"
    cmd, env = job_env("--stall-abort-pace", "0", env={"HSGD_STALL_ABORT_PACE": "50"})
    assert env["HSGD_STALL_ABORT_PACE"] == "0" and cmd.count("-x") == 2  # the timeout's too
    assert launch_command("mpich", "mpiexec", [], [A], ["p"], ["HSGD_X"]) == ["mpiexec", "-hosts", "127.0.0.1:2",
                                                                            "-n", "2", "p"]
