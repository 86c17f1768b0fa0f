"""Is the resumed run the same run? The checkpoint's config against the one resuming from it.

A resume continues a run: the same data order, batch geometry, model, numerics, optimizer and
schedule. Every config key has a class in one table, `RESUME_CLASSES`:

- ``SAME_RUN``: a change leaves it the same run, and is reported once. What is observed (logging
  cadence, sinks), where and how the run is persisted (``out_dir``, ``checkpoint_*``, tiers,
  parts, async saves, retention, the run id), how it is executed (device, DDP/FSDP placement,
  compile, prefetch, evacuation, GPU health), and the EMA shadows (they average the weights
  without changing how they train).
- ``DIFFERENT_RUN``: a change makes a different run out of the checkpoint, so the resume is
  refused, naming each key with its old and new value and the override that accepts them
  (``train.resume_allow_changes``).

``train.max_steps`` is the one key with a rule of its own: the same run, unless the schedule's
horizon is ``train.max_steps`` (a cosine with ``T_max: null``) and it shrinks. An extension
continues the schedule (see `koochak.loop.optim.build_scheduler`).

A row names a key or a section (``optim`` covers every key under it); the longest row that
covers a key decides. The free-form ``data`` and ``model`` sections are ``DIFFERENT_RUN`` as a
whole; a key no row covers (an unknown key kept by ``train.strict_config: false``) too: fail
closed. Every field of `koochak.loop.config.Config` has a row (a test says which is missing).

Two things are not config questions and are checked here too: a checkpoint that recorded no
config cannot be compared (the resume goes on, with one warning that says so), and a model whose
parameters changed shape cannot take the checkpoint's weights at all (`check_model_shapes`:
refused, naming the parameter and both shapes, with no override).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from koochak.loop.config import flat_config

__all__ = [
    "DIFFERENT_RUN",
    "RESUME_CLASSES",
    "SAME_RUN",
    "ConfigChange",
    "ConfigDrift",
    "check_model_shapes",
    "check_resume_config",
    "compare_configs",
    "format_change",
    "resume_class",
    "schedule_follows_max_steps",
]

SAME_RUN = "same run"
DIFFERENT_RUN = "different run"
_SAME, _DIFF = SAME_RUN, DIFFERENT_RUN

# Every config key's resume class. Adding a config key? Add its row here, in its section:
# SAME_RUN when changing it between attempts leaves the run the same run (what is observed,
# where or how it is persisted, how it is executed), DIFFERENT_RUN when it changes what is
# trained (data order, batch geometry, model, numerics, optimizer, schedule).
RESUME_CLASSES: dict[str, str] = {
    # ---- train: what is trained
    "train.max_steps": _SAME,  # ...unless the schedule's horizon follows it and it shrinks
    "train.grad_accum": _DIFF,
    "train.amp": _DIFF,
    "train.grad_clip": _DIFF,
    "train.scheduler_step": _DIFF,
    "train.seed": _DIFF,
    "train.shard_dataset": _DIFF,
    "train.shard_dataset_mode": _DIFF,
    "train.fsdp.mixed_precision": _DIFF,  # changes the numerics, like train.amp
    # ---- train: what is observed
    "train.log_every": _SAME,
    "train.eval_every": _SAME,
    "train.eval_at_step_zero": _SAME,
    "train.progress_bar": _SAME,
    "train.shard_eval_dataset": _SAME,
    "train.shard_eval_dataset_mode": _SAME,
    "train.reduce_metrics": _SAME,
    "train.reduce_metrics_exclude": _SAME,
    "train.nonfinite_grad_check_every": _SAME,
    "train.tokens_per_sample": _SAME,
    "train.flops_per_step": _SAME,
    # ---- train: where and how the run is persisted
    "train.out_dir": _SAME,
    "train.run_id": _SAME,
    # Used only by a fresh start (a resume takes its weights from the checkpoint), so a later
    # attempt naming another source continues the same run.
    "train.init_from": _SAME,
    "train.init_from_ema": _SAME,
    "train.ckpt_every": _SAME,
    "train.keep_last_k": _SAME,
    "train.keep_best_k": _SAME,
    "train.keep_best_metric": _SAME,
    "train.keep_best_mode": _SAME,
    "train.checkpoint_dir": _SAME,
    "train.checkpoint_async": _SAME,
    "train.checkpoint_parts": _SAME,
    "train.checkpoint_replicas": _SAME,
    "train.checkpoint_replication_max_lag": _SAME,
    "train.checkpoint_replication_retry_s": _SAME,
    "train.checkpoint_replication_bandwidth_mb_s": _SAME,
    "train.checkpoint_prune_unreplicated": _SAME,
    "train.ema": _SAME,  # the shadows average the weights; they do not change how they train
    # ---- train: how the run is executed
    "train.device": _SAME,
    "train.ddp": _SAME,
    "train.find_unused_parameters": _SAME,
    "train.compile": _SAME,
    "train.cuda_prefetch": _SAME,
    "train.fsdp.enabled": _SAME,  # how FSDP places the same computation
    "train.fsdp.shard_modules": _SAME,
    "train.fsdp.reshard_after_forward": _SAME,
    "train.fsdp.cpu_offload": _SAME,
    "train.fsdp.hsdp": _SAME,  # shard within a node, replicate across: the same computation
    "train.fsdp.shard_size": _SAME,
    "train.evacuation_enabled": _SAME,
    "train.evacuation_signal": _SAME,
    "train.gpu_health_every": _SAME,
    "train.gpu_health_max_temperature_c": _SAME,
    "train.gpu_health_max_kernel_seconds": _SAME,
    "train.gpu_health_max_new_ecc_uncorrected": _SAME,
    "train.strict_config": _SAME,
    "train.config_warn_unknown": _SAME,
    "train.warn_unsharded": _SAME,
    "train.resume_allow_changes": _SAME,
    # ---- the other sections
    "model": _DIFF,  # free-form: the model's hyperparameters
    "data": _DIFF,  # free-form: what is read, in which order, in which batches
    "optim": _DIFF,
    "optim.optimizer.fused": _SAME,  # the same update, another kernel
    "optim.optimizer.foreach": _SAME,
    "logging": _SAME,
    "wandb": _SAME,
    "entry": _DIFF,  # the model, data, step, optimizer and hooks are the user's code
    "entry.eval_dataset": _SAME,
    "entry.eval_fn": _SAME,
}
_ABSENT = "<absent>"


@dataclass(frozen=True)
class ConfigChange:
    """One key whose value differs: ``old``/``new`` are ``"<absent>"`` where the key is missing."""

    key: str
    old: Any
    new: Any


@dataclass(frozen=True)
class ConfigDrift:
    """A resume's config changes, split into those that break the run and those that do not."""

    breaking: tuple[ConfigChange, ...]
    harmless: tuple[ConfigChange, ...]
    max_steps_extended: bool = False  # train.max_steps grew (or became null)


def resume_class(key: str) -> str | None:
    """The class of dotted ``key``: its own row's, else the row of the nearest section above
    it; None when no row covers it (`compare_configs` treats that as ``DIFFERENT_RUN``)."""
    path = key
    while True:
        if path in RESUME_CLASSES:
            return RESUME_CLASSES[path]
        if "." not in path:
            return None
        path = path.rpartition(".")[0]


def same_value(a: Any, b: Any) -> bool:
    """Whether a config value is unchanged: a float by its bits (``nan`` is ``nan``; ``0.0`` and
    ``-0.0`` differ), an int and the float of it alike (a YAML ``1`` and ``1.0``), lists element
    by element; everything else by ``==``."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    kinds = {type(a), type(b)}
    if float in kinds and kinds <= {int, float}:
        try:
            return struct.pack("<d", float(a)) == struct.pack("<d", float(b))
        except OverflowError:  # an int beyond any float: not the float it is compared with
            return False
    return bool(a == b)


def _allowed(key: str, patterns: Sequence[str]) -> bool:
    """``key`` is one of ``patterns``, under one of them (``optim.optimizer`` covers its keys),
    or a pattern is ``*``."""
    return any(key == p or key.startswith(p + ".") or p == "*" for p in patterns)


def schedule_follows_max_steps(config: Mapping[str, Any]) -> bool:
    """Whether the schedule's length is ``train.max_steps`` (a cosine with ``T_max: null``)."""
    scheduler = (config.get("optim") or {}).get("scheduler") or {}
    name = str(scheduler.get("name") or "none").lower()
    return name in ("cosine", "cosine_warmup") and scheduler.get("T_max") is None


def compare_configs(
    old: Mapping[str, Any], new: Mapping[str, Any], allow: Sequence[str] = ()
) -> ConfigDrift:
    """The changes from the checkpoint's config ``old`` to the resuming config ``new`` (plain
    nested dicts, each with the defaults filled in, so a key added by a newer Koochak does not
    count as a change), classified by `RESUME_CLASSES`; keys matching ``allow`` are harmless."""
    before, after = flat_config(old), flat_config(new)
    breaking, harmless, extended = [], [], False
    for key in sorted(set(before) | set(after)):
        was, now = before.get(key, _ABSENT), after.get(key, _ABSENT)
        if same_value(was, now):
            continue
        change = ConfigChange(key, was, now)
        same = resume_class(key) == SAME_RUN
        if key == "train.max_steps":
            longer = now is None or (isinstance(was, int) and isinstance(now, int) and now > was)
            extended = longer and was is not None
            same = longer or not schedule_follows_max_steps(new)
        (harmless if same or _allowed(key, allow) else breaking).append(change)
    return ConfigDrift(tuple(breaking), tuple(harmless), extended)


def format_change(change: ConfigChange) -> str:
    return f"{change.key}: {change.old!r} -> {change.new!r}"


def check_resume_config(
    old: Mapping[str, Any], new: Mapping[str, Any], allow: Sequence[str] = (), where: str = ""
) -> ConfigDrift:
    """`compare_configs`, raising ConfigError (one line) when a change breaks the run: the keys,
    old and new values, and the ``train.resume_allow_changes`` override that accepts them."""
    drift = compare_configs(old, new, allow)
    if drift.breaking:
        keys = [change.key for change in drift.breaking]
        from koochak.loop.config import ConfigError

        raise ConfigError(
            f"resume{f' from {where}' if where else ''}: the config changed in ways that make it "
            f"a different run (data order, batch geometry, model, optimizer or schedule): "
            f"{'; '.join(map(format_change, drift.breaking))}. Start a new run (--resume none, "
            f"or another train.out_dir), or accept the changes with "
            f"train.resume_allow_changes=[{','.join(keys)}]"
        )
    return drift


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)  # a tensor, or a sharded checkpoint's StoredTensor
    return None if shape is None else tuple(int(n) for n in shape)


def check_model_shapes(saved: Mapping[str, Any], live: Mapping[str, Any], where: str = "") -> None:
    """Refuse (ConfigError, one line) a checkpoint's model state ``saved`` that ``live`` (the
    model's own state dict, global shapes, ``module.`` prefixes already matched) cannot take:
    a parameter or buffer whose shape changed (both shapes named), or names one side lacks.

    No override exists for this: the weights of one shape cannot continue in another, so the
    message says to start a new run instead."""
    from koochak.loop.config import ConfigError

    prefix = f"resume{f' from {where}' if where else ''}: "
    fix = ("; a checkpoint cannot be resumed into a model of another architecture: start a new "
           "run (--resume none, or another train.out_dir), or restore the model config the "
           "checkpoint was trained with")  # fmt: skip
    changed = []
    for name, value in live.items():
        before, now = _shape(saved.get(name)), _shape(value)
        if name in saved and before is not None and now is not None and before != now:
            changed.append((name, before, now))
    if changed:
        name, before, now = changed[0]
        more = f" (and {len(changed) - 1} more parameter(s))" if len(changed) > 1 else ""
        raise ConfigError(
            f"{prefix}model parameter {name!r} has shape {list(before)} in the checkpoint but "
            f"{list(now)} in this model{more}{fix}"
        )
    missing = [name for name in live if name not in saved]
    extra = [name for name in saved if name not in live]
    if missing or extra:
        said = []
        for names, what in ((missing, "not in the checkpoint"), (extra, "not in this model")):
            if names:
                shown = ", ".join(map(repr, names[:3])) + (", ..." if len(names) > 3 else "")
                said.append(f"{len(names)} {what} ({shown})")
        raise ConfigError(f"{prefix}the model's parameters differ: {'; '.join(said)}{fix}")
