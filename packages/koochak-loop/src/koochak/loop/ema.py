"""EMA shadows of a model's weights, updated right after each optimizer step.

A shadow is a copy of every floating-point tensor of the model's state dict (parameters and
floating buffers such as BatchNorm's running statistics) that follows the weights as

    shadow <- beta * shadow + (1 - beta) * weights        (one torch._foreach_lerp_ per shadow)

where ``beta`` depends only on host-side integers (the update count), so an update queues device
work and never synchronises with the device. Two profiles:

- ``constant``: ``beta`` is ``decay``, optionally warmed up from ``decay_init`` over
  ``warmup_steps`` model steps with a ``linear`` or ``cosine`` schedule.
- ``power`` (EDM2, Karras et al. 2024, section 3): ``beta_t = (1 - 1/t) ** (gamma + 1)`` after
  model step ``t``, which averages the weights seen so far with a weight proportional to
  ``tau ** gamma``; ``gamma`` is given directly or through the profile's relative width
  ``srel`` (``srel_to_gamma``). Two such shadows (dual EMA) can be tracked together; saving
  them at several steps is what post-hoc reconstruction (``koochak.loop.ema_posthoc``) needs.

Thinned updates (``update_every: k``) are compensated by the model steps elapsed since the
previous EMA update: ``decay ** k`` for the constant profile and ``(1 - k/t) ** (gamma + 1)`` for
the power profile, so a thinned shadow follows the same averaging length as an unthinned one.

``offload_to_cpu`` keeps the shadows in (pinned) host memory: each update copies the weights into
a pinned staging buffer with non-blocking copies and applies them to the shadows at the next
update or read, by which time the copies have long finished. Under DDP every rank keeps its own
shadow of its identical weights; no communication is needed. Under FSDP every rank keeps the
shadow of its own shard of each parameter (the DTensor's local part), updated the same way; the
state dict hands the shadows out as DTensors placed like the parameters, and loading takes either
those or the global tensors of an unsharded checkpoint (each rank copies its slab).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from koochak.loop.config import (
    EMA_PROFILES,
    EMA_SCHEDULES,
    EMA_SREL_MAX,
    EmaConfig,
    as_ema_config,
    ema_has_primary,
    ema_profile,
)
from koochak.loop.dist import is_dtensor, local_tensor, placed_like
from koochak.loop.state_dicts import match_state_dict_to_model, unwrap_model

EMA_STATE_VERSION = 1
PROFILES = EMA_PROFILES
SCHEDULES = EMA_SCHEDULES
DEFAULT_DECAY = 0.999  # the constant profile's decay when train.ema.decay is null
# The widest power profile: gamma = 0, a uniform average of everything seen so far.
SREL_MAX = EMA_SREL_MAX


# ----------------------------------------------------------------------------- profiles


def gamma_to_srel(gamma: float) -> float:
    """Relative standard deviation of the power profile ``tau ** gamma`` (EDM2 eq. 123)."""
    if not gamma >= 0:
        raise ValueError(f"gamma must be >= 0, got {gamma!r}")
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def srel_to_gamma(srel: float) -> float:
    """The ``gamma`` whose power profile has relative width ``srel`` (0 < srel <= 1/sqrt(12)).

    ``srel ** 2 = (gamma + 1) / ((gamma + 2) ** 2 (gamma + 3))`` is strictly decreasing in
    ``gamma >= 0``, so bisection finds the one root there (the largest real root of EDM2's cubic
    ``gamma**3 + 7 gamma**2 + (16 - srel**-2) gamma + (12 - srel**-2)``).
    """
    if not 0 < srel <= SREL_MAX:
        raise ValueError(f"srel must be in (0, {SREL_MAX:.6f}], got {srel!r}")
    target = srel * srel
    low, high = 0.0, 1.0
    while gamma_to_srel(high) ** 2 > target:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if mid in (low, high):
            break
        if gamma_to_srel(mid) ** 2 > target:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


@dataclass(frozen=True)
class ShadowSpec:
    """How one shadow averages: the constant profile's decay and warm-up, or a power ``gamma``."""

    profile: str = "constant"
    decay: float = DEFAULT_DECAY
    decay_init: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"
    gamma: float | None = None

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"EMA profile must be one of {PROFILES}, got {self.profile!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"EMA schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.profile == "power" and (self.gamma is None or not self.gamma >= 0):
            raise ValueError(f"a power EMA needs gamma >= 0, got {self.gamma!r}")

    @property
    def srel(self) -> float | None:
        return gamma_to_srel(self.gamma) if self.gamma is not None else None

    def beta(self, step: int, elapsed: int = 1) -> float:
        """Weight kept on the old shadow when it takes in the weights after model step ``step``.

        ``step`` counts completed optimizer updates (1 after the first); ``elapsed`` is the
        number of model steps since this shadow's previous update (``update_every``).
        """
        if self.profile == "power":
            assert self.gamma is not None
            return max(0.0, 1.0 - elapsed / step) ** (self.gamma + 1.0)
        return scheduled_decay(self, step) ** elapsed


def scheduled_decay(spec: ShadowSpec, step: int) -> float:
    """The constant profile's decay at model step ``step``: ``decay_init`` at 0, ``decay`` from
    ``warmup_steps`` on, ramped linearly or along half a cosine in between."""
    if spec.schedule == "constant" or spec.warmup_steps <= 0:
        return spec.decay
    progress = min(max(step, 0) / spec.warmup_steps, 1.0)
    if spec.schedule == "cosine":
        progress = 0.5 * (1.0 - math.cos(math.pi * progress))
    return spec.decay_init + (spec.decay - spec.decay_init) * progress


def shadow_specs(cfg: EmaConfig) -> list[ShadowSpec]:
    """The shadows ``train.ema`` asks for (empty when EMA is off): the primary (constant or
    power), then the two dual power shadows when ``dual.enabled``; with dual EMA the primary is
    there only when ``decay``/``gamma``/``srel`` (or ``profile: constant``) is also given.
    Shadow 0 is what ``eval_with_ema`` evaluates with.

    Which combinations are accepted is `koochak.loop.config.ema_profile`'s rule (errors name the
    key); this only turns an accepted section into shadow specs.
    """
    profile = ema_profile(cfg)
    if profile is None:
        return []
    specs = []
    if ema_has_primary(cfg):
        if profile == "power":
            specs.append(ShadowSpec("power", gamma=_gamma(cfg.gamma, cfg.srel)))
        else:
            specs.append(
                ShadowSpec(
                    "constant",
                    decay=DEFAULT_DECAY if cfg.decay is None else float(cfg.decay),
                    decay_init=cfg.decay_init,
                    warmup_steps=cfg.warmup_steps,
                    schedule=cfg.schedule,
                )
            )
    if cfg.dual.enabled:
        dual = cfg.dual
        specs.append(ShadowSpec("power", gamma=_gamma(dual.gamma1, dual.srel1)))
        specs.append(ShadowSpec("power", gamma=_gamma(dual.gamma2, dual.srel2)))
    return specs


def _gamma(gamma: float | None, srel: float | None) -> float:
    if gamma is not None:
        return float(gamma)
    assert srel is not None  # ema_profile let through exactly one of the two
    return srel_to_gamma(float(srel))


# ----------------------------------------------------------------------------- the shadows


class ModelEma:
    """One or more EMA shadows of ``model`` (its unwrapped state-dict tensors), kept as data.

    Call ``update(step)`` after every optimizer step with the number of completed updates; it
    acts on every ``update_every``-th step. ``state_dict()``/``load_state_dict()`` round-trip
    exactly; ``shadow_state_dict(i)`` is loadable into the model; ``swapped_in(i)`` runs a
    block with shadow ``i`` as the model's weights and puts the training weights back exactly.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        specs: list[ShadowSpec],
        *,
        update_every: int = 1,
        offload_to_cpu: bool = False,
        pin_memory: bool = True,
        start_step: int = 0,
    ) -> None:
        if not specs:
            raise ValueError("ModelEma needs at least one ShadowSpec")
        if isinstance(update_every, bool) or not isinstance(update_every, int) or update_every < 1:
            raise ValueError(
                f"train.ema.update_every: expected an integer >= 1, got {update_every!r}"
            )
        self.model = unwrap_model(model)
        self.specs = list(specs)
        self.update_every = update_every
        self.step = int(start_step)  # model steps the shadows have taken in
        self.start_step = int(start_step)  # where they began (post-hoc EMA needs 0)
        self.updates = 0  # EMA updates applied
        self._keys, self._slots, self._index = _float_slots(self.model)
        live = self._live()
        accelerator = next((t.device for t in live if t.device.type != "cpu"), None)
        offload = offload_to_cpu and accelerator is not None
        # Only a CUDA copy into pinned memory is truly asynchronous (and has an event to wait on).
        self._cuda = accelerator if offload and accelerator.type == "cuda" else None
        pin = self._cuda is not None and pin_memory
        self.shadows = [_copies(live, pin if offload else None) for _ in self.specs]
        self._staging = _copies(live, pin) if offload else None
        self._pending: list[float] | None = None  # staged weights not yet folded in
        self._event: Any = None

    # -- updating

    def update(self, step: int) -> None:
        """Fold in the weights after model step ``step`` (acts when ``step % update_every == 0``)."""
        if step % self.update_every or step <= self.step:
            return
        elapsed = step - self.step
        weights = [1.0 - spec.beta(step, elapsed) for spec in self.specs]
        with torch.no_grad():
            if self._staging is None:
                live = self._live()
                for shadow, weight in zip(self.shadows, weights):
                    torch._foreach_lerp_(shadow, live, weight)
            else:
                self._finish()  # the previous staged copy: finished long ago, so no stall
                for staged, tensor in zip(self._staging, self._live()):
                    staged.copy_(tensor, non_blocking=self._cuda is not None)
                self._pending = weights
                if self._cuda is not None:  # after the copies on the stream that queued them
                    self._event = torch.cuda.Event()
                    self._event.record(torch.cuda.current_stream(self._cuda))
        self.step, self.updates = step, self.updates + 1

    def _finish(self) -> None:
        """Apply a staged (offloaded) update; a no-op otherwise."""
        if self._pending is None:
            return
        assert self._staging is not None
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        with torch.no_grad():
            for shadow, weight in zip(self.shadows, self._pending):
                torch._foreach_lerp_(shadow, self._staging, weight)
        self._pending = None

    def reset(self, start_step: int = 0) -> None:
        """Start every shadow again from the model's current weights at ``start_step``."""
        self._pending = None
        with torch.no_grad():
            for shadow in self.shadows:
                for target, tensor in zip(shadow, self._live()):
                    target.copy_(tensor)
        self.step, self.start_step, self.updates = int(start_step), int(start_step), 0

    # -- reading

    def shadow_state_dict(self, index: int = 0) -> dict[str, torch.Tensor]:
        """Shadow ``index`` keyed like ``model.state_dict()`` (non-float entries: the live ones)."""
        self._finish()
        state = self.model.state_dict()
        shadow = self.shadows[index]
        for key, slot in zip(self._keys, self._index):
            state[key] = placed_like(shadow[slot], state[key])  # a sharded weight: its shard
        return state

    def state_dict(self) -> dict[str, Any]:
        """The ``ema`` slot of a checkpoint: plain data, loadable with ``weights_only=True``."""
        return {
            "version": EMA_STATE_VERSION,
            "update_every": self.update_every,
            "step": self.step,
            "start_step": self.start_step,
            "updates": self.updates,
            "shadows": [
                {**dataclasses.asdict(spec), "srel": spec.srel,
                 "state_dict": self.shadow_state_dict(i)}
                for i, spec in enumerate(self.specs)
            ],
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any], source: str = "checkpoint") -> None:
        """Continue from a saved ``ema`` slot; its shadows must match ``train.ema`` and the model."""
        check_ema_state(state, source)
        saved = state["shadows"]
        if len(saved) != len(self.specs):
            raise ValueError(f"{source}: field 'ema' holds {len(saved)} shadow(s) but train.ema "
                             f"asks for {len(self.specs)}; resume with the same train.ema")  # fmt: skip
        for i, (entry, spec) in enumerate(zip(saved, self.specs)):
            saved_gamma = entry["gamma"]
            same = entry["profile"] == spec.profile and (
                spec.gamma is None
                or (saved_gamma is not None and math.isclose(saved_gamma, spec.gamma, rel_tol=1e-9))
            )
            if not same:
                raise ValueError(
                    f"{source}: ema shadow {i} is {entry['profile']} (gamma {entry['gamma']}) but "
                    f"train.ema gives {spec.profile} (gamma {spec.gamma}); resume with the same "
                    "train.ema"
                )
            missing = sorted(set(self._keys) - set(entry["state_dict"]))
            if missing:
                raise ValueError(f"{source}: ema shadow {i} lacks model key(s) {missing[:5]}")
        self._pending = None
        live = self.model.state_dict()
        with torch.no_grad():
            for shadow, entry in zip(self.shadows, saved):
                for key, slot in zip(self._keys, self._index):
                    value = entry["state_dict"][key]
                    if is_dtensor(live[key]) and not is_dtensor(value):
                        from koochak.loop.fsdp import sharded_like  # a global tensor: take my slab

                        value = sharded_like(value, live[key])
                    shadow[slot].copy_(local_tensor(value))
        self.step, self.updates = int(state["step"]), int(state["updates"])
        self.start_step = int(state["start_step"])

    @contextmanager
    def swapped_in(self, index: int = 0) -> Iterator[None]:
        """Run the block with shadow ``index`` as the model's weights; restore them exactly."""
        self._finish()
        live = self._live()
        with torch.no_grad():
            backup = [t.detach().clone() for t in live]
            for tensor, shadow in zip(live, self.shadows[index]):
                tensor.copy_(shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, saved in zip(self._live(), backup):
                    tensor.copy_(saved)

    def _live(self) -> list[torch.Tensor]:
        # Looked up anew each time: a module may reassign a buffer instead of updating it in place.
        return [local_tensor(table[name].detach()) for table, name in self._slots]


def _float_slots(
    model: torch.nn.Module,
) -> tuple[list[str], list[tuple[dict[str, Any], str]], list[int]]:
    """State-dict keys of floating tensors, one slot per distinct tensor, and each key's slot."""
    keys: list[str] = []
    slots: list[tuple[dict[str, Any], str]] = []
    index: list[int] = []
    seen: dict[int, int] = {}  # tied weights share one shadow tensor
    for key, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            continue
        path, _, name = key.rpartition(".")
        module = model.get_submodule(path)
        table = module._parameters if name in module._parameters else module._buffers
        if name not in table:
            continue  # extra state written by a custom hook: not a weight
        if id(tensor) not in seen:
            seen[id(tensor)] = len(slots)
            slots.append((table, name))
        keys.append(key)
        index.append(seen[id(tensor)])
    return keys, slots, index


def _copies(tensors: list[torch.Tensor], pin: bool | None) -> list[torch.Tensor]:
    """Detached copies: on the tensors' devices (``pin`` None) or on the host, pinned if ``pin``."""
    if pin is None:
        return [t.detach().clone() for t in tensors]
    return [
        torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin).copy_(t) for t in tensors
    ]


def check_ema_state(state: Any, source: str) -> None:
    """Raise ValueError naming ``source`` unless ``state`` is a version-1 ``ema`` slot."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{source}: field 'ema' must be a dict, got {type(state).__name__}")
    if state.get("version") != EMA_STATE_VERSION:
        raise ValueError(f"{source}: field 'ema.version' is {state.get('version')!r}; this "
                         f"Koochak reads version {EMA_STATE_VERSION}")  # fmt: skip
    for key in ("update_every", "step", "start_step", "updates", "shadows"):
        if key not in state:
            raise ValueError(f"{source}: field 'ema' is missing {key!r}")
    if not isinstance(state["shadows"], list) or not all(
        isinstance(s, Mapping) and {"profile", "gamma", "state_dict"} <= s.keys()
        for s in state["shadows"]
    ):
        raise ValueError(f"{source}: field 'ema.shadows' must be a list of shadow dicts")


# ----------------------------------------------------------------------------- the loop's side


def make_model_ema(
    cfg: EmaConfig | Mapping[str, Any] | None, model: torch.nn.Module, start_step: int = 0
) -> ModelEma | None:
    """The shadows ``train.ema`` asks for, starting from ``model``'s weights; None when off.

    ``cfg`` is an EmaConfig, or the ``train.ema`` section as a mapping (checked here like the
    whole config).
    """
    if cfg is None:
        return None
    cfg = as_ema_config(cfg)
    specs = shadow_specs(cfg)
    if not specs:
        return None
    if cfg.compensate_update_every is False:
        warnings.warn(
            "train.ema.compensate_update_every: false has no effect; thinned EMA updates are "
            "always compensated by the model steps elapsed (decay ** update_every)",
            UserWarning,
            stacklevel=2,
        )
    return ModelEma(
        model,
        specs,
        update_every=cfg.update_every,
        offload_to_cpu=cfg.offload_to_cpu,
        pin_memory=cfg.pin_memory,
        start_step=start_step,
    )


def restore_ema(ema: ModelEma | None, ckpt: Mapping[str, Any], source: str = "checkpoint") -> None:
    """Continue ``ema`` from ``ckpt["ema"]``; say so when either side has no shadows."""
    saved = ckpt.get("ema")
    if ema is not None and saved is not None:
        ema.load_state_dict(saved, source)
    elif ema is not None:
        warnings.warn(f"{source} has no EMA shadows: they start from its weights at step "
                      f"{int(ckpt['next_step'])}", UserWarning, stacklevel=2)  # fmt: skip
        ema.reset(int(ckpt["next_step"]))
    elif saved is not None:
        warnings.warn(f"{source} has EMA shadows but train.ema is off: they are not carried "
                      "into this run's checkpoints", UserWarning, stacklevel=2)  # fmt: skip


def load_ema_weights(
    model: torch.nn.Module, ckpt: Mapping[str, Any], shadow: int = 0
) -> torch.nn.Module:
    """Load shadow ``shadow`` of checkpoint ``ckpt`` into ``model`` (wrapped in DDP or not)."""
    if ckpt.get("ema") is None:
        raise ValueError("checkpoint has no EMA shadows (field 'ema' is null)")
    check_ema_state(ckpt["ema"], "checkpoint")
    state = ckpt["ema"]["shadows"][shadow]["state_dict"]
    model.load_state_dict(match_state_dict_to_model(model, state))
    return model
