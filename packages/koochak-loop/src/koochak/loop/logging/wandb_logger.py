"""Weights & Biases hooks (rank 0): config at start, metrics, and versioned checkpoint artifacts.

Checkpoints go into ONE artifact per W&B run, ``<artifact_name_prefix>-<run_id>``, one version
per checkpoint, with aliases ``latest`` and ``step-<n>`` and, when a tracked metric improved
since the last uploaded version, ``best-<metric>`` (and ``best`` for the first tracked metric).
A version references the published checkpoint by path and SHA256 (nothing is copied); with
``wandb.upload_checkpoints`` the file is copied into W&B's staging area for upload instead, and
staged copies beyond ``train.keep_last_k`` are removed. The best values survive a restart: after
each version they are appended to ``<wandb.dir>/wandb/koochak-best-<run_id>.jsonl`` (and the run
summary's ``best/<metric>``), and a resumed attempt starts from the record of the checkpoint it
resumes from, not from nothing.

Restart rule: an attempt that resumes from durable checkpoint state must continue the same W&B
run, so it needs ``wandb.resume: allow`` and a stable ``wandb.name`` or ``wandb.id``; otherwise
training refuses to start. A first attempt is not constrained. With a name but no id, the run id
is derived from entity/project/name and the run's ``train.out_dir`` (a prepared run's run
directory), so every attempt of one run lands in the same W&B run and two runs sharing a name
do not.

``wandb`` is imported when the hooks are built (only if ``wandb.enabled``), never at module import.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from koochak.loop.hooks import Hooks, rank0_only
from koochak.loop.logging._records import attempt_fields, end_fields
from koochak.loop.masking import masking_active
from koochak.storage.strict_json import is_exact_int, loads_strict, require_version
from omegaconf import DictConfig, OmegaConf

__all__ = ["check_restart_settings", "make_wandb_hooks", "wandb_run_id"]

_WANDB_KEYS = (
    "enabled",
    "project",
    "entity",
    "name",
    "id",
    "resume",
    "mode",
    "dir",
    "artifact_name_prefix",
    "artifact_type",
    "log_checkpoints",
    "upload_checkpoints",
    "tags",
)
_MODES = ("online", "offline", "disabled")
_RESUME = ("allow", "must", "never", "auto")
_DIRECTIONS = ("min", "max")
_FROM_CONFIG = object()  # keep_last_k not given: read train.keep_last_k


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "wandb.enabled is true but wandb is not installed; install the extra: "
            "pip install 'koochak-loop[wandb]'"
        ) from None
    return wandb


def _plain(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(cfg, Mapping):
        raise TypeError(f"make_wandb_hooks(cfg): expected a mapping, got {type(cfg).__name__}")
    return dict(cfg)


def wandb_run_id(
    wandb_cfg: Mapping[str, Any], out_dir: str | os.PathLike[str] | None = None
) -> str | None:
    """The W&B run id to use: ``wandb.id``, else one derived from a stable name, else None.

    The derived id hashes entity/project/name and the absolute ``out_dir`` (``train.out_dir``:
    a prepared run's run directory), so the attempts of one run share it and two runs that
    share a ``wandb.name`` (prepared runs of one base config) do not. It exists only with
    ``resume: allow``; without it W&B picks a fresh id per attempt.
    """
    if wandb_cfg.get("id"):
        return str(wandb_cfg["id"])
    if wandb_cfg.get("name") and wandb_cfg.get("resume") == "allow":
        key = (
            f"{wandb_cfg.get('entity') or ''}/{wandb_cfg.get('project') or ''}/{wandb_cfg['name']}"
        )
        if out_dir is not None:
            key += "\0" + os.path.abspath(os.fspath(out_dir))
        return "koochak-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return None


def check_restart_settings(wandb_cfg: Mapping[str, Any], step: int) -> None:
    """ValueError unless ``wandb_cfg`` lets an attempt resuming at ``step`` continue its W&B run
    (``resume: allow`` and a stable ``name`` or ``id``). The hooks check it at train start;
    koochak-train checks it as soon as it has found the checkpoint, before building anything."""
    problems = []
    if wandb_cfg.get("resume") != "allow":
        problems.append(f"wandb.resume is {wandb_cfg.get('resume')!r} (needs 'allow')")
    if not (wandb_cfg.get("name") or wandb_cfg.get("id")):
        problems.append("neither wandb.name nor wandb.id is set")
    if problems:
        raise ValueError(
            f"wandb: this attempt resumes from checkpoint state (next step {step}), so it must "
            f"continue the same W&B run, but {' and '.join(problems)}; set wandb.resume: allow "
            "and a stable wandb.name or wandb.id"
        )


def _validate(wandb_cfg: Mapping[str, Any]) -> None:
    unknown = [k for k in wandb_cfg if k not in _WANDB_KEYS]
    if unknown:
        raise ValueError(
            f"wandb: unknown key(s) {', '.join(map(repr, unknown))}; supported keys: "
            f"{', '.join(_WANDB_KEYS)}"
        )
    mode = wandb_cfg.get("mode") or "online"
    if mode not in _MODES:
        raise ValueError(f"wandb.mode: unsupported value {mode!r}; supported: {', '.join(_MODES)}")
    resume = wandb_cfg.get("resume")
    if resume is not None and resume not in _RESUME:
        raise ValueError(
            f"wandb.resume: unsupported value {resume!r}; supported: {', '.join(_RESUME)} or null"
        )
    for key in ("log_checkpoints", "upload_checkpoints"):
        if not isinstance(wandb_cfg.get(key, False), bool):
            raise ValueError(f"wandb.{key} must be true or false, got {wandb_cfg[key]!r}")
    for key in ("artifact_name_prefix", "artifact_type"):
        value = wandb_cfg.get(key) or "model"
        if (
            not isinstance(value, str)
            or not value.replace("-", "").replace("_", "").replace(".", "").isalnum()
        ):
            raise ValueError(f"wandb.{key} must be letters, digits, '-', '_' or '.', got {value!r}")


# ----------------------------------------------------------------------------- best record

BEST_RECORD_VERSION = 1


def best_record_path(run_dir: str | os.PathLike[str], run_id: str) -> Path:
    """Where the hooks keep the best value of each tracked metric, version by version."""
    return Path(run_dir) / "wandb" / f"koochak-best-{run_id}.jsonl"


def append_best_record(path: Path, step: int, next_step: int, best: Mapping[str, float]) -> None:
    """Append one line (synced): after the checkpoint resuming at ``next_step`` was versioned,
    the best values were ``best``. A restart reads it back with `read_best_record`."""
    line = {
        "version": BEST_RECORD_VERSION,
        "step": step,
        "next_step": next_step,
        "best": dict(best),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_best_record(path: Path, start_step: int) -> dict[str, float]:
    """The best values as of the checkpoint a run resumes at ``start_step`` from: the last
    record whose ``next_step`` is at most ``start_step`` (versions made after that state, by
    an attempt that then failed, do not count). A torn or foreign line is skipped with a
    warning; no file gives ``{}``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    best: dict[str, float] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            record = loads_strict(line, f"{path}:{number}")
            require_version(record, f"{path}:{number}", BEST_RECORD_VERSION)
            values = record["best"]
            if not is_exact_int(record["next_step"]) or not isinstance(values, dict):
                raise ValueError(f"{path}:{number}: fields next_step and best are malformed")
            parsed = {str(k): float(v) for k, v in values.items() if _finite(v)}
        except (ValueError, KeyError, TypeError) as exc:
            warnings.warn(f"wandb best record: skipping line {number}: {exc}", stacklevel=2)
            continue
        if record["next_step"] <= start_step:
            best = parsed
    return best


def checkpoint_reference(path: str, publication: Any = None) -> dict[str, Any]:
    """What an artifact version records of a checkpoint: ``path``, ``sha256`` and ``size`` (from
    its publication record, else hashed from a local file) and the ``artifact_id`` when known."""
    reference: dict[str, Any] = {"path": path}
    if publication is not None:
        reference.update(
            sha256=publication.sha256, size=publication.size, artifact_id=publication.artifact_id
        )
    elif "://" not in path and os.path.isfile(path):
        digest, size = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
                size += len(block)
        reference.update(sha256=digest.hexdigest(), size=size)
    return reference


def _checkpoint_files(folder: str, name: str) -> list[str]:
    """The files of the local checkpoint ``folder/name``: the file itself, or for one in parts
    its parts and its index (``checkpoint_objects`` without the ready manifest)."""
    from koochak.loop.checkpoint import checkpoint_objects

    return checkpoint_objects(folder, name)[:-1]


def _prune_staged(staged: list[tuple[Any, list[str]]], keep: Any, offline: bool) -> None:
    """Remove the staged upload copies of all but the newest ``keep`` versions (None/0: keep
    all), the retention ``keep_last_k`` gives the checkpoints themselves. Online, a version is
    uploaded (``wait``) before its copy goes; offline, older versions can no longer be synced."""
    while isinstance(keep, int) and keep > 0 and len(staged) > keep:
        artifact, staged_paths = staged.pop(0)
        if not offline:
            try:
                artifact.wait()
            except Exception as exc:  # the upload failed: its copy is of no further use
                warnings.warn(f"wandb: artifact upload failed ({exc})", stacklevel=2)
        for staged_path in staged_paths:  # one per file: a checkpoint in parts has several
            try:
                os.unlink(staged_path)
            except FileNotFoundError:
                pass  # W&B removed it after the upload


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def make_wandb_hooks(
    cfg: Mapping[str, Any],
    *,
    resumed: bool | None = None,
    track: Mapping[str, str] | None = None,
    keep_last_k: int | None | object = _FROM_CONFIG,
) -> Hooks:
    """W&B hooks from the resolved config (or its ``wandb`` section); ``{}`` when not enabled.

    ``resumed`` overrides the loop's ``info["resumed"]`` for the restart rule. ``track`` maps
    metric names to ``"min"``/``"max"`` for the ``best`` aliases; by default ``eval_loss`` (min)
    when the checkpoint's metrics hold it, else ``loss`` (min). ``keep_last_k`` bounds the
    checkpoint copies staged for upload (``wandb.upload_checkpoints``); by default
    ``train.keep_last_k`` of the config, else of the loop's ``train_cfg``; None keeps them all.
    """
    full = _plain(cfg)
    wandb_cfg = _plain(full["wandb"]) if "wandb" in full else full
    _validate(wandb_cfg)
    if not wandb_cfg.get("enabled") or (wandb_cfg.get("mode") or "online") == "disabled":
        return {}
    if track is not None:
        bad = {k: v for k, v in track.items() if v not in _DIRECTIONS}
        if bad:
            raise ValueError(
                f"make_wandb_hooks(track=...): directions must be min or max, got {bad}"
            )
    wandb = _import_wandb()
    prefix = wandb_cfg.get("artifact_name_prefix") or "model"
    artifact_type = wandb_cfg.get("artifact_type") or "model"
    log_checkpoints = wandb_cfg.get("log_checkpoints", True)
    upload = bool(wandb_cfg.get("upload_checkpoints", False))
    train = full.get("train") if isinstance(full.get("train"), Mapping) else {}
    state: dict[str, Any] = {"run": None, "best": {}, "record": None, "staged": []}
    state["keep"] = (
        keep_last_k if keep_last_k is not _FROM_CONFIG else train.get("keep_last_k", _FROM_CONFIG)
    )

    def on_train_start(info: dict[str, Any]) -> None:
        is_resumed = resumed if resumed is not None else bool(info.get("resumed", False))
        if is_resumed:
            check_restart_settings(wandb_cfg, int(info.get("step", 0)))
        if state["keep"] is _FROM_CONFIG:
            state["keep"] = (info.get("train_cfg") or {}).get("keep_last_k")
        run_dir = wandb_cfg.get("dir") or info.get("out_dir") or "."
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        run_id = wandb_run_id(wandb_cfg, train.get("out_dir") or info.get("out_dir"))
        config = info.get("config_json")
        if config is None:
            config = full if "wandb" in full else {"train": info.get("train_cfg")}
        settings = {}
        if masking_active():
            # W&B's console capture hooks the streams itself and would copy what the run prints
            # into its files before koochak's masking (koochak.loop.masking) sees it.
            settings["settings"] = wandb.Settings(console="off")
        state["run"] = wandb.init(
            project=wandb_cfg.get("project"),
            entity=wandb_cfg.get("entity"),
            name=wandb_cfg.get("name"),
            id=run_id,
            resume=wandb_cfg.get("resume"),
            mode=wandb_cfg.get("mode") or "online",
            dir=str(run_dir),
            tags=list(wandb_cfg.get("tags") or []) or None,
            config=_plain(config),
            **settings,
        )
        state["record"] = best_record_path(run_dir, run_id or state["run"].id)
        attempt = info.get("attempt")
        if attempt:  # the attempt record: in the summary (history steps may not go back)
            summary = state["run"].summary
            summary["attempt"] = attempt["attempt"]
            summary[f"attempts/{attempt['attempt']}"] = attempt_fields(attempt)
        if is_resumed:  # the aliases continue from the best value the resumed state had seen
            state["best"] = read_best_record(state["record"], int(info.get("step", 0)))

    def _log(info: dict[str, Any]) -> None:
        if state["run"] is not None:
            metrics = {k: v for k, v in info["metrics"].items() if not isinstance(v, str)}
            state["run"].log(metrics, step=int(info["step"]))

    def _improved(metrics: Mapping[str, Any]) -> list[str]:
        tracked = (
            dict(track)
            if track is not None
            else ({"eval_loss": "min"} if "eval_loss" in metrics else {"loss": "min"})
        )
        improved = []
        for name, direction in tracked.items():
            value = metrics.get(name)
            if value is None or not math.isfinite(float(value)):
                continue
            value = float(value)
            best = state["best"].get(name)
            if best is None or (value < best if direction == "min" else value > best):
                state["best"][name] = value
                improved.append(name)
        # "best" follows the first tracked metric only, so it has one meaning per run.
        first = next(iter(tracked), None)
        return (["best"] if first in improved else []) + [f"best-{name}" for name in improved]

    def on_checkpoint(info: dict[str, Any]) -> None:
        run = state["run"]
        if run is None or not log_checkpoints:
            return
        path = str(info["path"])
        local = "://" not in path and os.path.isfile(path)
        if upload and not local:
            raise ValueError(
                f"wandb: checkpoint {path!r} is not a local file, so it cannot be uploaded; set "
                "wandb.upload_checkpoints: false to reference it by path and SHA256 instead"
            )
        step = int(info["step"])
        checkpoint = info.get("checkpoint") or {}
        metrics = dict(checkpoint.get("metrics") or {})
        reference = checkpoint_reference(path, info.get("publication"))
        artifact = wandb.Artifact(
            f"{prefix}-{run.id}",
            type=artifact_type,
            metadata={"step": step, **metrics, "checkpoint": reference},
        )
        folder, name = os.path.split(path.rstrip("/"))
        # A checkpoint in parts is its index plus the parts beside it: a version holds them all.
        keys = _checkpoint_files(folder, name) if local else [name]
        if upload:
            # The (mutable) policy copies the files into W&B's staging area right here, so
            # pruning (keep_last_k) cannot delete them before a background upload reads them.
            entries = [artifact.add_file(os.path.join(folder, key), name=key) for key in keys]
            state["staged"].append((artifact, [entry.local_path for entry in entries]))
        elif local:  # references: W&B records the paths, reads and copies nothing
            for key in keys:
                uri = Path(os.path.join(folder, key)).resolve().as_uri()
                artifact.add_reference(uri, name=key, checksum=False)
        run.log_artifact(artifact, aliases=["latest", f"step-{step}", *_improved(metrics)])
        for metric, value in state["best"].items():
            run.summary[f"best/{metric}"] = value
        next_step = int(checkpoint.get("next_step", step + 1))
        append_best_record(state["record"], step, next_step, state["best"])
        _prune_staged(state["staged"], state["keep"], bool(getattr(run, "offline", False)))

    def on_train_end(info: dict[str, Any]) -> None:
        if state["run"] is not None:
            for name, value in end_fields(info.get("run") or {}).items():
                state["run"].summary[name] = value  # the run's goodput so far
            state["run"].finish()
            state["run"] = None

    def on_exception(info: dict[str, Any]) -> None:
        if state["run"] is not None:
            state["run"].finish(exit_code=1)
            state["run"] = None

    return {
        "on_train_start": [rank0_only(on_train_start)],
        "on_log": [rank0_only(_log)],
        "on_eval_end": [rank0_only(_log)],
        "on_checkpoint": [rank0_only(on_checkpoint)],
        "on_train_end": [rank0_only(on_train_end)],
        "on_exception": [rank0_only(on_exception)],
    }
