"""Optimizer and LR-scheduler builders for the `optim` config section.

Schedules are plain factories returning `step -> lr factor` (optax style); `build_scheduler` wraps
them in `torch.optim.lr_scheduler.LambdaLR`, so a scheduler's `state_dict()` round-trips (it holds
the step counter and base LRs; the factor functions are rebuilt from config on resume).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

__all__ = [
    "OPTIMIZERS",
    "SCHEDULERS",
    "build_optimizer",
    "build_scheduler",
    "continued_schedule",
    "cosine_schedule",
    "step_schedule",
    "warmup_cosine_schedule",
]

Schedule = Callable[[int], float]

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULERS = ("none", "cosine", "step", "plateau", "cosine_warmup")
_OPTIMIZER_KEYS = (
    "name",
    "lr",
    "weight_decay",
    "betas",
    "eps",
    "momentum",
    "nesterov",
    "fused",
    "foreach",
    "param_groups",
)
_SCHEDULER_KEYS = (
    "name",
    "warmup_steps",
    "T_max",
    "eta_min",
    "step_size",
    "gamma",
    "factor",
    "patience",
    "mode",
    "monitor",
)


# ---------------------------------------------------------------------------------------------
# Schedules: step -> multiplicative LR factor.


def cosine_schedule(total_steps: int, final_factor: float = 0.0) -> Schedule:
    """Half-cosine from 1 at step 0 to `final_factor` at `total_steps`, flat afterwards."""
    if total_steps < 1:
        raise ValueError(f"cosine schedule needs total_steps >= 1, got {total_steps}")

    def schedule(step: int) -> float:
        progress = min(step, total_steps) / total_steps
        return final_factor + (1.0 - final_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule


def step_schedule(step_size: int, gamma: float) -> Schedule:
    """Multiply by `gamma` every `step_size` steps."""
    if step_size < 1:
        raise ValueError(f"step schedule needs step_size >= 1, got {step_size}")

    def schedule(step: int) -> float:
        return gamma ** (step // step_size)

    return schedule


def warmup_cosine_schedule(
    warmup_steps: int, total_steps: int, final_factor: float = 0.0
) -> Schedule:
    """Linear warmup `(step + 1) / warmup_steps` to 1, then a cosine to `final_factor`.

    Warmup starts at `1 / warmup_steps` rather than 0 so the first update is not wasted; the
    cosine spans the remaining `total_steps - warmup_steps` steps and stays flat after them.
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps <= warmup_steps:
        raise ValueError(
            f"cosine_warmup needs total steps (T_max) > warmup_steps, got {total_steps} <= "
            f"{warmup_steps}"
        )
    decay = cosine_schedule(total_steps - warmup_steps, final_factor)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return decay(step - warmup_steps)

    return schedule


# ---------------------------------------------------------------------------------------------
# Config plumbing.


def _plain(cfg: Any, section: str) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(cfg, Mapping):
        raise TypeError(f"{section} must be a mapping, got {type(cfg).__name__}")
    return dict(cfg)


def _check_keys(cfg: Mapping[str, Any], allowed: tuple[str, ...], section: str) -> None:
    unknown = [key for key in cfg if key not in allowed]
    if unknown:
        raise ValueError(
            f"{section}: unknown key(s) {', '.join(map(repr, unknown))}; supported keys: "
            f"{', '.join(allowed)}"
        )


def _name(cfg: Mapping[str, Any], supported: tuple[str, ...], section: str, default: str) -> str:
    name = cfg.get("name")
    if name is None:
        name = default
    if not isinstance(name, str) or name.lower() not in supported:
        raise ValueError(
            f"{section}.name: unsupported value {name!r}; supported: {', '.join(supported)}"
        )
    return name.lower()


def _number(
    cfg: Mapping[str, Any],
    key: str,
    section: str,
    default: float,
    *,
    minimum: float | None = None,
    positive: bool = False,
) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{section}.{key} must be a number, got {value!r}")
    value = float(value)
    if positive and not value > 0:
        raise ValueError(f"{section}.{key} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{section}.{key} must be >= {minimum}, got {value}")
    return value


def _integer(
    cfg: Mapping[str, Any], key: str, section: str, default: int | None, *, minimum: int = 0
) -> int | None:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{section}.{key} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{section}.{key} must be >= {minimum}, got {value}")
    return value


# ---------------------------------------------------------------------------------------------
# Builders.


# Options a param-group rule may set, per optimizer (the rest of a group's options come from
# the top level).
_GROUP_OPTIONS = {
    "adamw": ("lr", "weight_decay", "betas", "eps"),
    "adam": ("lr", "weight_decay", "betas", "eps"),
    "sgd": ("lr", "weight_decay", "momentum"),
}


def group_options(name: str) -> tuple[str, ...]:
    """The options a parameter-group rule may set for optimizer ``name``."""
    return _GROUP_OPTIONS[name]


_CLASSES = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def build_optimizer(
    params: torch.nn.Module | Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
    cfg: Mapping[str, Any],
) -> torch.optim.Optimizer:
    """Build `adamw`, `adam` or `sgd` (case-insensitive) from the `optim.optimizer` mapping.

    ``params`` is the model (needed for ``param_groups`` rules), or its parameters / torch
    parameter groups. Keys: name, lr, weight_decay, betas, eps (Adam family), momentum, nesterov
    (SGD), ``fused`` / ``foreach`` (null: torch's choice), ``param_groups`` (rules, see
    `koochak.loop.param_groups`). A key left null takes the default for that optimizer; keys the
    chosen optimizer does not use are ignored at the top level and refused in a rule.
    """
    section = "optim.optimizer"
    cfg = _plain(cfg, section)
    _check_keys(cfg, _OPTIMIZER_KEYS, section)
    name = _name(cfg, OPTIMIZERS, section, default="adamw")
    options = _options(name, cfg, section, defaults=True)
    groups = _param_groups(params, name, cfg.get("param_groups"), section)
    return _CLASSES[name](groups, **options, **_implementation(cfg, section))


def _options(name: str, cfg: Mapping[str, Any], section: str, defaults: bool) -> dict[str, Any]:
    """The constructor options of optimizer ``name`` from ``cfg``, checked. With ``defaults``
    every option is filled in (the top level); without, only those ``cfg`` sets (a rule)."""
    options: dict[str, Any] = {}
    present = (lambda key: True) if defaults else (lambda key: cfg.get(key) is not None)
    if present("lr"):
        options["lr"] = _number(cfg, "lr", section, 1e-3, positive=True)
    # torch's own defaults differ: AdamW decays by 0.01 unless told otherwise, Adam and SGD by 0.
    if present("weight_decay"):
        default_decay = 0.01 if name == "adamw" else 0.0
        options["weight_decay"] = _number(cfg, "weight_decay", section, default_decay, minimum=0)
    if name in ("adam", "adamw"):
        if present("betas"):
            options["betas"] = _betas(cfg.get("betas"), section)
        if present("eps"):
            options["eps"] = _number(cfg, "eps", section, 1e-8, positive=True)
        return options
    if present("momentum"):
        options["momentum"] = _number(cfg, "momentum", section, 0.0, minimum=0)
    if defaults:
        nesterov = cfg.get("nesterov")
        if nesterov is None:
            nesterov = False
        if not isinstance(nesterov, bool):
            raise TypeError(f"{section}.nesterov must be true or false, got {nesterov!r}")
        if nesterov and options["momentum"] == 0:
            raise ValueError(f"{section}.nesterov: true needs {section}.momentum > 0")
        options["nesterov"] = nesterov
    return options


def _betas(betas: Any, section: str) -> tuple[float, float]:
    if betas is None:
        return (0.9, 0.999)
    if (
        isinstance(betas, (str, bytes))
        or not isinstance(betas, (list, tuple))
        or len(betas) != 2
        or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0
            for b in betas
        )
    ):
        raise ValueError(f"{section}.betas must be two numbers in [0, 1), got {betas!r}")
    return (float(betas[0]), float(betas[1]))


def _implementation(cfg: Mapping[str, Any], section: str) -> dict[str, bool]:
    """``fused`` / ``foreach`` when set (null leaves the choice to torch)."""
    flags = {}
    for key in ("fused", "foreach"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise TypeError(f"{section}.{key} must be true, false or null, got {value!r}")
        flags[key] = value
    if flags.get("fused") and flags.get("foreach"):
        raise ValueError(
            f"{section}.fused and {section}.foreach cannot both be true (torch runs one "
            "implementation); set one of them to null"
        )
    return flags


def _param_groups(params: Any, name: str, rules: Any, section: str) -> Any:
    from koochak.loop.param_groups import check_rules, param_groups

    where = f"{section}.param_groups"
    rules = check_rules(rules, _GROUP_OPTIONS[name], where)
    if not isinstance(params, torch.nn.Module):
        if rules:
            raise ValueError(
                f"{where} selects parameters by name and module, so it needs the model: call "
                "build_optimizer(model, cfg), not build_optimizer(model.parameters(), cfg)"
            )
        return params
    for i, rule in enumerate(rules):
        rule.update(_options(name, rule, f"{where}[{i}]", defaults=False))
    return param_groups(params, rules, where) if rules else params.parameters()


def _total_steps(cfg: Mapping[str, Any], train_cfg: Mapping[str, Any], section: str) -> int:
    t_max = _integer(cfg, "T_max", section, None, minimum=1)
    if t_max is not None:
        return t_max
    if train_cfg.get("scheduler_step", "update") == "eval":
        # max_steps counts optimizer updates; with per-eval stepping it would stretch the schedule.
        raise ValueError(
            f"{section}.T_max is null, which falls back to train.max_steps (optimizer updates), "
            "but train.scheduler_step is 'eval'; set T_max to the number of evaluations"
        )
    max_steps = train_cfg.get("max_steps")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(
            f"{section}.T_max is null, so train.max_steps must be an int >= 1, got {max_steps!r}"
        )
    return max_steps


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: Mapping[str, Any] | None,
    train_cfg: Mapping[str, Any],
    *,
    checkpoint: Mapping[str, Any] | None = None,
) -> torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau | None:
    """Build the scheduler named by `optim.scheduler.name`, or return None for `none`/null.

    - `cosine`: cosine from each group's LR to `eta_min` over `T_max` steps.
    - `cosine_warmup`: linear warmup over `warmup_steps`, then cosine to `eta_min` at `T_max`.
    - `step`: multiply by `gamma` every `step_size` steps.
    - `plateau`: `ReduceLROnPlateau(mode, factor, patience, min_lr=eta_min)`; its `monitor`
      attribute names the metric the loop must pass to `step()` (default `eval_loss`).

    `T_max: null` means `train.max_steps`. A "step" is one `scheduler.step()` call.

    ``checkpoint``: the checkpoint the run resumes from. When its ``train.max_steps`` was the
    cosine's horizon and this run's is longer, the schedule is the checkpoint's up to where it
    stopped, then a cosine from the LR it had reached down to ``eta_min`` at the new
    ``max_steps`` (`continued_schedule`): no jump in the LR. (A decay that had not begun yet is
    simply laid over the new horizon.)
    """
    section = "optim.scheduler"
    cfg = _plain(cfg, section)
    train_cfg = _plain(train_cfg, "train")
    _check_keys(cfg, _SCHEDULER_KEYS, section)
    name = _name(cfg, SCHEDULERS, section, default="none")
    if name == "none":
        return None

    eta_min = _number(cfg, "eta_min", section, 0.0, minimum=0)

    if name == "plateau":
        mode = cfg.get("mode") or "min"
        if mode not in ("min", "max"):
            raise ValueError(f"{section}.mode: unsupported value {mode!r}; supported: min, max")
        factor = _number(cfg, "factor", section, 0.1, positive=True)
        if factor >= 1.0:
            raise ValueError(f"{section}.factor must be < 1, got {factor}")
        patience = _integer(cfg, "patience", section, 10)
        monitor = cfg.get("monitor") or "eval_loss"
        if not isinstance(monitor, str):
            raise TypeError(f"{section}.monitor must be a metric name, got {monitor!r}")
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode=mode, factor=factor, patience=patience, min_lr=eta_min
        )
        scheduler.monitor = monitor  # type: ignore[attr-defined]
        return scheduler

    if name == "step":
        step_size = _integer(cfg, "step_size", section, None, minimum=1)
        if step_size is None:
            raise ValueError(f"{section}.step_size is required for the 'step' scheduler")
        gamma = _number(cfg, "gamma", section, 0.1, positive=True)
        factories = [step_schedule(step_size, gamma) for _ in optimizer.param_groups]
    else:
        total = _total_steps(cfg, train_cfg, section)
        warmup = _integer(cfg, "warmup_steps", section, 0) if name == "cosine_warmup" else 0
        if warmup and total <= warmup:
            source = "T_max" if cfg.get("T_max") is not None else "T_max: null -> train.max_steps"
            raise ValueError(
                f"{section}.warmup_steps={warmup} must be below the schedule length {total} "
                f"({section}.{source}): set {section}.warmup_steps={total // 10} or a longer schedule"
            )
        origin = _resumed_horizon(checkpoint, cfg, total, section)
        factories = []
        for group in optimizer.param_groups:
            # eta_min is an absolute LR; as a factor it depends on each group's base LR.
            base = group.get("initial_lr", group["lr"])
            final = eta_min / base if base > 0 else 0.0
            factories.append(_decay(warmup, total, final, origin))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=factories)


def _decay(warmup: int, total: int, final: float, origin: tuple[int, int] | None) -> Schedule:
    """The (warmup +) cosine over ``total`` steps; after a ``max_steps`` extension (``origin`` =
    the checkpoint's scheduler steps and horizon) the checkpoint's schedule continued."""
    if origin is None or origin[0] <= warmup:  # the decay has not begun: lay it over `total`
        return (
            warmup_cosine_schedule(warmup, total, final)
            if warmup
            else cosine_schedule(total, final)
        )
    start, horizon = origin
    before = (
        warmup_cosine_schedule(warmup, horizon, final)
        if warmup
        else cosine_schedule(horizon, final)
    )
    return continued_schedule(before, start, total, final)


def _resumed_horizon(
    checkpoint: Mapping[str, Any] | None, cfg: Mapping[str, Any], total: int, section: str
) -> tuple[int, int] | None:
    """(scheduler steps taken, the schedule's length) of the checkpoint a run resumes from, when
    its horizon was ``train.max_steps`` and this run extends it; else None."""
    if checkpoint is None or cfg.get("T_max") is not None:
        return None
    old_total = ((checkpoint.get("config") or {}).get("train") or {}).get("max_steps")
    start = (checkpoint.get("scheduler") or {}).get("last_epoch")
    if not isinstance(old_total, int) or not isinstance(start, int) or old_total >= total:
        return None
    if start >= old_total:
        warnings.warn(
            f"{section}: the checkpoint's schedule had ended (step {start} of {old_total}, "
            f"LR at eta_min); extending train.max_steps to {total} continues at that LR. To "
            "train the extra steps at a higher LR, start a new schedule (change optim.scheduler "
            "and accept it with train.resume_allow_changes)",
            UserWarning,
            stacklevel=3,
        )
    return start, old_total


def continued_schedule(schedule: Schedule, start: int, total: int, final_factor: float) -> Schedule:
    """`schedule` before step `start`; from there a half-cosine from `schedule(start)` to
    `final_factor` at step `total`, flat afterwards: how a decay continues when the run is
    extended, without a jump in the LR."""
    if total <= start:
        raise ValueError(f"continued_schedule needs total > start, got {total} <= {start}")
    begin = schedule(start)

    def continued(step: int) -> float:
        if step < start:
            return schedule(step)
        progress = min(step - start, total - start) / (total - start)
        return final_factor + (begin - final_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return continued
