"""What Slurm still knows about an earlier attempt of a run: was its job requeued, which of its
nodes were lost.

A killed attempt writes no end record: its processes are gone. The next attempt (rank 0, once)
asks Slurm about the previous attempt's job and nodes, from the job id and hosts that attempt's
start record holds (`koochak.loop.run_history`):

- the job: ``scontrol show job -o ID``: its state, ``Restarts`` (Slurm requeued it that many
  times) and reason, while slurmctld still remembers it (``MinJobAge``, 300 s by default);
- each host: ``scontrol show node -o HOST``: lost when it is down or not responding now, or its
  ``slurmd`` started after the attempt began (the node was replaced or rebooted meanwhile).

Every question has a short timeout and every failure means "unknown": the answers only name
what happened for people; nothing depends on them.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["describe_loss", "job_facts", "lost_nodes"]

_TIMEOUT_S = 5.0


def _scontrol(*args: str) -> dict[str, str] | None:
    """The ``Key=Value`` fields of one ``scontrol show ... -o`` line; None if unavailable."""
    if shutil.which("scontrol") is None:
        return None
    try:
        done = subprocess.run(["scontrol", "show", *args, "-o"], capture_output=True, text=True,
                              timeout=_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    fields: dict[str, str] = {}
    for word in done.stdout.split("\n", 1)[0].split(" "):
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def _when(text: str | None) -> float | None:
    """Slurm's local ``2026-12-02T11:19:17`` as Unix seconds (None: none or unparsable)."""
    if not text or text in ("None", "Unknown", "(null)"):
        return None
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def job_facts(job_id: str) -> dict[str, Any]:
    """``{"state", "restarts", "reason"}`` of job ``job_id`` as far as Slurm remembers it (``{}``
    when it does not, or there is no Slurm here)."""
    fields = _scontrol("job", str(job_id))
    if not fields:
        return {}
    facts: dict[str, Any] = {"state": fields.get("JobState")}
    try:
        facts["restarts"] = int(fields.get("Restarts", "0"))
    except ValueError:
        pass
    reason = fields.get("Reason")
    if reason and reason != "None":
        facts["reason"] = reason
    return facts


def lost_nodes(hosts: Sequence[str], since: float) -> dict[str, str]:
    """``{host: why}`` for each of ``hosts`` that Slurm shows lost after Unix time ``since``."""
    lost = {}
    for host in hosts:
        fields = _scontrol("node", host)
        if not fields:
            continue
        state = fields.get("State", "")
        started = _when(fields.get("SlurmdStartTime"))
        if any(word in state for word in ("DOWN", "NOT_RESPONDING", "FAIL")) or state.endswith("*"):
            lost[host] = f"Slurm shows it {state.lower()}"
        elif started is not None and started > since:
            lost[host] = "its slurmd restarted after the attempt began"
    return lost


def describe_loss(
    hosts: Mapping[str, Sequence[int]], lost: Mapping[str, str], requeued: int | None
) -> str:
    """One phrase for people: ``node2 lost: rank 1 never ended (...); requeued by Slurm``."""
    parts = []
    for host, why in sorted(lost.items()):
        ranks = ", ".join(str(r) for r in sorted(hosts.get(host, ())))
        plural = "ranks" if len(hosts.get(host, ())) > 1 else "rank"
        parts.append(f"{host} lost: {plural} {ranks or '?'} never ended ({why})")
    if requeued:
        parts.append("requeued by Slurm" + (f" ({requeued} times)" if requeued > 1 else ""))
    return "; ".join(parts)
