"""Parameter groups from rules: ``optim.optimizer.param_groups``.

A rule selects parameters and sets optimizer options for them::

    param_groups:
      - names: ["*.bias"]                   # fnmatch patterns on the parameter's full name
      - modules: [LayerNorm, Embedding]     # class names of the module that holds it
        weight_decay: 0.0
      - names: ["head.*"]
        lr: 0.003

A parameter goes to the first rule all of whose selectors match it (``names``: any pattern
matches any of its names, tied weights have several; ``modules``: the holding module's class or
one of its bases is listed; ``max_ndim``: ``param.ndim <= max_ndim``); the rest form the default
group, which is first and takes the optimizer's top-level options. A rule without options still
makes its own group. Groups are a function of the model and the rules alone, so a resumed run
rebuilds the same groups in the same order and the optimizer state loads onto them.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["SELECTORS", "check_rules", "param_groups"]

SELECTORS = ("names", "modules", "max_ndim")


def check_rules(rules: Any, options: Sequence[str], section: str) -> list[dict[str, Any]]:
    """``rules`` as plain dicts, each checked: a mapping, known keys (a selector or one of the
    chosen optimizer's ``options``), at least one selector, selectors of the right shape.
    Option values are checked by the optimizer builder."""
    if rules is None:
        return []
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Sequence):
        raise TypeError(f"{section}: expected a list of rules, got {rules!r}")
    checked = []
    for i, rule in enumerate(rules):
        where = f"{section}[{i}]"
        if not isinstance(rule, Mapping):
            raise TypeError(f"{where}: expected a mapping like {{names: ['*.bias'], "
                            f"weight_decay: 0.0}}, got {rule!r}")  # fmt: skip
        unknown = [key for key in rule if key not in SELECTORS and key not in options]
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a rule has selectors "
                f"({', '.join(SELECTORS)}) and options of this optimizer ({', '.join(options)})"
            )
        if not any(rule.get(key) is not None for key in SELECTORS):
            raise ValueError(f"{where}: needs a selector: {', '.join(SELECTORS)}")
        for key in ("names", "modules"):
            value = rule.get(key)
            if value is not None and (
                isinstance(value, (str, bytes))
                or not isinstance(value, Sequence)
                or not value
                or not all(isinstance(v, str) and v for v in value)
            ):
                raise TypeError(
                    f"{where}.{key}: expected a non-empty list of strings, got {value!r}"
                )
        ndim = rule.get("max_ndim")
        if ndim is not None and (isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 0):
            raise ValueError(f"{where}.max_ndim: expected an int >= 0, got {ndim!r}")
        checked.append(dict(rule))
    return checked


def _holders(model: torch.nn.Module) -> dict[int, set[str]]:
    """Parameter id -> class names (with bases) of every module that holds it directly."""
    holders: dict[int, set[str]] = {}
    for module in model.modules():
        kinds = {cls.__name__ for cls in type(module).__mro__}
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), set()).update(kinds)
    return holders


def _matches(rule: Mapping[str, Any], names: list[str], kinds: set[str], param: Any) -> bool:
    if rule.get("names") is not None and not any(
        fnmatch.fnmatchcase(name, pattern) for name in names for pattern in rule["names"]
    ):
        return False
    if rule.get("modules") is not None and not kinds.intersection(rule["modules"]):
        return False
    return rule.get("max_ndim") is None or param.ndim <= rule["max_ndim"]


def param_groups(
    model: torch.nn.Module, rules: Sequence[Mapping[str, Any]], section: str
) -> list[dict[str, Any]]:
    """Torch parameter groups for ``model``: the default group, then one per rule, in order,
    each ``{"params": [...], **options}``; an empty group is left out (a rule that matched
    nothing warns, naming it, since it is usually a misspelt pattern)."""
    names: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params.setdefault(id(param), param)
    holders = _holders(model)
    default: list[torch.nn.Parameter] = []
    chosen: list[list[torch.nn.Parameter]] = [[] for _ in rules]
    for key, param in params.items():
        index = next(
            (i for i, rule in enumerate(rules) if _matches(rule, names[key], holders[key], param)),
            None,
        )
        (default if index is None else chosen[index]).append(param)
    groups = [{"params": default}] if default else []
    for i, (rule, members) in enumerate(zip(rules, chosen)):
        if not members:
            warnings.warn(f"{section}[{i}] matched no parameter of {type(model).__name__}: "
                          f"{dict(rule)}", UserWarning, stacklevel=3)  # fmt: skip
            continue
        options = {k: v for k, v in rule.items() if k not in SELECTORS}
        groups.append({"params": members, **options})
    return groups
