"""koochak-train under Scruffy: an unacknowledged checkpoint exits 76, a rejected one 77, each
with one JSON line on stderr; the numbered checkpoint stays for ``--resume auto``."""

from __future__ import annotations

import json
import sys
import textwrap
import types

import pytest
from koochak.loop.cli import main

USER_CODE = """
import torch
from torch.nn import functional as F


def make_model(cfg):
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1)


def dataset(cfg, start_step=0):
    gen = torch.Generator().manual_seed(start_step)
    while True:
        x = torch.randn(4, 2, generator=gen)
        yield x, x.sum(1, keepdim=True)


def step_fn(model, batch, ctx):
    x, y = batch
    return {"loss": F.mse_loss(model(x), y)}
"""


class Client(types.ModuleType):
    """scruffy-gpu 0.1.1's surface: publish_event spools, observe() shows what the controller did."""

    def __init__(self, answer: str) -> None:
        super().__init__("scruffy")
        self.answer = answer  # "never" (no controller ack) or "reject"
        self.published: list[dict] = []
        self.journal: list[dict] = []

    def publish_event(
        self, root, *, job_id, kind, data, event_id=None, occurred_at=None, source=None
    ):
        self.published.append({"kind": kind, "data": data, "event_id": event_id})
        if kind == "workload.artifact" and self.answer == "reject":
            import hashlib

            rid = f"{job_id}/{hashlib.sha256(event_id.encode()).hexdigest()}.json"
            self.journal.append(
                {
                    "kind": "notice",
                    "report_id": rid,
                    "data": {"kind": "workload.report_rejected", "reason": "bad"},
                }
            )
        return {"event_id": event_id, "job_id": job_id, "state": "spooled", "deduplicated": False}

    def observe(
        self, root, *, after=None, wait_seconds=0, include_output=False, limit=1000, project_id=None
    ):
        start = len(self.journal) if after is None else int(after)
        return {
            "events": self.journal[start:],
            "next_cursor": str(len(self.journal)),
            "more": False,
            "reset": False,
            "snapshot": {},
        }

    def status(self, root, job_id=None, *, project_id=None):
        return {"job_id": job_id, "workload": {"latest_artifacts": []}}


@pytest.fixture
def run(tmp_path, monkeypatch):
    name = f"exitpkg_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        textwrap.dedent(f"""
        train: {{max_steps: 6, ckpt_every: 3, log_every: 3, device: cpu, out_dir: {tmp_path / "run"},
                 progress_bar: false}}
        optim: {{optimizer: {{name: sgd, lr: 0.01}}}}
        logging: {{stdout: false}}
        entry: {{model: "{name}:make_model", dataset: "{name}:dataset", step: "{name}:step_fn"}}
    """)
    )
    monkeypatch.setenv("SCRUFFY_ROOT", str(tmp_path / "queue"))
    monkeypatch.setenv("SCRUFFY_JOB_ID", "job-1")
    monkeypatch.setenv("KOOCHAK_SCRUFFY_ARTIFACT_ACK_TIMEOUT_SECONDS", "0.2")

    def go(answer: str) -> tuple[int, Client]:
        client = Client(answer)
        monkeypatch.setitem(sys.modules, "scruffy", client)
        return main(["--config", str(config)]), client

    return tmp_path / "run", go


def last_json_line(err: str) -> dict:
    lines = [line for line in err.splitlines() if line.startswith("{")]
    assert len(lines) == 1, err
    return json.loads(lines[0])


def test_an_unacknowledged_checkpoint_exits_76_and_stays_resumable(run, capsys):
    run_dir, go = run
    code, client = go("never")
    assert code == 76
    record = last_json_line(capsys.readouterr().err)
    assert record["reason"] == "checkpoint_ack_timeout" and record["retryable"] is True
    assert record["checkpoint_path"] == str(run_dir / "step000000002.pt")
    (artifact,) = [e for e in client.published if e["kind"] == "workload.artifact"]
    assert record["event_id"] == artifact["event_id"]
    # Training stopped at the first checkpoint; it is committed, so a retry resumes from it.
    assert (run_dir / "step000000002.pt.ready.json").exists()
    assert not (run_dir / "step000000006.pt").exists()
    failed = [e for e in client.published if e["kind"] == "workload.phase"][-1]
    assert (
        failed["data"]["status"] == "failed"
        and failed["data"]["reason"] == "checkpoint_ack_timeout"
    )

    # The retry resumes from step 2 and first republishes that checkpoint under the same id.
    code, retry = go("never")
    assert code == 76
    kinds = [(e["kind"], e["event_id"]) for e in retry.published]
    assert ("workload.artifact", artifact["event_id"]) in kinds


def test_a_rejected_checkpoint_exits_77_with_one_json_line(run, capsys):
    run_dir, go = run
    code, _ = go("reject")
    assert code == 77
    record = last_json_line(capsys.readouterr().err)
    assert record["reason"] == "checkpoint_publication_rejected"
    assert record["retryable"] is False and record["detail"] == "bad"
    assert record["checkpoint_path"] == str(run_dir / "step000000002.pt")
