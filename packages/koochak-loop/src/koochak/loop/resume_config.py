"""Is the resumed run the same run? The checkpoint's config against the one resuming from it.

A resume continues a run: the same data order, batch geometry, optimizer and schedule. A config
that changed any of those (``data.batch_size``, ``train.grad_accum``, ``optim.optimizer.lr``,
``train.seed``, the model ...) would silently make a different run out of the checkpoint, so it is
refused, naming each key with its old and new value and the override that accepts them
(``train.resume_allow_changes``). Changes that only affect what is observed or how the run is
executed (logging cadence, sinks, device, retention, where files go, the EMA shadows, which
average the weights without changing how they train) are harmless: they are
reported once. Extending ``train.max_steps`` is harmless too, and a schedule whose horizon is
``train.max_steps`` continues from the checkpoint (see `koochak.loop.optim.build_scheduler`).

Everything not listed as harmless counts as breaking, including every key of the free-form
``data`` and ``model`` sections: fail closed.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HARMLESS",
    "ConfigChange",
    "ConfigDrift",
    "check_resume_config",
    "compare_configs",
    "format_change",
    "schedule_follows_max_steps",
]

# Keys (fnmatch patterns on the dotted path) whose change leaves the run the same run.
HARMLESS = (
    "train.log_every",
    "train.eval_every",
    "train.eval_at_step_zero",
    "train.ckpt_every",
    "train.keep_last_k",
    "train.keep_best_k",
    "train.keep_best_metric",
    "train.keep_best_mode",
    "train.progress_bar",
    "train.device",
    "train.out_dir",
    "train.checkpoint_dir",
    "train.compile",
    "train.cuda_prefetch",
    "train.checkpoint_async",
    "train.checkpoint_replica*",  # tiers: where copies go, not how the run trains
    "train.checkpoint_prune_unreplicated",
    "train.run_id",  # persistence: which run owns the tiers, not how it trains
    "train.evacuation_enabled",
    "train.evacuation_signal",
    "train.gpu_health_*",
    "train.nonfinite_grad_check_every",
    "train.strict_config",
    "train.config_warn_unknown",
    "train.warn_unsharded",
    "train.ddp",
    "train.find_unused_parameters",
    # How FSDP places the same computation (train.fsdp.mixed_precision changes the numerics:
    # it is not here, like train.amp).
    "train.fsdp.enabled",
    "train.fsdp.shard_modules",
    "train.fsdp.reshard_after_forward",
    "train.fsdp.cpu_offload",
    "train.shard_eval_dataset",
    "train.shard_eval_dataset_mode",
    "train.reduce_metrics",
    "train.reduce_metrics_exclude",
    "train.resume_allow_changes",
    "train.ema",  # shadows average the weights; they do not change how the weights train
    "optim.optimizer.fused",
    "optim.optimizer.foreach",
    "logging.*",
    "wandb.*",
    "entry.eval_dataset",
    "entry.eval_fn",
)
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


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, Mapping):  # an empty section holds no key
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif prefix:
        out[prefix] = list(value) if isinstance(value, tuple) else value
    return out


def _matches(key: str, patterns: Sequence[str]) -> bool:
    """``key`` is one of ``patterns``, under one of them (``optim.optimizer`` covers its keys;
    ``*`` covers everything), or fnmatches one."""
    return any(
        key == p or key.startswith(p + ".") or p == "*" or fnmatch.fnmatchcase(key, p)
        for p in patterns
    )


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
    count as a change). Keys matching ``allow`` and `HARMLESS` are harmless; so is a growing
    ``train.max_steps``; a shrinking one is breaking only when the schedule's horizon is it."""
    before, after = _flatten(old, "", {}), _flatten(new, "", {})
    breaking, harmless, extended = [], [], False
    for key in sorted(set(before) | set(after)):
        was, now = before.get(key, _ABSENT), after.get(key, _ABSENT)
        if was == now:
            continue
        change = ConfigChange(key, was, now)
        if key == "train.max_steps":
            longer = now is None or (isinstance(was, int) and isinstance(now, int) and now > was)
            extended = longer and was is not None
            if longer or not schedule_follows_max_steps(new) or _matches(key, allow):
                harmless.append(change)
                continue
        if _matches(key, HARMLESS) or _matches(key, allow):
            harmless.append(change)
        else:
            breaking.append(change)
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
