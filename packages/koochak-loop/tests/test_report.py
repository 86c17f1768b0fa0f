"""koochak-report renders a real two-attempt run: curves, restart marker, tiers (issue 29)."""

from __future__ import annotations

import base64
import sys
import textwrap
from pathlib import Path

import pytest
from koochak.loop import report, report_cli
from koochak.loop.cli import main as train

pytest.importorskip("matplotlib")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_project import user_code  # noqa: E402

USER_CODE = user_code(
    '''
def step_fn(model, batch, ctx):
    if ctx.step == int(os.environ.get("REPORT_FAIL_AT", "-1")):
        raise RuntimeError("preempted")
    x, y = batch
    return {"loss": F.mse_loss(model(x), y), "tokens": 8 * 16}


def val_dataset(cfg):
    return [(torch.ones(4, 3), torch.full((4, 1), 3.0))]


def eval_fn(model, data, ctx):
    return {"loss": sum(float(F.mse_loss(model(x), y)) for x, y in data)}
''',
    batch=8,
)


@pytest.fixture(scope="module")
def two_attempts(tmp_path_factory):
    """A real koochak-train run: attempt 1 dies at step 7, attempt 2 resumes and finishes."""
    root = tmp_path_factory.mktemp("report")
    name = f"reportpkg_{abs(hash(str(root)))}"
    (root / f"{name}.py").write_text(USER_CODE)
    config = root / "cfg.yaml"
    (root / "replica").mkdir()
    config.write_text(textwrap.dedent(f"""
        train:
          max_steps: 12
          log_every: 1
          eval_every: 3
          ckpt_every: 3
          keep_last_k: null
          device: cpu
          out_dir: {root / "run"}
          checkpoint_replicas: [{root / "replica"}]
          progress_bar: false
        optim:
          optimizer: {{name: sgd, lr: 0.05}}
        entry:
          model: {name}:make_model
          dataset: {name}:dataset
          step: {name}:step_fn
          eval_dataset: {name}:val_dataset
          eval_fn: {name}:eval_fn
        """))  # fmt: skip
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    mp.setenv("REPORT_FAIL_AT", "7")
    assert train(["--config", str(config), "--resume", "none"]) == 1
    mp.delenv("REPORT_FAIL_AT")
    assert train(["--config", str(config)]) == 0
    mp.undo()
    sys.modules.pop(name, None)
    return root / "run"


def test_the_figure_holds_both_attempts_curves_and_the_restart_marker(two_attempts):
    data = report.gather_run(two_attempts)
    assert [a.number for a in data.attempts] == [1, 2] and data.attempts[1].start_step == 6
    fig = report.build_figure(data)
    loss_ax, rate_ax, _, ckpt_ax = fig.axes  # the fourth is the MFU twin of rate_ax
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines()}
    first, second = lines["loss-1"], lines["loss-2"]
    assert list(first.get_xdata()) == [0, 1, 2, 3, 4, 5, 6]  # died inside step 7
    assert list(second.get_xdata()) == [6, 7, 8, 9, 10, 11]  # step 6 redone
    assert list(lines["eval_loss-2"].get_xdata()) == [8, 11]
    restart = lines["restart-2"]
    assert list(restart.get_xdata()) == [6, 6] and restart.axes is loss_ax
    (label,) = [t for t in loss_ax.texts if t.get_gid() == "restart-label-2"]
    assert label.get_text() == "attempt 2: previous failed after step 7, resumed at 6 from tier 0"
    assert len(lines["tokens_per_s-2"].get_xdata()) == 6 and "mfu-1" in lines
    # the timeline: both tiers hold 2, 5 (attempt 1) and 8, 12 (attempt 2), joined by their lag
    commits = {gid: line for gid, line in lines.items() if gid and gid.startswith("commits-")}
    assert set(commits) == {"commits-tier0", "commits-tier1"}
    assert len(commits["commits-tier0"].get_xdata()) == 4 == len(commits["commits-tier1"].get_xdata())
    assert "lag-tier1" in lines and len(data.lags(1)) == 4 and min(data.lags(1)) >= 0
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_koochak_report_writes_a_png_and_a_self_contained_page(two_attempts, tmp_path, capsys):
    assert report_cli.main([str(two_attempts), "--out", str(tmp_path / "r")]) == 0
    png, page = tmp_path / "r.png", (tmp_path / "r.html").read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert base64.b64encode(png.read_bytes()).decode() in page
    assert "attempt 2: from step 6 (resumed from step 5, tier 0)" in page
    assert "attempt 1 ends: failed: RuntimeError: preempted" in page  # the story, from the history
    # (a queued copy of step 5 may be superseded by step 8's: which steps the replica got is the
    # replicator's business; each one it got is in the story)
    assert "step 8 replicated to tier 1" in page and "tier 1 commits step 12" in page
    # the loss curves' colours are in the picture (C0: attempt 1, C1: attempt 2)
    import matplotlib.image

    pixels = (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int).reshape(-1, 3)
    colours = {tuple(p) for p in pixels.tolist()}
    assert (31, 119, 180) in colours and (255, 127, 14) in colours and (214, 39, 40) in colours


def test_bad_run_dirs_and_a_missing_matplotlib_are_one_line(tmp_path, capsys, monkeypatch):
    assert report_cli.main([str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert report_cli.main([str(tmp_path)]) == 2
    assert "no log.jsonl or log.csv" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(report.ReportError, match=r"pip install 'koochak-loop\[report\]'"):
        report.load_pyplot()


def test_outputs_never_write_through_a_link_planted_in_the_run_directory(two_attempts, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_attempts, run, ignore=shutil.ignore_patterns("report.*"))
    victim = tmp_path / "outside.txt"
    victim.write_text("keep me")
    (run / "report.png").symlink_to(victim)
    (run / "report.html").symlink_to(tmp_path / "created-outside.html")  # a dangling link
    assert report_cli.main([str(run)]) == 0
    assert victim.read_text() == "keep me" and not (tmp_path / "created-outside.html").exists()
    for name in ("report.png", "report.html"):
        assert not (run / name).is_symlink() and (run / name).stat().st_size > 0
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
    assert report_cli.main([str(run)]) == 0  # and again, over its own files


def test_the_story_survives_pruning_and_a_tier_this_host_cannot_list(two_attempts, tmp_path):
    """Retention pruned the first attempt's checkpoints in both tiers, and the replica cannot
    be listed from here: every commit and replication is still on the timeline (from the run
    history), the pruned ones hollow, and a star marks the commit attempt 2 resumed from."""
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(two_attempts, run, ignore=shutil.ignore_patterns("report.*"))
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["train"]["checkpoint_dir"] = str(tmp_path / "run")
    config["train"]["checkpoint_replicas"] = [str(tmp_path / "unreachable" / "replica")]
    (tmp_path / "unreachable").write_text("not a directory")  # listing it fails
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    for step in (2, 5):
        for suffix in (".pt", ".pt.ready.json"):
            (run / f"step{step:09d}{suffix}").unlink()
    data = report.gather_run(run)
    first, replica = data.tiers
    assert sorted(first.commits) == [2, 5, 8, 12] and first.pruned == [2, 5]
    # Attempt 2's copies are in the story. Attempt 1 failed while copying (steps 2 and 5): a
    # copy that ends after its attempt failed is in the replica but not in the history, and
    # which of the two that is depends on timing.
    assert {8, 12} <= set(replica.commits) and replica.present is None
    assert len(data.lags(1)) >= 3
    assert any("tier 1" in m and "run history's" in m for m in data.missing), data.missing
    assert data.attempts[1].resumed["tier"] == 0 and data.attempts[1].resumed["step"] == 5
    fig = report.build_figure(data)
    ckpt_ax = fig.axes[2]
    lines = {line.get_gid(): line for line in ckpt_ax.get_lines()}
    assert len(lines["pruned-tier0"].get_xdata()) == 2
    assert len(lines["commits-tier0"].get_xdata()) == 2
    assert len(lines["commits-tier1"].get_xdata()) == len(replica.commits)
    star = lines["resumed-from-2"]
    assert list(star.get_ydata()) == [0] and star.get_xdata()[0] == lines["pruned-tier0"].get_xdata()[1]
    texts = {t.get_gid(): t.get_text() for t in ckpt_ax.texts}
    assert texts["resumed-label-2"] == "attempt 2 resumed here (tier 0, step 5)"
    assert texts["attempt-ending-1"] == "attempt 1: failed: RuntimeError: preempted"
    assert {f"commit-label-tier0-{s}" for s in (5, 8, 12)} <= set(texts)
    assert {f"commit-label-tier1-{s}" for s in (8, 12)} <= set(texts)
    assert "commit-label-tier0-2" in texts
    import matplotlib.pyplot as plt

    plt.close(fig)
    assert report_cli.main([str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "tier 0 commits step 2 (pruned since)" in page and "step 8 replicated to tier 1" in page


def test_koochak_report_a_b_overlays_both_runs_named_by_what_differs(tmp_path, monkeypatch, capsys):
    name = f"comparepkg_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    runs = []
    for lr in (0.05, 0.01):
        config = tmp_path / f"lr{lr}.yaml"
        config.write_text(textwrap.dedent(f"""
            train: {{max_steps: 6, log_every: 1, eval_every: 3, device: cpu,
                     out_dir: {tmp_path / f"run-lr{lr}"}, progress_bar: false}}
            optim: {{optimizer: {{name: sgd, lr: {lr}}}}}
            entry: {{model: "{name}:make_model", dataset: "{name}:dataset", step: "{name}:step_fn",
                     eval_dataset: "{name}:val_dataset", eval_fn: "{name}:eval_fn"}}
            """))  # fmt: skip
        assert train(["--config", str(config), "--resume", "none"]) == 0
        runs.append(tmp_path / f"run-lr{lr}")
    capsys.readouterr()
    data = [report.gather_run(r) for r in runs]
    from koochak.loop import compare

    assert compare.differing_keys([d.config for d in data]) == ["optim.optimizer.lr"]
    fig = compare.build_comparison(data)
    lines = {line.get_gid(): line for line in fig.axes[0].get_lines()}
    assert list(lines["loss-run0"].get_xdata()) == list(range(6))
    assert "loss-run1" in lines and "eval_loss-run1" in lines
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "run-lr0.05: optim.optimizer.lr=0.05" in labels
    assert "run-lr0.01: optim.optimizer.lr=0.01" in labels
    summary = compare.run_summary(data[0])
    assert summary["last_step"] == 6 and summary["best_loss"] <= summary["final_loss"]
    assert summary["wall_s"] > 0 and 0 < summary["goodput"] <= 1
    import matplotlib.pyplot as plt

    plt.close(fig)
    assert report_cli.main([str(runs[0]), str(runs[1]), "--out", str(tmp_path / "cmp")]) == 0
    assert "wrote" in capsys.readouterr().out
    page = (tmp_path / "cmp.html").read_text()
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    assert "<th>optim.optimizer.lr</th>" in page and "<td>0.01</td>" in page
    assert "best_eval_loss" in page and "goodput" in page


def test_a_report_mid_run_shows_the_commits_so_far(two_attempts, tmp_path):
    """The second attempt still running (its end not yet written, its last line torn)."""
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_attempts, run, ignore=shutil.ignore_patterns("report.*"))
    lines = (run / "attempts.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    (cut,) = [i for i, r in enumerate(records) if r["event"] == "commit" and r["step"] == 8
              and r["tier"] == 0]  # fmt: skip
    (run / "attempts.jsonl").write_text("\n".join(lines[: cut + 1]) + '\n{"version": 2, "ev')
    log = [line for line in (run / "log.jsonl").read_text().splitlines() if '"end"' not in line]
    (run / "log.jsonl").write_text("\n".join(log) + "\n")
    data = report.gather_run(run)
    assert data.attempts[1].end_reason is None and report.ending(data.attempts[1]).startswith(
        "running"
    )
    assert 8 in data.tiers[0].commits and 12 in data.tiers[0].commits  # 12: the tier lists it
    assert report_cli.main([str(run)]) == 0
    assert "attempt 2 starts at step 6" in (run / "report.html").read_text()


def test_checkpoints_moved_aside_to_superseded_are_not_this_runs(two_attempts, tmp_path):
    """A --resume none start moves an older run's checkpoints to superseded/<run>-<time>/ in the
    same location (tier_marker): the report neither draws them as this run's commits nor lists
    them as present, in either tier, and koochak-compare (the same gather_run) follows."""
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(two_attempts, run, ignore=shutil.ignore_patterns("report.*"))
    config = yaml.safe_load((run / "config.yaml").read_text())
    replica = Path(config["train"]["checkpoint_replicas"][0])
    config["train"]["checkpoint_replicas"] = [str(tmp_path / "replica")]
    shutil.copytree(replica, tmp_path / "replica")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    for root in (run, tmp_path / "replica"):
        aside = root / "superseded" / "older-run-20260101T000000Z"
        aside.mkdir(parents=True)
        for suffix in (".pt", ".pt.ready.json"):
            shutil.copy(root / f"step000000012{suffix}", aside / f"step000000099{suffix}")
    data = report.gather_run(run)
    for tier in data.tiers:
        assert 99 not in tier.commits and 99 not in (tier.present or set()), tier
        assert 12 in tier.present


def test_a_run_initialised_from_another_says_so_in_its_history_and_report(two_attempts, tmp_path):
    """train.init_from's origin (path + sha256) is in the attempt's start record and the
    report's first line (in the HTML and the PNG's summary)."""
    import hashlib
    import json

    source = two_attempts / "step000000012.pt"
    tune = tmp_path / "tune"
    mp = pytest.MonkeyPatch()
    mp.chdir(two_attempts.parent)
    try:
        assert train(["--config", str(two_attempts.parent / "cfg.yaml"), "--resume", "none",
                      f"train.out_dir={tune}", f"train.init_from={source}", "train.max_steps=2",
                      "train.checkpoint_replicas=[]"]) == 0  # fmt: skip
    finally:
        mp.undo()
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    starts = [json.loads(line) for line in (tune / "attempts.jsonl").read_text().splitlines()]
    (start,) = [r for r in starts if r["event"] == "start"]
    assert start["origin"] == {"path": str(source), "sha256": digest, "ema": False}
    data = report.gather_run(tune)
    line = f"initialised from {source} (sha256 {digest})"
    assert report.summary_lines(data)[0] == line
    assert report_cli.main([str(tune)]) == 0
    assert line in (tune / "report.html").read_text()
