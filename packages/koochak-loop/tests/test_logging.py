import io
import json
import math

import koochak.loop.dist as kdist
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from koochak.loop.hooks import emit, merge
from koochak.loop.logging import (
    CSVLogger,
    JSONLLogger,
    make_csv_hooks,
    make_jsonl_hooks,
    make_progress_hooks,
    make_stdout_hooks,
    read_csv_log,
    read_jsonl_log,
)

# ------------------------------------------------------------------------------------- CSV


def test_csv_metric_that_appears_later_extends_header_without_losing_rows(tmp_path):
    path = tmp_path / "log.csv"
    logger = CSVLogger(path)
    logger.log(0, {"loss": 2.5, "lr": 0.1}, wall_time=1.0)
    logger.log(1, {"loss": 1.25, "lr": 0.1}, wall_time=2.0)
    logger.log(1, {"eval_loss": 1.5, "eval_acc": 0.75}, event="eval", wall_time=3.0)
    logger.log(2, {"loss": 1 / 3, "lr": 0.05, "grad_norm": 7.0}, wall_time=4.0)
    logger.close()

    header = path.read_text().splitlines()[0]
    assert header == "version,event,step,time,loss,lr,eval_loss,eval_acc,grad_norm"
    assert read_csv_log(path) == [
        {"event": "log", "step": 0, "time": 1.0, "metrics": {"loss": 2.5, "lr": 0.1}},
        {"event": "log", "step": 1, "time": 2.0, "metrics": {"loss": 1.25, "lr": 0.1}},
        {"event": "eval", "step": 1, "time": 3.0, "metrics": {"eval_loss": 1.5, "eval_acc": 0.75}},
        # repr() keeps every bit of the float.
        {
            "event": "log",
            "step": 2,
            "time": 4.0,
            "metrics": {"loss": 1 / 3, "lr": 0.05, "grad_norm": 7.0},
        },
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["log.csv"]  # no temp file left behind


def test_csv_header_growth_keeps_the_file_mode(tmp_path):
    path = tmp_path / "log.csv"
    logger = CSVLogger(path)
    logger.log(0, {"loss": 1.0})
    path.chmod(0o640)
    logger.log(1, {"loss": 1.0, "new": 2.0})
    logger.close()
    assert path.stat().st_mode & 0o777 == 0o640


def test_csv_resume_appends_and_keeps_existing_columns(tmp_path):
    path = tmp_path / "log.csv"
    first = CSVLogger(path)
    first.log(0, {"loss": 1.0, "acc": 0.5})
    first.close()

    resumed = CSVLogger(path)
    resumed.log(5, {"acc": 0.9})  # a subset: the loss cell stays empty
    resumed.log(6, {"loss": 0.5, "new_metric": 3})
    resumed.close()

    rows = read_csv_log(path)
    assert [r["step"] for r in rows] == [0, 5, 6]
    assert rows[0]["metrics"] == {"loss": 1.0, "acc": 0.5}
    assert rows[1]["metrics"] == {"acc": 0.9}
    assert rows[2]["metrics"] == {"loss": 0.5, "new_metric": 3}
    assert path.read_text().splitlines()[0].endswith("loss,acc,new_metric")


def test_csv_after_a_crash_mid_row_starts_a_new_row(tmp_path):
    path = tmp_path / "log.csv"
    logger = CSVLogger(path)
    logger.log(0, {"loss": 1.0})
    logger.close()
    with open(path, "a") as f:
        f.write("1,log,1,9.0,0.")  # a torn row, no newline
    logger = CSVLogger(path)
    logger.log(2, {"loss": 0.25})
    logger.close()
    assert path.read_text().splitlines()[-1].startswith("1,log,2,")


def test_csv_refuses_foreign_files_and_bad_metrics(tmp_path):
    foreign = tmp_path / "other.csv"
    foreign.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="other.csv.*not a koochak metric CSV"):
        CSVLogger(foreign).log(0, {"loss": 1.0})
    assert foreign.read_text() == "a,b\n1,2\n"
    logger = CSVLogger(tmp_path / "log.csv")
    with pytest.raises(ValueError, match="clash"):
        logger.log(0, {"step": 1.0})
    with pytest.raises(TypeError, match="metric 'x'"):
        logger.log(0, {"x": [1, 2]})


def test_csv_reader_rejects_unknown_version(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("version,event,step,time,loss\n2,log,0,1.0,0.5\n")
    with pytest.raises(ValueError, match="log.csv:2: field 'version'"):
        read_csv_log(path)


def test_csv_values_accept_tensors_and_non_finite(tmp_path):
    logger = CSVLogger(tmp_path / "log.csv")
    logger.log(0, {"loss": torch.tensor(0.5), "inf": math.inf, "nan": math.nan, "flag": True})
    logger.close()
    metrics = read_csv_log(tmp_path / "log.csv")[0]["metrics"]
    assert metrics["loss"] == 0.5 and metrics["inf"] == math.inf and math.isnan(metrics["nan"])
    assert metrics["flag"] == 1


# ------------------------------------------------------------------------------------- JSONL


def test_jsonl_round_trip_and_flush_per_line(tmp_path):
    path = tmp_path / "sub" / "log.jsonl"
    logger = JSONLLogger(path)
    logger.log(3, {"loss": 0.125, "lr": torch.tensor(1e-3)}, wall_time=10.0)
    # Flushed per line: readable while the logger is still open.
    assert json.loads(path.read_text()) == {
        "version": 1,
        "event": "log",
        "step": 3,
        "time": 10.0,
        "metrics": {"loss": 0.125, "lr": pytest.approx(1e-3)},
    }
    logger.log(3, {"eval_loss": 0.5}, event="eval", wall_time=11.0)
    logger.close()
    JSONLLogger(path).log(4, {"loss": 0.1}, wall_time=12.0)  # reopening appends
    records = read_jsonl_log(path)
    assert [(r["event"], r["step"]) for r in records] == [("log", 3), ("eval", 3), ("log", 4)]


def test_jsonl_reader_rejects_unknown_version_and_keys(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"version": 9, "event": "log", "step": 0, "time": 0, "metrics": {}}))
    with pytest.raises(ValueError, match="log.jsonl:1: field 'version'"):
        read_jsonl_log(path)
    record = {"version": 1, "event": "log", "step": 0, "time": 0, "metrics": {}, "extra": 1}
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match="unknown field.*extra"):
        read_jsonl_log(path)


# ------------------------------------------------------------------------------------- hooks


def test_stdout_hooks_print_config_and_compact_tsv(capsys):
    hooks = make_stdout_hooks(print_config=True)
    emit(hooks, "on_train_start", {"step": 0, "config_json": {"train": {"max_steps": 3}}})
    emit(hooks, "on_log", {"step": 9, "metrics": {"loss": 0.123456, "lr": 0.0003}})
    emit(hooks, "on_eval_end", {"step": 9, "metrics": {"eval_acc": 0.5}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == [
        "# resolved config",
        "train:",
        "  max_steps: 3",
        "start\tstep=0\tmax_steps=None",
    ]
    assert lines[-2] == "log\tstep=9\tloss=0.1235\tlr=0.0003"
    assert lines[-1] == "eval\tstep=9\teval_acc=0.5"


def test_stdout_prints_one_screen_and_writes_the_full_config_to_out_dir(tmp_path, capsys):
    from koochak.loop.config import defaults, to_container
    from omegaconf import OmegaConf

    config = defaults()
    config["train"].update(max_steps=60, grad_accum=4, out_dir=str(tmp_path))
    config["model"] = {"n_layer": 4, "n_embd": 128}
    config["optim"]["optimizer"]["param_groups"] = [{"max_ndim": 1, "weight_decay": 0.0}]
    info = {"step": 0, "max_steps": 60, "config_json": config, "out_dir": str(tmp_path)}
    emit(make_stdout_hooks(), "on_train_start", info)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"# config: what differs from the defaults (full config: {tmp_path / 'config.yaml'}; "
        "logging.print_config: true prints all of it)"
    )
    assert lines[1] == "train    max_steps=60 grad_accum=4"
    assert lines[2] == f"         out_dir={tmp_path}"  # wrapped at ~100 columns
    assert lines[3] == "model    n_layer=4 n_embd=128"
    assert lines[4] == 'optim    optimizer.param_groups=[{"max_ndim": 1, "weight_decay": 0.0}]'
    assert lines[5].startswith("start\t") and len(lines) == 6  # one screen, not ~115 lines
    written = to_container(OmegaConf.load(tmp_path / "config.yaml"))
    assert written == config  # the whole resolved config, for later reference


def test_stdout_start_line_names_the_checkpoint_a_run_resumed_from(capsys):
    info = {"step": 30, "max_steps": 30, "resume_path": "/runs/x/step000000030.pt"}
    emit(make_stdout_hooks(print_config=False), "on_train_start", info)
    out = capsys.readouterr().out
    assert out == "start\tstep=30\tmax_steps=30\tresumed_from=/runs/x/step000000030.pt\n"


def test_file_sinks_write_only_on_rank0(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kdist, "get_rank", lambda: 1)
    hooks = merge(
        make_csv_hooks(tmp_path / "log.csv"),
        make_jsonl_hooks(tmp_path / "log.jsonl"),
        make_stdout_hooks(),
    )
    emit(hooks, "on_log", {"step": 0, "metrics": {"loss": 1.0}})
    emit(hooks, "on_train_end", {"step": 1, "checkpoint": {}, "metrics": {}})
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out == ""


def test_csv_and_jsonl_hooks_record_log_and_eval_events(tmp_path):
    hooks = merge(make_csv_hooks(tmp_path / "log.csv"), make_jsonl_hooks(tmp_path / "log.jsonl"))
    emit(hooks, "on_log", {"step": 0, "metrics": {"loss": 1.0}})
    emit(hooks, "on_eval_end", {"step": 0, "metrics": {"eval_loss": 2.0}})
    emit(hooks, "on_train_end", {"step": 1, "checkpoint": {}, "metrics": {}})
    for records in (read_csv_log(tmp_path / "log.csv"), read_jsonl_log(tmp_path / "log.jsonl")):
        assert [(r["event"], r["metrics"]) for r in records] == [
            ("log", {"loss": 1.0}),
            ("eval", {"eval_loss": 2.0}),
        ]


def test_progress_hooks_are_empty_off_a_tty_and_draw_when_forced():
    assert make_progress_hooks(io.StringIO()) == {}
    out = io.StringIO()
    hooks = make_progress_hooks(out, force=True)
    emit(hooks, "on_train_start", {"step": 0, "max_steps": 4})
    for step in range(4):
        emit(hooks, "on_step_end", {"step": step, "outputs": {}})
    emit(hooks, "on_log", {"step": 3, "metrics": {"loss": 0.5}})
    emit(hooks, "on_train_end", {"step": 4, "checkpoint": {}, "metrics": {}})
    assert "4/4" in out.getvalue()


def _terminal(columns: int):
    """A pseudo-terminal reporting ``columns`` columns: (what was drawn so far, its writer)."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    writer = open(slave, "w", encoding="utf-8")  # noqa: SIM115

    def drawn() -> str:
        data = b""
        while select.select([master], [], [], 0.2)[0]:
            data += os.read(master, 65536)
        return data.decode()

    return drawn, writer


def test_no_bar_on_a_terminal_that_reports_0_columns(monkeypatch):
    import sys

    _, unsized = _terminal(0)
    monkeypatch.setattr(sys, "stdout", unsized)
    assert make_progress_hooks(unsized) == {}  # its rows would wrap and tear on clearing
    drawn, sized = _terminal(60)
    monkeypatch.setattr(sys, "stdout", sized)
    assert make_progress_hooks(sized) != {}


def test_log_lines_are_written_through_a_live_bar(monkeypatch):
    import sys

    drawn, terminal = _terminal(60)
    monkeypatch.setattr(sys, "stdout", terminal)
    hooks = merge(make_stdout_hooks(print_config=False), make_progress_hooks(terminal))
    emit(hooks, "on_train_start", {"step": 0, "max_steps": 4})
    emit(hooks, "on_step_end", {"step": 0, "outputs": {}})
    before = drawn()
    emit(hooks, "on_log", {"step": 0, "metrics": {"loss": 0.5}})
    after = drawn()
    emit(hooks, "on_train_end", {"step": 1, "checkpoint": {}, "metrics": {}})
    assert "/4 [" in before.rsplit("\r", 1)[-1]  # the bar is on screen
    # Cleared (carriage return, blanks, carriage return), the line on its own row, then redrawn.
    cleared, line, redrawn = after.partition("log\tstep=0\tloss=0.5\r\n")
    assert line and cleared.startswith("\r") and cleared.endswith(" \r") and "%|" not in cleared
    assert "1/4" in redrawn
    assert all(len(row) <= 60 for row in after.replace("\r\n", "\r").split("\r"))


def test_progress_without_tqdm_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(ImportError, match=r"koochak-loop\[tqdm\]"):
        make_progress_hooks(io.StringIO(), force=True)


def test_importing_the_sinks_does_not_import_wandb():
    # (tqdm cannot be checked the same way: torch itself imports it.)
    import subprocess
    import sys

    code = "import sys, koochak.loop.logging\nassert 'wandb' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


_names = st.sampled_from(["loss", "lr", "acc", "eval_loss", "grad,norm", 'q"uote', "ünï"])
_values = st.one_of(st.floats(allow_nan=False), st.integers(-(2**53), 2**53))
_record = st.tuples(
    st.sampled_from(["log", "eval"]),
    st.integers(0, 10**6),
    st.dictionaries(_names, _values, max_size=4),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(_record, max_size=8), st.integers(0, 8))
def test_csv_and_jsonl_round_trip_any_record_sequence_across_a_reopen(records, reopen_at):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        paths = Path(tmp) / "log.csv", Path(tmp) / "log.jsonl"
        loggers = CSVLogger(paths[0]), JSONLLogger(paths[1])
        for index, (event, step, metrics) in enumerate(records):
            if index == reopen_at:  # a resumed run reopens the same files
                for logger in loggers:
                    logger.close()
                loggers = CSVLogger(paths[0]), JSONLLogger(paths[1])
            for logger in loggers:
                logger.log(step, metrics, event=event, wall_time=float(index))
        for logger in loggers:
            logger.close()
        expected = [
            {"event": event, "step": step, "time": float(i), "metrics": metrics}
            for i, (event, step, metrics) in enumerate(records)
        ]
        assert (read_csv_log(paths[0]) if records else []) == expected
        assert (read_jsonl_log(paths[1]) if records else []) == expected
