"""The user's own checkpointed state: ``training_loop(state={"opt_d": opt_d, ...})``.

The core fields of a checkpoint stay closed (``checkpoint.format``); this is the one open place.
Each entry is any object with ``state_dict()`` and ``load_state_dict()`` (a second optimizer,
its scheduler, an EMA of a submodule, a module kept outside the model). It rides in every
checkpoint layout as the field ``user_state`` (docs/formats.md, "Checkpoint dict"):
``{"version": 1, "entries": {name: state_dict}}``. On resume the names must match exactly (a
missing or extra name is refused by name) and every entry is loaded before the first update.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from koochak.loop import fsdp
from koochak.loop.dist import is_dtensor

USER_STATE_VERSION = 1
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")

StateArg = Mapping[str, Any] | Callable[[torch.nn.Module], Mapping[str, Any]] | None


def resolve_state(state: StateArg, model: torch.nn.Module) -> dict[str, Any]:
    """The state mapping, calling a factory ``model -> {name: object}`` (needed under FSDP,
    where sharding replaces the parameters an optimizer must hold); checked: names are plain
    identifiers and every value has ``state_dict`` and ``load_state_dict``."""
    if state is None:
        return {}
    if not isinstance(state, Mapping):
        if not callable(state):
            raise TypeError(f"training_loop(state=...): expected a mapping name -> object or a "
                            f"factory model -> mapping, got {type(state).__name__}")  # fmt: skip
        state = state(model)
        if not isinstance(state, Mapping):
            raise TypeError(f"training_loop(state=...): the factory returned "
                            f"{type(state).__name__}, not a mapping name -> object")  # fmt: skip
    for name, value in state.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"training_loop(state=...): name {name!r} is not a plain identifier")
        if not (callable(getattr(value, "state_dict", None))
                and callable(getattr(value, "load_state_dict", None))):  # fmt: skip
            raise TypeError(
                f"training_loop(state=...): entry {name!r} ({type(value).__name__}) has no "
                "state_dict/load_state_dict, so a checkpoint cannot carry it"
            )
    return dict(state)


def capture_state(state: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The checkpoint field ``user_state`` for ``state`` (None when there is none). Tensors are
    the live ones (``state_dict`` shares storage), as for the core fields."""
    if not state:
        return None
    return {"version": USER_STATE_VERSION,
            "entries": {name: obj.state_dict() for name, obj in state.items()}}  # fmt: skip


def check_user_state(value: Any, source: str) -> None:
    """Raise ValueError naming ``source`` unless ``value`` is a version-1 ``user_state`` field."""
    where = f"{source}: field 'user_state'"
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value.keys() - {"version", "entries"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}")
    version = value.get("version")
    if type(version) is not int or version != USER_STATE_VERSION:
        raise ValueError(f"{where}: 'version' is {version!r}; this Koochak reads version "
                         f"{USER_STATE_VERSION}")  # fmt: skip
    entries = value.get("entries")
    if not isinstance(entries, Mapping):
        raise ValueError(f"{where}: 'entries' must be a mapping name -> state dict")
    for name, entry in entries.items():
        if not isinstance(name, str) or not isinstance(entry, Mapping):
            raise ValueError(f"{where}: entry {name!r} must be a state dict (a mapping)")


def restore_state(saved: Mapping[str, Any] | None, state: Mapping[str, Any], where: str) -> None:
    """Load ``saved`` (a ``user_state`` field, or None) into the live ``state``; the names must
    match exactly. Global tensors are cut into the shards of live FSDP parameters."""
    entries = dict((saved or {}).get("entries") or {})
    missing, extra = sorted(state.keys() - entries.keys()), sorted(entries.keys() - state.keys())
    if missing or extra:
        said = []
        if missing:
            said.append(f"the run has state {missing} that the checkpoint does not hold")
        if extra:
            said.append(f"the checkpoint holds state {extra} that this run does not pass")
        raise ValueError(f"resume from {where}: {'; '.join(said)} (training_loop(state=...) "
                         "must name the same entries as the run that saved it)")  # fmt: skip
    for name, obj in state.items():
        entry = entries[name]
        try:
            if isinstance(obj, torch.optim.Optimizer):
                if any(is_dtensor(p) for g in obj.param_groups for p in g["params"]):
                    entry = fsdp.localize_optimizer(entry, obj)
            elif any(is_dtensor(v) for v in obj.state_dict().values()):
                entry = fsdp.localize(entry, obj.state_dict())
            obj.load_state_dict(entry)
        except Exception as exc:
            raise ValueError(f"resume from {where}: state {name!r} could not be loaded: "
                             f"{type(exc).__name__}: {exc}") from exc  # fmt: skip


def untracked_parameters(
    model: torch.nn.Module, optimizer: Any, state: Mapping[str, Any]
) -> list[str]:
    """Names of ``model``'s parameters that require grad but belong to no checkpointed optimizer
    (the main one, or an optimizer in ``state``) and to no module in ``state``: whatever steps
    them keeps state that a resume would lose."""
    held: set[int] = set()
    for obj in [optimizer, *state.values()]:
        if isinstance(obj, torch.optim.Optimizer):
            held.update(id(p) for group in obj.param_groups for p in group["params"])
        elif isinstance(obj, torch.nn.Module):
            held.update(id(p) for p in obj.parameters())
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
