"""hsgd.report: loading, dedup, the summary table's numbers, PNGs and the CLI; no MPI.

Run directories are synthetic; expected numbers are computed by hand.
"""

import json
import logging
import subprocess
import sys

import pytest

from hsgd.report import Run, load_run, main, plot_run, summary_table

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CONFIG = {"model": "resnet18", "optimizer": "lars", "lr": 0.4, "batch_size": 256,
          "epochs": 3, "world_size": 8}


def step(s, loss, epoch=0):
    return {"event": "step", "epoch": epoch, "step": s, "loss": loss, "lr": 0.1,
            "samples_per_s": 5e4, "time": {"data": 0.01, "compute": 0.2, "intra": 0.03,
                                           "inter": 0.01}}


def epoch_record(e, test_acc, intra=0.3, inter=0.1, seconds=2.5, **extra):
    record = {"event": "epoch", "epoch": e, "step": 10 * (e + 1), "train_loss": 2.0 - e / 2,
              "train_acc": test_acc - 0.05, "test_loss": 1.9 - e / 2, "test_acc": test_acc,
              "lr": 0.1, "samples_per_s": 50000.0, "seconds": seconds,
              "time": {"data": 0.1, "compute": 1.5, "intra": intra, "inter": inter, "eval": 0.1},
              "intra_bytes": 2.5e6, "inter_bytes": 1.5e6}
    record.update(extra)
    return record


def write_run(path, records, config=CONFIG, tail=""):
    """A run directory with config.json and metrics.jsonl (plus raw ``tail`` text)."""
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (path / "metrics.jsonl").write_text(lines + tail)
    return path


def full_records():
    steps = [step(s, 2.3 - 0.05 * s, epoch=s // 10) for s in range(0, 30, 5)]
    epochs = [epoch_record(0, 0.40), epoch_record(1, 0.55), epoch_record(2, 0.61)]
    return steps[:2] + epochs[:1] + steps[2:4] + epochs[1:2] + steps[4:] + epochs[2:]


def table_rows(table):
    """The data rows of a markdown table as lists of stripped cells."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


# -- load_run -----------------------------------------------------------------

def test_load_run_reads_config_steps_and_epochs(tmp_path):
    run = load_run(write_run(tmp_path / "run", full_records()))
    assert run.config == CONFIG
    assert [s["step"] for s in run.steps] == [0, 5, 10, 15, 20, 25]
    assert [e["epoch"] for e in run.epochs] == [0, 1, 2]
    assert run.run_dir == tmp_path / "run"


def test_repeated_epoch_and_step_keep_the_last_record(tmp_path):
    records = [step(5, 9.0), epoch_record(0, 0.40), epoch_record(1, 0.10),
               # resumed run: re-logs step 5 and epoch 1
               step(5, 1.5), epoch_record(1, 0.55, intra=0.6, inter=0.2), epoch_record(2, 0.61)]
    run = load_run(write_run(tmp_path, records))
    assert [s["loss"] for s in run.steps] == [1.5]
    assert [e["test_acc"] for e in run.epochs] == [0.40, 0.55, 0.61]
    rows = table_rows(summary_table(run))
    assert [row[0] for row in rows] == ["0", "1", "2"]
    assert rows[1][3] == "55.00"
    # (0.6 + 0.2) / (0.1 + 1.5 + 0.6 + 0.2) = 0.8 / 2.4
    assert rows[1][5] == "33.3"


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    run_dir = write_run(tmp_path, full_records(), tail='{"event": "epoch", "epoch": 3, "tr')
    with caplog.at_level(logging.WARNING, logger="hsgd.report"):
        run = load_run(run_dir)
    assert [e["epoch"] for e in run.epochs] == [0, 1, 2]
    assert "metrics.jsonl:10" in caplog.text


def test_cut_line_in_the_middle_from_a_killed_then_resumed_run(tmp_path):
    tail = '{"event": "step", "st' + json.dumps(epoch_record(3, 0.7)) + "\n"
    tail += json.dumps(epoch_record(4, 0.72)) + "\n"
    run = load_run(write_run(tmp_path, full_records(), tail=tail))
    assert [e["epoch"] for e in run.epochs] == [0, 1, 2, 4]


def test_unknown_events_keys_and_non_objects_are_ignored(tmp_path):
    records = [{"event": "config_dump", "epoch": 0}, {"event": "step"},
               {"event": "epoch", "epoch": "zero"}, epoch_record(0, 0.5, new_key=[1, 2])]
    run_dir = write_run(tmp_path, records, tail="[1, 2]\n42\n\n")
    run = load_run(run_dir)
    assert run.steps == []
    assert [e["epoch"] for e in run.epochs] == [0]


def test_missing_config_is_allowed(tmp_path):
    assert load_run(write_run(tmp_path, full_records(), config=None)).config == {}


def test_missing_directory_names_path_and_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.*python -m hsgd.train --run-dir"):
        load_run(tmp_path / "nope")


def test_missing_metrics_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"metrics.jsonl.*hsgd.train --run-dir"):
        load_run(tmp_path)


def test_no_records_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="no step or epoch records"):
        load_run(write_run(tmp_path, [{"event": "start"}], tail="{trunc"))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_bad_config_is_a_value_error(tmp_path, text):
    write_run(tmp_path, full_records()).joinpath("config.json").write_text(text)
    with pytest.raises(ValueError, match="config.json"):
        load_run(tmp_path)


# -- summary_table ------------------------------------------------------------

def test_table_numbers(tmp_path):
    run = load_run(write_run(tmp_path, full_records()))
    table = summary_table(run)
    header = table.splitlines()[0]
    for name in ("epoch", "train loss", "test loss", "test acc %", "samples/s", "comm share %",
                 "intra MB", "inter MB"):
        assert name in header
    rows = table_rows(table)
    assert rows[0] == ["0", "2.0000", "1.9000", "40.00", "50,000", "20.0", "2.5", "1.5"]  # 0.4 / 2.0
    assert rows[2][:4] == ["2", "1.0000", "0.9000", "61.00"]
    assert table.splitlines()[-1] == ("best test acc: 61.00% (epoch 2); "
                                      "total time: 7.5 s over 3 epochs")


def test_restarts_of_a_supervised_run_follow_the_table(tmp_path):
    restart = {"event": "restart", "restart": 1, "from_step": 25, "lost_hosts": ["h3"], "lost_ranks": [4, 5],
               "hosts": ["h1", "h2"], "world_size": 4, "seconds_lost": 11.24}
    unknown = {**restart, "restart": 2, "from_step": 40, "lost_ranks": [], "seconds_lost": None}
    run = load_run(write_run(tmp_path, full_records() + [restart, unknown]))
    assert summary_table(run).splitlines()[-2:] == [
        "restart 1 at step 25: lost h3 (ranks 4, 5); 4 ranks on h1, h2; 11.2 s lost",
        "restart 2 at step 40: lost h3; 4 ranks on h1, h2; - s lost"]


def test_table_shows_dash_for_missing_values():
    idle = {"data": 0.0, "compute": 0.0, "intra": 0.0, "inter": 0.0}  # share undefined: 0 / 0
    record = {"event": "epoch", "epoch": 0, "train_loss": 1.0, "time": idle}
    table = summary_table(Run(config={}, epochs=[record]))
    assert table_rows(table)[0] == ["0", "1.0000", "-", "-", "-", "-", "-", "-"]
    assert table.splitlines()[-1] == "best test acc: -; total time: -"


def test_comm_share_of_a_one_node_run_counts_its_missing_inter_phase_as_zero():
    """One node: the trainer records no ``inter`` time; the share is intra's, as the progress line says."""
    record = {"event": "epoch", "epoch": 0, "train_loss": 1.0,
              "time": {"data": 0.1, "compute": 0.5, "intra": 0.4}}
    assert table_rows(summary_table(Run(config={}, epochs=[record])))[0][5] == "40.0"


def test_language_model_runs_show_bits_per_byte():
    """A --model gpt run's records carry test_bpb: a column and the lowest in the last line;
    a classification run's table has no such column (test_table_numbers)."""
    epochs = [epoch_record(e, acc, test_bpb=bpb, train_bpb=bpb + 0.1)
              for e, (acc, bpb) in enumerate(((0.3, 2.5), (0.2, 1.75), (0.25, 1.8)))]
    table = summary_table(Run(config={}, epochs=epochs))
    assert "| test bpb |" in table.splitlines()[0]
    assert "bpb" not in summary_table(Run(config={}, epochs=[epoch_record(0, 0.3)]))
    assert [row[4] for row in table_rows(table)] == ["2.5000", "1.7500", "1.8000"]
    assert table.splitlines()[-1].startswith("best test acc: 30.00% (epoch 0); best test bpb: 1.7500 (epoch 1);")


def test_best_accuracy_is_the_maximum_not_the_last():
    epochs = [epoch_record(0, 0.3), epoch_record(1, 0.8), epoch_record(2, 0.7)]
    assert "best test acc: 80.00% (epoch 1)" in summary_table(Run(config={}, epochs=epochs))


# -- plot_run -----------------------------------------------------------------

def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 5000, (path, len(data))


def test_plots_written_to_run_dir_plots_by_default(tmp_path):
    run = load_run(write_run(tmp_path / "run", full_records()))
    paths = plot_run(run)
    assert [p.name for p in paths] == ["loss.png", "accuracy.png", "time_breakdown.png"]
    assert all(p.parent == tmp_path / "run" / "plots" for p in paths)
    for path in paths:
        assert_png(path)


def test_steps_only_run_gets_just_the_loss_plot(tmp_path, caplog):
    run = load_run(write_run(tmp_path, [step(s, 2.0 / (s + 1)) for s in range(0, 50, 5)]))
    with caplog.at_level(logging.INFO, logger="hsgd.report"):
        paths = plot_run(run, tmp_path / "out")
    assert [p.name for p in paths] == ["loss.png"]
    assert_png(paths[0])
    assert "skipping accuracy.png" in caplog.text and "skipping time_breakdown.png" in caplog.text


def test_epochs_without_step_plot_loss_per_epoch(tmp_path):
    epochs = [epoch_record(e, 0.5) for e in range(3)]
    for record in epochs:
        del record["step"]
    paths = plot_run(Run(config={}, steps=[step(5, 1.0)], epochs=epochs), tmp_path)
    assert len(paths) == 3


def test_plot_run_without_out_dir_or_run_dir_says_what_to_pass():
    with pytest.raises(ValueError, match="out_dir"):
        plot_run(Run(config={}, epochs=[epoch_record(0, 0.5)]))


# -- main ---------------------------------------------------------------------

def test_main_prints_table_and_png_paths(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", full_records())
    assert main([str(run_dir), "--out", str(tmp_path / "figs")]) == 0
    out = capsys.readouterr().out
    assert "| epoch" in out and "best test acc: 61.00%" in out
    for name in ("loss.png", "accuracy.png", "time_breakdown.png"):
        assert str(tmp_path / "figs" / name) in out
        assert_png(tmp_path / "figs" / name)


def test_main_no_plots(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", full_records())
    assert main([str(run_dir), "--no-plots"]) == 0
    assert ".png" not in capsys.readouterr().out
    assert not (run_dir / "plots").exists()


@pytest.mark.parametrize("setup",
                         ["missing_dir", "missing_metrics", "empty_metrics", "bad_config"])
def test_main_bad_input_exits_2_with_one_line(tmp_path, capsys, setup):
    run_dir = tmp_path / "run"
    if setup != "missing_dir":
        run_dir.mkdir()
    if setup == "empty_metrics":
        (run_dir / "metrics.jsonl").write_text("")
    if setup == "bad_config":
        write_run(run_dir, full_records()).joinpath("config.json").write_text("{")
    assert main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hsgd.report: error:") and err.count("\n") == 1
    assert "Traceback" not in err


def test_main_unwritable_out_dir_exits_2(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", full_records())
    (tmp_path / "file").write_text("")
    assert main([str(run_dir), "--out", str(tmp_path / "file" / "plots")]) == 2
    assert "hsgd.report: error:" in capsys.readouterr().err


def test_report_does_not_start_mpi():
    """Reading a run needs no MPI: importing mpi4py.MPI would start a singleton MPI process
    (which fails on some login nodes and leaves a /dev/shm file behind under Open MPI 5)."""
    code = "import sys, hsgd, hsgd.report; sys.exit('mpi4py.MPI' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
