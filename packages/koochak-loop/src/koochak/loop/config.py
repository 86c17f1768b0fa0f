"""Configuration: structured dataclass defaults <- YAML file <- CLI dotlist overrides.

The dataclasses below are the single source of truth for every supported key and its default
(``examples/config_template.yaml`` mirrors them and a test keeps the two in sync). Configs are
OmegaConf objects, so ``${train.out_dir}/log.csv``-style interpolation works across sections.

Strict by default: an unknown key anywhere (except the free-form ``data`` and ``model`` sections) fails before
training with its full path and a did-you-mean. ``train.strict_config: false`` relaxes that to a
warning (``train.config_warn_unknown``) and keeps the unknown keys. Type and value errors name the
key, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
import types
import typing
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from koochak.storage.strict_yaml import load_yaml_file
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config problem, with the file and key path in the message."""


@dataclass(frozen=True)
class EmaDualConfig:
    enabled: bool = False  # track two power-profile shadows (EDM2 post-hoc EMA)
    gamma1: Optional[float] = None  # first shadow's power exponent (or srel1)
    gamma2: Optional[float] = None
    srel1: Optional[float] = None  # first shadow's relative width, e.g. 0.05 (or gamma1)
    srel2: Optional[float] = None


@dataclass(frozen=True)
class EmaConfig:
    enabled: Optional[bool] = None  # null: on when decay, profile, gamma/srel or dual is given
    decay: Optional[float] = None  # constant profile's decay per model step; null: 0.999
    decay_init: float = 0.0  # decay at step 0 when warming up
    warmup_steps: int = 0  # model steps from decay_init to decay (schedule linear|cosine)
    schedule: str = "constant"  # constant | linear | cosine
    profile: Optional[str] = None  # constant | power; null: power with gamma/srel/dual
    gamma: Optional[float] = None  # power profile exponent (or srel)
    srel: Optional[float] = None  # power profile's relative width (or gamma)
    offload_to_cpu: bool = False  # keep shadows in host memory
    pin_memory: bool = True  # pinned host memory for offloaded shadows (CUDA)
    update_every: int = 1  # EMA update every k model steps (decay ** k)
    compensate_update_every: bool = True  # kept for compatibility: always compensated
    eval_with_ema: bool = False  # run eval_fn with the (first) shadow's weights
    dual: EmaDualConfig = field(default_factory=EmaDualConfig)


@dataclass(frozen=True)
class FsdpConfig:
    enabled: bool = False  # shard parameters, gradients and optimizer state (FSDP2 fully_shard)
    # Module class names that get their own fully_shard (the root always does); the Python API
    # also takes a callable (module) -> bool.
    shard_modules: Any = field(default_factory=list)
    mixed_precision: str = (
        "none"  # none | bf16 | fp16: parameters in forward/backward and grad reduction
    )
    reshard_after_forward: bool = (
        True  # free gathered parameters after forward (gather again in backward)
    )
    cpu_offload: bool = (
        False  # keep sharded parameters, gradients and optimizer state in host memory
    )
    # HSDP: shard within groups of shard_size ranks, replicate across them (a 2-D mesh)
    hsdp: bool = False
    shard_size: Optional[int] = None  # ranks per shard group; null: ranks per node


@dataclass(frozen=True)
class TrainConfig:
    max_steps: Optional[int] = 1000  # null: run until the dataset is exhausted
    log_every: int = 50
    eval_every: Optional[int] = None  # null or 0: no periodic eval
    eval_at_step_zero: bool = False
    ckpt_every: Optional[int] = None  # null or 0: only the terminal checkpoint
    keep_last_k: Optional[int] = 3  # null: keep every checkpoint
    grad_accum: int = 1
    amp: str = "none"  # none | bf16 | fp16
    grad_clip: Optional[float] = None  # max L2 norm; null: no clipping
    nonfinite_grad_check_every: Optional[int] = None
    scheduler_step: str = "update"  # update | eval
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    out_dir: str = "runs/default"
    checkpoint_dir: Optional[str] = None  # null: out_dir
    ddp: bool = False
    find_unused_parameters: bool = False
    compile: bool = False
    init_from: Optional[str] = None  # export, checkpoint file or checkpoint location: weights only
    init_from_ema: bool = False  # init_from takes the (first) EMA shadow's weights instead
    cuda_prefetch: bool = False
    progress_bar: bool = True
    strict_config: bool = True
    config_warn_unknown: bool = True
    shard_dataset: bool = False
    shard_dataset_mode: str = "iterable"  # iterable | map
    shard_eval_dataset: bool = False
    shard_eval_dataset_mode: str = "iterable"
    warn_unsharded: bool = True
    checkpoint_async: bool = False
    checkpoint_parts: Union[int, str] = 1  # 1: one file; N >= 2 or auto: N parts in parallel
    # Durable tiers behind checkpoint_dir (docs/checkpoints.md, "Tiers"): locations, or mappings
    # {location, keep_last_k}; each checkpoint is copied there in the background once it commits.
    checkpoint_replicas: list[Any] = field(default_factory=list)
    checkpoint_replication_max_lag: int = 2  # checkpoints a replica may trail before saves wait
    checkpoint_replication_retry_s: float = 10.0  # first retry after a failed copy (doubles)
    # Each replica tier's copies paced to this many MB/s (null: as fast as the stores go)
    checkpoint_replication_bandwidth_mb_s: Optional[float] = None
    checkpoint_prune_unreplicated: bool = False  # prune the first tier before a replica holds it
    # The run's stable id, kept in every checkpoint and in each tier's marker (docs/formats.md,
    # "Tier marker"): a tier marked by another run is refused. null: the first tier's marker's
    # (a retry), else derived from out_dir's absolute path. A persistence key: same run.
    run_id: Optional[str] = None
    evacuation_enabled: bool = False
    evacuation_signal: str = "USR1"
    gpu_health_every: Optional[int] = None  # CUDA only; null or 0: no GPU health checks
    gpu_health_max_temperature_c: float = 90.0
    gpu_health_max_kernel_seconds: float = 10.0
    gpu_health_max_new_ecc_uncorrected: int = 0
    keep_best_k: Optional[int] = None  # also keep the k best checkpoints by keep_best_metric
    keep_best_metric: Optional[str] = None  # e.g. eval_loss (a checkpoint's metrics)
    keep_best_mode: str = "min"  # min | max: which direction is better
    reduce_metrics: bool = True  # under DDP: log each scalar's mean over ranks, not rank 0's
    reduce_metrics_exclude: list[str] = field(default_factory=list)  # metrics logged as rank 0's
    resume_allow_changes: list[str] = field(default_factory=list)  # config keys a resume may change
    # Throughput in the logged rows (docs/logging.md, "Throughput"): tokens in one sample (null:
    # a step's "tokens" output, else no tokens/s) and the training FLOPs of one update on one rank
    # (null: measured once with torch's FLOP counter, forward x 3).
    tokens_per_sample: Optional[int] = None
    flops_per_step: Optional[float] = None
    ema: EmaConfig = field(default_factory=EmaConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)


@dataclass(frozen=True)
class ModelConfig:
    """Free-form: the model's hyperparameters, read by the entry.model factory (cfg.model)."""


@dataclass(frozen=True)
class DataConfig:
    data_dir: str = "data"
    batch_size: int = 64
    num_workers: int = 0


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 0.001
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-08
    momentum: float = 0.0
    nesterov: bool = False
    fused: Optional[bool] = None  # null: torch's choice
    foreach: Optional[bool] = None  # null: torch's choice
    param_groups: list[Any] = field(default_factory=list)  # rules: select parameters, set options


@dataclass(frozen=True)
class SchedulerConfig:
    name: str = "none"  # none | cosine | step | plateau | cosine_warmup
    warmup_steps: int = 0
    T_max: Optional[int] = None  # null: train.max_steps
    eta_min: float = 0.0
    step_size: int = 1000
    gamma: float = 0.1
    factor: float = 0.1
    patience: int = 10
    mode: str = "min"
    monitor: str = "eval_loss"


@dataclass(frozen=True)
class OptimConfig:
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass(frozen=True)
class LoggingConfig:
    stdout: bool = True
    csv_path: Optional[str] = None  # null: <out_dir>/log.csv in the CLI
    jsonl_path: Optional[str] = None  # null: <out_dir>/log.jsonl in the CLI
    print_config: bool = False  # print the whole resolved config at start (else a summary)
    tensorboard: bool = False  # TensorBoard event files (extra: koochak-loop[tensorboard])
    tensorboard_dir: Optional[str] = None  # null: <out_dir>/tensorboard
    level: str = "INFO"  # koochak-train: Koochak's own log lines on stderr (rank 0) from this level


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = False
    project: Optional[str] = None
    entity: Optional[str] = None
    name: Optional[str] = None
    id: Optional[str] = None
    resume: Optional[str] = None
    mode: str = "online"  # online | offline | disabled
    dir: Optional[str] = None
    artifact_name_prefix: str = "model"
    artifact_type: str = "model"
    log_checkpoints: bool = True
    upload_checkpoints: bool = False  # copy checkpoint files into W&B (default: reference them)
    tags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class EntryConfig:
    model: Optional[str] = None  # module:callable returning an nn.Module
    dataset: Optional[str] = None  # module:callable returning an iterable
    step: Optional[str] = None  # module:callable, step_fn(model, batch, ctx) -> dict
    update: Optional[str] = None  # module:callable, update_fn(batches, model, optimizer, ctx)
    state: Optional[str] = None  # module:callable, fn(model, cfg) -> {name: stateful object}
    eval_dataset: Optional[str] = None
    eval_fn: Optional[str] = None
    optimizer: Optional[str] = None  # module:callable, fn(model, cfg) -> Optimizer
    hooks: Optional[str] = None  # module:callable, fn(cfg) -> hooks dict (early stopping, ...)


@dataclass(frozen=True)
class Config:
    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    entry: EntryConfig = field(default_factory=EntryConfig)


SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
# train.ema: the shadows' averaging profiles, the constant profile's warm-up schedules, and the
# widest power profile's relative width (gamma = 0, a uniform average: 1/sqrt(12)).
EMA_PROFILES = ("constant", "power")
EMA_SCHEDULES = ("constant", "linear", "cosine")
EMA_SREL_MAX = 1.0 / math.sqrt(12.0)
# Sections whose extra keys are the user's own (dataset builders read them).
_FREE_FORM = frozenset({"data", "model"})
_CHOICES = {
    "train.amp": ("none", "bf16", "fp16"),
    "train.scheduler_step": ("update", "eval"),
    "train.shard_dataset_mode": ("iterable", "map"),
    "train.shard_eval_dataset_mode": ("iterable", "map"),
    "train.fsdp.mixed_precision": ("none", "bf16", "fp16"),
    "wandb.mode": ("online", "offline", "disabled"),
    "train.keep_best_mode": ("min", "max"),
    "optim.scheduler.name": ("none", "cosine", "step", "plateau", "cosine_warmup"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR"),
}
# Accepted values of train.device (device.get_device resolves them).
DEVICE_PATTERN = r"auto|cpu|cuda|cuda:\d+|mps"
DEVICE_CHOICES = "auto|cpu|cuda|cuda:N|mps"
_POSITIVE = (
    "train.log_every",
    "train.grad_accum",
    "train.checkpoint_replication_max_lag",
    "train.ema.update_every",
    "data.batch_size",
)
_POSITIVE_OR_NULL = ("train.max_steps", "train.tokens_per_sample", "train.fsdp.shard_size")
_NON_NEGATIVE_OR_NULL = (
    "train.eval_every",
    "train.ckpt_every",
    "train.keep_last_k",
    "train.nonfinite_grad_check_every",
    "train.gpu_health_every",
    "train.keep_best_k",
    "train.gpu_health_max_new_ecc_uncorrected",
    "train.ema.warmup_steps",
    "data.num_workers",
)
# Legacy flat names of train.ema.* keys, honoured with a note: train.ema_<key> and train.ema_eval.
_LEGACY_EMA = {f"ema_{f.name}": f.name for f in dataclasses.fields(EmaConfig) if f.name != "dual"}
_LEGACY_EMA["ema_eval"] = "eval_with_ema"


# ----------------------------------------------------------------------------- unknown keys


def _dataclass_type(tp: Any) -> type | None:
    return tp if dataclasses.is_dataclass(tp) else None


def _unknown_keys(values: Mapping[str, Any], schema: type, prefix: str = "") -> list[str]:
    """Full dotted paths of keys in ``values`` that ``schema`` does not define."""
    hints = typing.get_type_hints(schema)
    unknown = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if key not in hints:
            if prefix.rstrip(".") not in _FREE_FORM:
                unknown.append(path)
            continue
        sub = _dataclass_type(hints[key])
        if sub is not None and isinstance(value, Mapping):
            unknown.extend(_unknown_keys(value, sub, path + "."))
    return unknown


def _known_paths(schema: type, prefix: str = "") -> list[str]:
    paths = []
    for name, tp in typing.get_type_hints(schema).items():
        sub = _dataclass_type(tp)
        if sub is not None:
            paths.extend(_known_paths(sub, f"{prefix}{name}."))
        else:
            paths.append(f"{prefix}{name}")
    return paths


def _did_you_mean(path: str, schema: type) -> str:
    known = _known_paths(schema)
    # Sections too, so a misspelt one ('trian') finds 'train' rather than nothing.
    known += sorted({p.rsplit(".", i)[0] for p in known for i in range(1, p.count(".") + 1)})
    close = difflib.get_close_matches(path, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_message(unknown: Sequence[str], schema: type, source: str) -> str:
    parts = [f"{path!r}{_did_you_mean(path, schema)}" for path in unknown]
    return f"{source}: unknown config key {', '.join(parts)}"


# ----------------------------------------------------------------------------- value checks


def _is_optional(tp: Any) -> bool:
    args = typing.get_args(tp)
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in args


def _base_type(tp: Any) -> Any:
    if _is_optional(tp):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _check_type(path: str, value: Any, tp: Any) -> Any:
    """Return ``value`` if it fits ``tp`` (ints accepted for floats), else raise ConfigError."""
    if value is None:
        if _is_optional(tp):
            return None
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got null")
    base = _base_type(tp)
    origin = typing.get_origin(base)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(base) or (Any,)
        return [_check_type(f"{path}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if base is Any:
        return value
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, base)
    if not ok:
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    return value


def _type_name(tp: Any) -> str:
    base = _base_type(tp)
    if typing.get_origin(base) in (Union, types.UnionType):  # e.g. train.checkpoint_parts
        name = " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(base))
    else:
        name = getattr(base, "__name__", str(base))
    return f"{name} or null" if _is_optional(tp) else name


def _check_values(values: Mapping[str, Any], section: str) -> None:
    """Choices and ranges for the keys of ``section`` present in ``values``."""
    for path, choices in _CHOICES.items():
        head, _, key = path.rpartition(".")
        if head == section and key in values and values[key] not in choices:
            raise ConfigError(f"{path}: expected one of {'|'.join(choices)}, got {values[key]!r}")
    for group, lowest, nullable in (
        (_POSITIVE, 1, False),
        (_POSITIVE_OR_NULL, 1, True),
        (_NON_NEGATIVE_OR_NULL, 0, True),
    ):
        for path in group:
            head, _, key = path.rpartition(".")
            if head != section or key not in values:
                continue
            value = values[key]
            if value is None and nullable:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                what = f"an integer >= {lowest}" + (" or null" if nullable else "")
                raise ConfigError(f"{path}: expected {what}, got {value!r}")
    device = values.get("device") if section == "train" else None
    if isinstance(device, str) and not re.fullmatch(DEVICE_PATTERN, device):
        raise ConfigError(f"train.device: expected one of {DEVICE_CHOICES}, got {device!r}")
    flops = values.get("flops_per_step") if section == "train" else None
    if flops is not None and (isinstance(flops, bool) or not flops > 0):
        raise ConfigError(
            f"train.flops_per_step: expected a positive number or null, got {flops!r}"
        )
    for key in ("gpu_health_max_temperature_c", "gpu_health_max_kernel_seconds"):
        if section == "train" and key in values and values[key] <= 0:
            raise ConfigError(f"train.{key}: expected a positive number, got {values[key]!r}")
    parts = values.get("checkpoint_parts", 1) if section == "train" else 1
    if parts != "auto" and (type(parts) is not int or parts < 1):
        raise ConfigError(
            f"train.checkpoint_parts: expected an integer >= 1 (1 = one file) or 'auto', "
            f"got {parts!r}"
        )
    if section == "train" and values.get("checkpoint_replication_retry_s", 0) < 0:
        raise ConfigError(
            "train.checkpoint_replication_retry_s: expected a number >= 0, got "
            f"{values['checkpoint_replication_retry_s']!r}"
        )
    bandwidth = values.get("checkpoint_replication_bandwidth_mb_s") if section == "train" else None
    if bandwidth is not None and (isinstance(bandwidth, bool) or not bandwidth > 0):
        raise ConfigError(
            "train.checkpoint_replication_bandwidth_mb_s: expected a positive number of MB/s or "
            f"null (unlimited), got {bandwidth!r}"
        )
    if section == "train" and "checkpoint_replicas" in values:
        check_replicas(values["checkpoint_replicas"])
    if section == "train" and values.get("grad_clip") is not None and values["grad_clip"] <= 0:
        raise ConfigError(
            f"train.grad_clip: expected a positive number or null, got {values['grad_clip']!r}"
        )
    if section in ("train.ema", "train.ema.dual"):
        _check_ema(values, section)
    if section == "train.fsdp" and "shard_modules" in values:
        _check_shard_modules(values["shard_modules"])
    if section == "train.fsdp" and values.get("shard_size") is not None and not values.get("hsdp"):
        raise ConfigError(
            "train.fsdp.shard_size: set only with train.fsdp.hsdp: true (the shard group of a "
            "1-D FSDP is every rank)"
        )
    fsdp = values.get("fsdp") if section == "train" else None
    if isinstance(fsdp, Mapping) and fsdp.get("enabled") and values.get("ddp"):
        raise ConfigError(
            "train.fsdp.enabled and train.ddp are both true: FSDP already keeps the ranks' "
            "gradients in step; set train.ddp: false"
        )
    if section == "train":
        _check_node_local(values)
        _check_tier_paths(values)
    if section == "optim.optimizer" and values.get("param_groups"):
        _check_param_groups(values)
    if section == "train" and values.get("keep_best_k") and not values.get("keep_best_metric"):
        raise ConfigError(
            f"train.keep_best_k={values['keep_best_k']!r} needs train.keep_best_metric, the "
            "metric that ranks checkpoints (e.g. eval_loss, with keep_best_mode: min)"
        )


def _check_tier_paths(values: Mapping[str, Any]) -> None:
    """No replica may be the first tier, another replica, or a directory inside or above one
    of them, by real path (a symlink, ``<dir>/.``): its retention would prune the other's
    checkpoints. Aliases paths cannot show (two mounts of one bucket) are the tier markers'."""
    replicas = values.get("checkpoint_replicas") or ()
    if not replicas or not isinstance(replicas, (list, tuple)):
        return
    first = values.get("checkpoint_dir") or values.get("out_dir") or "runs/default"
    first_key = "train.checkpoint_dir" if values.get("checkpoint_dir") else "train.out_dir"
    named = [(first_key, first)]
    for i, replica in enumerate(replicas):
        location = replica.get("location") if isinstance(replica, Mapping) else replica
        named.append((f"train.checkpoint_replicas[{i}]", location))
    seen: list[tuple[str, str, str]] = []
    for key, location in named:
        real = _real_directory(location)
        if real is None:
            continue
        for other_key, other, other_real in seen:
            if os.path.commonpath([real, other_real]) in (real, other_real):
                how = ("is" if real == other_real else
                       "is inside" if other_real == os.path.commonpath([real, other_real])
                       else "holds")  # fmt: skip
                raise ConfigError(
                    f"{key}: {location!r} {how} {other_key} ({other!r}; both resolve to "
                    f"{real if real == other_real else real + ' and ' + other_real}); a replica "
                    "must be a storage of its own, or its retention prunes the other's checkpoints"
                )
        seen.append((key, str(location), real))


def _real_directory(location: Any) -> str | None:
    """The real path of a directory location (symlinks, ``.``, ``..`` resolved; ``{node}`` as
    node 0); None for a URI."""
    if not isinstance(location, str) or not location.strip():
        return None
    if "://" in location and not location.startswith("file://"):
        return None
    path = location.removeprefix("file://").replace("{node}", "0")
    return os.path.realpath(os.path.expanduser(path))


def _check_node_local(values: Mapping[str, Any]) -> None:
    """``{node}`` (one directory per node) only in ``train.checkpoint_dir``, and only with a
    durable tier behind it: the nodes' directories together hold a checkpoint, none alone."""
    where = values.get("checkpoint_dir")
    if isinstance(where, str) and re.search(r"\{(?!node\})[^}]*\}", where):
        raise ConfigError(
            f"train.checkpoint_dir: {where!r}: the only placeholder is {{node}} (the node's index)"
        )
    if isinstance(where, str) and "{node}" in where and not values.get("checkpoint_replicas"):
        raise ConfigError(
            f"train.checkpoint_dir: {where!r} is node-local ({{node}}) but "
            "train.checkpoint_replicas is empty; add a durable tier every node reaches"
        )
    for i, replica in enumerate(values.get("checkpoint_replicas") or ()):
        location = replica.get("location") if isinstance(replica, Mapping) else replica
        if isinstance(location, str) and "{node}" in location:
            raise ConfigError(
                f"train.checkpoint_replicas[{i}]: {location!r}: {{node}} is for the first tier "
                "(train.checkpoint_dir) only; a replica is shared by every node"
            )


def _check_shard_modules(value: Any) -> None:
    """``train.fsdp.shard_modules``: class names (a list of str), or in Python a callable."""
    if callable(value):
        return
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(
            "train.fsdp.shard_modules: expected a list of module class names (e.g. [Block]) or, "
            f"from Python, a callable (module) -> bool; got {value!r}"
        )


def _check_param_groups(values: Mapping[str, Any]) -> None:
    """The parameter-group rules, as build_optimizer will read them (before anything is built)."""
    from koochak.loop.optim import OPTIMIZERS, group_options
    from koochak.loop.param_groups import check_rules

    name = str(values.get("name") or "adamw").lower()
    if name not in OPTIMIZERS:
        return  # the optimizer builder names the bad name
    try:
        check_rules(values["param_groups"], group_options(name), "optim.optimizer.param_groups")
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class ReplicaConfig:
    """One entry of ``train.checkpoint_replicas``: where, and how many checkpoints it keeps
    (``keep_last_k`` None: as many as the first tier, ``train.keep_last_k``; 0: every one)."""

    location: str
    keep_last_k: Optional[int] = None
    create: bool = False  # a directory whose parent does not exist is created, not refused


def check_replicas(replicas: Any) -> tuple[ReplicaConfig, ...]:
    """``train.checkpoint_replicas`` as ReplicaConfig records; ConfigError naming the entry.

    Each entry is a location (a directory or ``scheme://`` URI) or a mapping with ``location``
    and optionally ``keep_last_k`` (an integer >= 0, or null for every checkpoint) and
    ``create`` (true: a directory whose parent does not exist is created; else refused at start).
    """
    where = "train.checkpoint_replicas"
    if replicas is None:
        return ()
    if isinstance(replicas, (str, Mapping)) or not isinstance(replicas, Sequence):
        raise ConfigError(f"{where}: expected a list of locations, got {replicas!r}")
    found: list[ReplicaConfig] = []
    for i, entry in enumerate(replicas):
        if isinstance(entry, str):
            entry = {"location": entry}
        if not isinstance(entry, Mapping):
            raise ConfigError(
                f"{where}[{i}]: expected a location or a mapping {{location, keep_last_k}}, "
                f"got {entry!r}"
            )
        unknown = sorted(str(k) for k in entry if k not in ("location", "keep_last_k", "create"))
        if unknown:
            raise ConfigError(
                f"{where}[{i}]: unknown key(s) {unknown}; expected location, keep_last_k, create"
            )
        create = entry.get("create", False)
        if not isinstance(create, bool):
            raise ConfigError(f"{where}[{i}].create: expected true or false, got {create!r}")
        location = entry.get("location")
        if not isinstance(location, str) or not location.strip():
            raise ConfigError(
                f"{where}[{i}].location: expected a directory or scheme:// URI, got {location!r}"
            )
        if "keep_last_k" not in entry:  # as many as the first tier
            found.append(ReplicaConfig(location, create=create))
            continue
        keep = entry["keep_last_k"]
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 0):
            raise ConfigError(
                f"{where}[{i}].keep_last_k: expected an integer >= 0 or null, got {keep!r}"
            )
        found.append(ReplicaConfig(location, keep or 0, create))  # null or 0: every checkpoint
    locations = [r.location.rstrip("/") for r in found]
    for i, location in enumerate(locations):
        if location in locations[:i]:
            raise ConfigError(f"{where}[{i}]: {location!r} is listed twice")
    return tuple(found)


def _check_ema(values: Mapping[str, Any], section: str) -> None:
    """Ranges of the EMA keys, then the combination (profile, gamma/srel, dual) as a whole."""

    def bad(key: str, what: str) -> ConfigError:
        return ConfigError(f"{section}.{key}: expected {what}, got {values[key]!r}")

    for key, choices in (("schedule", EMA_SCHEDULES), ("profile", EMA_PROFILES)):
        if values.get(key) is not None and values[key] not in choices:
            raise bad(key, f"one of {'|'.join(choices)}")
    for key in ("decay", "decay_init"):
        if values.get(key) is not None and not 0 <= values[key] < 1:
            raise bad(key, "a number in [0, 1)")
    for key in ("gamma", "gamma1", "gamma2"):
        if values.get(key) is not None and not values[key] >= 0:
            raise bad(key, "a number >= 0")
    for key in ("srel", "srel1", "srel2"):
        if values.get(key) is not None and not 0 < values[key] <= EMA_SREL_MAX:
            raise bad(key, f"a number in (0, {EMA_SREL_MAX:.4f}]")
    if section == "train.ema":
        ema_profile(_build(EmaConfig, _known_only(values, EmaConfig)))


def ema_enabled(ema: EmaConfig) -> bool:
    """``enabled`` when set; otherwise on as soon as a decay, profile, gamma/srel or dual is given."""
    if ema.enabled is not None:
        return ema.enabled
    implied = (ema.decay, ema.profile, ema.gamma, ema.srel)
    return any(value is not None for value in implied) or ema.dual.enabled


def ema_has_primary(ema: EmaConfig) -> bool:
    """Whether ``train.ema`` asks for a primary shadow: always without dual EMA; beside the dual
    power shadows when it also gives ``decay``, ``gamma``/``srel`` or ``profile: constant``
    (upstream's ``ema`` next to ``ema_dual``: evaluate with one average, keep post-hoc snapshots)."""
    if not ema.dual.enabled:
        return True
    return (
        ema.decay is not None
        or ema.gamma is not None
        or ema.srel is not None
        or ema.profile == "constant"
    )


def ema_profile(ema: EmaConfig) -> str | None:
    """The one rule for which ``train.ema`` combinations are accepted: returns the profile of the
    primary shadow (``constant`` or ``power``; ``power`` for dual shadows alone), None when EMA
    is off; a refused combination is a ConfigError naming the key and the fix.

    - A warm-up needs a ``linear`` or ``cosine`` schedule (unless the profile is set to power,
      whose own message follows), whether EMA is on or not.
    - The primary's profile defaults to power when ``gamma``/``srel`` is given (or, without a
      primary, for the dual shadows), else constant.
    - Only the constant profile has a ``decay`` and a warm-up; only the power profile uses
      ``gamma``/``srel``, exactly one of the two.
    - Dual EMA adds two power shadows (``dual.gamma1|srel1`` and ``dual.gamma2|srel2``, exactly
      one of each pair), after the primary when there is one (see `ema_has_primary`).
    """
    if ema.warmup_steps and ema.schedule == "constant" and ema.profile != "power":
        raise ConfigError(
            "train.ema.warmup_steps: a warm-up needs train.ema.schedule linear or cosine "
            f"(schedule is constant), got warmup_steps={ema.warmup_steps!r}"
        )
    if not ema_enabled(ema):
        return None
    power_keys = [key for key in ("gamma", "srel") if getattr(ema, key) is not None]
    if ema.dual.enabled:
        for i in (1, 2):
            _one_of(ema.dual, f"gamma{i}", f"srel{i}", "train.ema.dual")
        if not ema_has_primary(ema):
            if ema.warmup_steps:
                raise ConfigError("train.ema.warmup_steps: only a constant primary shadow warms "
                                  "up; give train.ema.decay for one, or drop the warm-up")  # fmt: skip
            return "power"
    profile = ema.profile or ("power" if power_keys else "constant")
    if profile == "power" and ema.decay is not None:
        raise ConfigError("train.ema.decay: only the constant profile has a decay (profile is "
                          "power; its averaging length is gamma or srel)")  # fmt: skip
    if profile == "power" and ema.warmup_steps:
        raise ConfigError("train.ema.warmup_steps: only the constant profile warms up (the power "
                          "profile needs no warm-up)")  # fmt: skip
    if profile == "power":
        _one_of(ema, "gamma", "srel", "train.ema")
    elif power_keys:
        raise ConfigError(f"train.ema.{power_keys[0]}: only the power profile uses gamma/srel; "
                          "set train.ema.profile: power (profile is constant)")  # fmt: skip
    return profile


def _one_of(section: Any, gamma_key: str, srel_key: str, where: str) -> None:
    gamma, srel = getattr(section, gamma_key), getattr(section, srel_key)
    if (gamma is None) == (srel is None):
        raise ConfigError(
            f"{where}: a power EMA needs exactly one of {where}.{gamma_key} or "
            f"{where}.{srel_key} (got {gamma_key}={gamma!r}, {srel_key}={srel!r})"
        )


def _translate_legacy_ema(train: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Move legacy flat ``train.ema_*`` keys under ``train.ema``, with a note naming each."""
    train = dict(train)
    legacy = [key for key in train if key in _LEGACY_EMA]
    if not legacy:
        return train
    nested = dict(train.get("ema") or {})
    for key in legacy:
        name, value = _LEGACY_EMA[key], train.pop(key)
        if name in nested and nested[name] != value:
            raise ConfigError(
                f"{source}: train.{key}={value!r} (legacy) and train.ema.{name}="
                f"{nested[name]!r} disagree; keep only train.ema.{name}"
            )
        nested[name] = value
        warnings.warn(f"{source}: train.{key} is the legacy name of train.ema.{name}; it is "
                      "honoured, but use the nested key", UserWarning, stacklevel=3)  # fmt: skip
    train["ema"] = nested
    return train


def _check_section(values: Mapping[str, Any], schema: type, section: str) -> dict[str, Any]:
    """Type-check the known keys of one section (recursing into nested dataclasses)."""
    hints = typing.get_type_hints(schema)
    checked: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{section}.{key}"
        if key not in hints:
            checked[key] = value
            continue
        sub = _dataclass_type(hints[key])
        if sub is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{path}: expected a mapping, got {value!r}")
            checked[key] = _check_section(value, sub, path)
        else:
            checked[key] = _check_type(path, value, hints[key])
    _check_values(checked, section)
    return checked


# ----------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class ConfigReport:
    """What the startup summary prints: sections present, unknown keys, strictness."""

    source: str
    sections: tuple[str, ...]
    unknown_keys: tuple[str, ...]
    strict: bool


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The YAML file as a dict, read through the shared strict reader (duplicate keys, non-text
    files, oversized files and alias bombs refused); every failure a one-line ConfigError."""
    where = os.fspath(path)
    try:
        data = load_yaml_file(path)
    except FileNotFoundError:
        raise ConfigError(f"{where}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{where}: is a directory, not a config file") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read the config file ({exc.strerror or exc})") from None
    except ValueError as exc:  # strict_yaml's messages already start with the file name
        raise ConfigError(str(exc)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: top level must be a mapping of sections, got {type(data).__name__}"
        )
    return data


def _create(data: Mapping[str, Any], source: str) -> DictConfig:
    """OmegaConf node for user data; values OmegaConf cannot hold (a YAML date, an int key deep
    inside) are a ConfigError naming the file and key."""
    try:
        return OmegaConf.create(dict(data))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: {_omegaconf_message(exc)}") from None


def _omegaconf_message(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"at {key!r}: {first_line}" if key else first_line


def _parse_overrides(overrides: Iterable[str]) -> DictConfig:
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.max_steps=100")
    try:
        return OmegaConf.from_dotlist(overrides)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"overrides {overrides}: {exc}") from None


def _strictness(user: Mapping[str, Any]) -> tuple[bool, bool]:
    train = user.get("train") if isinstance(user.get("train"), Mapping) else {}
    strict = train.get("strict_config", True)
    warn = train.get("config_warn_unknown", True)
    for key, value in (("strict_config", strict), ("config_warn_unknown", warn)):
        if not isinstance(value, bool):
            raise ConfigError(f"train.{key}: expected bool, got {value!r}")
    return strict, warn


def _rank() -> int:
    """This process's DDP rank: the initialised process group's, else torchrun's RANK, else 0.
    (torch is not imported for this: a group can only exist once it has been.)"""
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        return int(torch_dist.get_rank())
    try:
        return int(os.environ.get("RANK") or 0)
    except ValueError:
        return 0


def _resolve(cfg: DictConfig, source: str) -> dict[str, Any]:
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        where = f" at {key!r}" if key else ""
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{source}: cannot resolve interpolation{where}: {first_line}") from None
    assert isinstance(resolved, dict)
    return resolved


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] = (),
    *,
    base: Mapping[str, Any] | None = None,
) -> DictConfig:
    """Load defaults <- YAML ``path`` (optional) <- ``base`` mapping (optional) <- dotlist ``overrides``.

    Raises ConfigError before any training when a key is unknown (strict mode), a value has the
    wrong type or is out of range, or an interpolation cannot resolve. In relaxed mode unknown
    keys are kept and, with ``train.config_warn_unknown``, reported with a warning.
    """
    return load_config_with_report(path, overrides, base=base)[0]


def load_config_with_report(
    path: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] = (),
    *,
    base: Mapping[str, Any] | None = None,
) -> tuple[DictConfig, ConfigReport]:
    """`load_config` plus the startup summary's facts (sections the user wrote, unknown keys)."""
    source = os.fspath(path) if path is not None else "<config>"
    user = _create(_read_yaml(path) if path is not None else {}, source)
    try:
        if base is not None:
            user = OmegaConf.merge(user, _create(base, "base"))
        user = OmegaConf.merge(user, _parse_overrides(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: cannot apply overrides: {_omegaconf_message(exc)}") from None
    user = _without_legacy_ema(user, source)
    for section in SECTIONS:
        value = user._get_node(section) if section in user else None
        if value is not None and not isinstance(value, DictConfig) and user[section] is not None:
            raise ConfigError(
                f"{source}: section {section!r} must be a mapping, got {user[section]!r}"
            )
    # Defaults go in as plain (untyped) data so that interpolations resolve across the merged
    # whole and every type error comes from _check_section, naming the key and value.
    try:
        cfg = OmegaConf.merge(OmegaConf.create(defaults()), user)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: {_omegaconf_message(exc)}") from None
    assert isinstance(cfg, DictConfig)
    values = _resolve(cfg, source)
    strict, warn = _strictness(values)
    unknown = _unknown_keys(values, Config)
    overrides = list(overrides)
    if unknown and strict:
        raise ConfigError(
            _blamed_unknown_message(unknown, source, overrides)
            + "; fix the key or set train.strict_config: false to allow unknown keys"
        )
    if unknown and warn and _rank() == 0:  # one warning per run, not one per DDP rank
        warnings.warn(
            _blamed_unknown_message(unknown, source, overrides)
            + " (kept: train.strict_config is false)",
            UserWarning,
            stacklevel=2,
        )
    hints = typing.get_type_hints(Config)
    for section in SECTIONS:
        if values.get(section) is None:
            raise ConfigError(f"{source}: section {section!r} must be a mapping, got null")
        try:
            _check_section(values[section], hints[section], section)
        except ConfigError as exc:
            path = str(exc).partition(":")[0]
            raise ConfigError(f"{_blame(path, source, overrides)}: {exc}") from None
    user_sections = tuple(str(k) for k in user if k in SECTIONS or k in values)
    return cfg, ConfigReport(source, user_sections, tuple(unknown), strict)


def _override_for(path: str, overrides: Sequence[str]) -> str | None:
    """The last override that set ``path`` (or a section above or a key below it), if any."""
    found = None
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key == path or path.startswith(key + ".") or key.startswith(path + "."):
            found = item
    return found


def _blame(path: str, source: str, overrides: Sequence[str]) -> str:
    """Where a bad value came from: the command-line override that set it, else the file."""
    item = _override_for(path, overrides)
    return f"override {item!r}" if item is not None else source


def _blamed_unknown_message(unknown: Sequence[str], source: str, overrides: Sequence[str]) -> str:
    """Unknown keys, each group named by where it came from: an override or the file."""
    groups: dict[str, list[str]] = {}
    for path in unknown:
        groups.setdefault(_blame(path, source, overrides), []).append(path)
    return "; ".join(_unknown_message(paths, Config, where) for where, paths in groups.items())


def _without_legacy_ema(user: DictConfig, source: str) -> DictConfig:
    train = user.get("train") if "train" in user else None
    if not isinstance(train, DictConfig) or not any(k in _LEGACY_EMA for k in train):
        return user
    plain = OmegaConf.to_container(user, resolve=False)  # interpolations stay as written
    assert isinstance(plain, dict)
    plain["train"] = _translate_legacy_ema(plain["train"], source)
    return OmegaConf.create(plain)


def check_config(cfg: DictConfig | Mapping[str, Any], source: str = "<config>") -> ConfigReport:
    """Report sections present, unknown keys and strictness for an already loaded config."""
    values = _resolve(cfg, source) if isinstance(cfg, DictConfig) else dict(cfg)
    strict, _ = _strictness(values)
    sections = tuple(k for k in values if values[k] is not None)
    return ConfigReport(source, sections, tuple(_unknown_keys(values, Config)), strict)


def format_summary(report: ConfigReport) -> str:
    """One line for the startup log."""
    unknown = ", ".join(report.unknown_keys) if report.unknown_keys else "none"
    return (
        f"config {report.source}: sections {', '.join(report.sections)}; "
        f"unknown keys: {unknown}; strict_config: {str(report.strict).lower()}"
    )


def summarize_config(cfg: DictConfig | Mapping[str, Any], source: str = "<config>") -> str:
    return format_summary(check_config(cfg, source))


def get_section(cfg: DictConfig | Mapping[str, Any], name: str) -> Any:
    """The section ``name`` of ``cfg``; ConfigError naming it when absent."""
    if name not in cfg or cfg[name] is None:
        raise ConfigError(
            f"config has no section {name!r} (sections: {', '.join(map(str, cfg.keys()))})"
        )
    return cfg[name]


def to_container(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """A plain, resolved dict (safe for JSON, YAML and checkpoints)."""
    if isinstance(cfg, DictConfig):
        return _resolve(cfg, "<config>")
    return {k: to_container(v) if isinstance(v, Mapping) else v for k, v in cfg.items()}


_MISSING = object()


def get(cfg: DictConfig | Mapping[str, Any] | None, path: str, default: Any = None) -> Any:
    """The value at dotted ``path`` (``"train.max_steps"``, ``"optim.optimizer.betas.0"``), or
    ``default`` when any part of the path is absent.

    Works on a loaded config (interpolations resolve; a section comes back as a DictConfig) and
    on plain nested dicts and lists, as a checkpoint's ``config`` holds them. A key that is
    present with value null gives None, not ``default``; an interpolation that cannot resolve is
    a ConfigError naming the path.
    """
    if not isinstance(path, str) or not path or any(not part for part in path.split(".")):
        raise ConfigError(f"get(cfg, {path!r}): expected a dotted key path such as 'train.seed'")
    node: Any = cfg
    for part in path.split("."):
        node = _child(node, part, path)
        if node is _MISSING:
            return default
    return node


def _child(node: Any, part: str, path: str) -> Any:
    if isinstance(node, DictConfig):
        if part not in node:
            return _MISSING
        try:
            return node[part]
        except OmegaConfBaseException as exc:
            raise ConfigError(f"get(cfg, {path!r}): {_omegaconf_message(exc)}") from None
    if isinstance(node, Mapping):
        return node.get(part, _MISSING)
    if isinstance(node, (Sequence, ListConfig)) and not isinstance(node, str) and part.isdigit():
        index = int(part)
        return node[index] if index < len(node) else _MISSING
    return _MISSING


def as_dict(cfg: DictConfig | Mapping[str, Any] | None) -> dict[str, Any]:
    """``cfg`` as plain, resolved nested dicts and lists (``{}`` for None): what to hand to JSON,
    YAML, a checkpoint or W&B. The same as `to_container`."""
    return {} if cfg is None else to_container(cfg)


def resolve_train_config(train_cfg: Mapping[str, Any] | TrainConfig | None) -> TrainConfig:
    """The loop's view of ``train``: defaults filled in, types and values checked.

    Unknown keys fail unless ``strict_config`` is false (then they are ignored here; the config
    loader already warned about them).
    """
    if isinstance(train_cfg, TrainConfig):
        values: dict[str, Any] = dataclasses.asdict(train_cfg)
    elif train_cfg is None:
        values = {}
    else:
        values = to_container(train_cfg)
    values = _translate_legacy_ema(values, "train_cfg")
    unknown = _unknown_keys(values, TrainConfig, "train.")
    if unknown and values.get("strict_config", True):
        raise ConfigError(_unknown_message(unknown, Config, "train_cfg"))
    checked = _check_section(_known_only(values, TrainConfig), TrainConfig, "train")
    return _build(TrainConfig, checked)


def as_train_config(train_cfg: Mapping[str, Any] | TrainConfig | None) -> TrainConfig:
    """``train_cfg`` as a TrainConfig: an instance as it is, anything else through
    `resolve_train_config`. The loop's helpers take the typed config; this is where the ones a
    user may call with a plain ``train`` mapping check it, once."""
    return train_cfg if isinstance(train_cfg, TrainConfig) else resolve_train_config(train_cfg)


def as_ema_config(ema_cfg: Mapping[str, Any] | EmaConfig) -> EmaConfig:
    """``ema_cfg`` (the ``train.ema`` section) as an EmaConfig, checked like the whole config."""
    if isinstance(ema_cfg, EmaConfig):
        return ema_cfg
    return resolve_train_config({"ema": to_container(ema_cfg)}).ema


def _known_only(values: Mapping[str, Any], schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    known = {}
    for key, value in values.items():
        if key in hints:
            sub = _dataclass_type(hints[key])
            known[key] = _known_only(value, sub) if sub and isinstance(value, Mapping) else value
    return known


def _build(schema: type, values: Mapping[str, Any]) -> Any:
    """The dataclass ``schema`` from checked ``values``, nested sections included."""
    hints = typing.get_type_hints(schema)
    kwargs = {}
    for key, value in values.items():
        sub = _dataclass_type(hints[key])
        kwargs[key] = (
            _build(sub, value) if sub is not None and isinstance(value, Mapping) else value
        )
    return schema(**kwargs)


def defaults() -> dict[str, Any]:
    """Every supported key with its default, as a plain nested dict."""
    return dataclasses.asdict(Config())


def flat_config(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"train.lr": 0.001, ...}``: one dotted key per leaf, in the config's
    order (an empty section holds no key; a tuple reads as the list it was in YAML)."""
    out: dict[str, Any] = {}

    def walk(path: str, item: Any) -> None:
        if isinstance(item, Mapping):
            for key, sub in item.items():
                walk(f"{path}.{key}" if path else str(key), sub)
        elif path:
            out[path] = list(item) if isinstance(item, tuple) else item

    walk(prefix, value)
    return out
