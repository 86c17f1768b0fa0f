"""Free-form config sections that their factory declares, checked like the rest of the config.

``model:`` and ``data:`` hold the user's own keys, read by ``entry.model`` and ``entry.dataset``
(and ``entry.eval_dataset``), so the loader cannot know them. A factory can say which they are:

- by its signature: keyword-only parameters (after ``*``) and no ``**kwargs``::

      def make_model(cfg, *, n_embd: int = 64, n_layer: int = 2): ...

  ``koochak-train`` then passes each of them that the section sets (``n_embd=cfg.model.n_embd``);
  or
- by a declared list, ``make_model.config_keys = ("n_embd", "n_layer")``: the factory reads
  ``cfg`` itself.

When every factory that reads a section declares (``data:`` is read by ``entry.dataset`` and,
when set, ``entry.eval_dataset``), a key of that section that neither the schema (``data.batch_size``,
``data.data_dir``, ``data.num_workers``) nor a factory names is an unknown key: refused before
anything is built with a one-line error and a did-you-mean (a warning with
``train.strict_config: false``), the way every other section's unknown keys are. A factory that
declares nothing (``def make_model(cfg)``), or takes ``**kwargs``, leaves its section unchecked.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["SECTION_OF", "check_declared_sections", "declared_keys", "keyword_values"]

SECTION_OF = {"entry.model": "model", "entry.dataset": "data", "entry.eval_dataset": "data"}
_CLI_KEYWORDS = frozenset({"start_step"})  # what koochak-train passes a dataset builder itself


def _keyword_only(fn: Callable[..., Any]) -> list[str] | None:
    """The keyword-only parameter names of ``fn`` (None with ``**kwargs`` or no signature)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in _CLI_KEYWORDS]


def declared_keys(fn: Callable[..., Any], where: str = "factory") -> frozenset[str] | None:
    """The section keys ``fn`` declares: its ``config_keys`` list, else its keyword-only
    parameters; None when it declares none (its section stays unchecked)."""
    listed = getattr(fn, "config_keys", None)
    if listed is not None:
        if isinstance(listed, str) or not all(isinstance(k, str) for k in listed):
            from koochak.loop.config import ConfigError

            raise ConfigError(
                f"{where}: config_keys must be a list of key names, got {listed!r}"
            )
        return frozenset(listed)
    names = _keyword_only(fn)
    return frozenset(names) if names else None


def keyword_values(fn: Callable[..., Any], section: Mapping[str, Any] | None) -> dict[str, Any]:
    """What to pass ``fn`` by keyword: each keyword-only parameter the section sets (nothing for
    a factory with a ``config_keys`` list: it reads ``cfg`` itself)."""
    if getattr(fn, "config_keys", None) is not None or not section:
        return {}
    return {name: section[name] for name in _keyword_only(fn) or () if name in section}


def _schema_keys(section: str) -> set[str]:
    from koochak.loop.config import Config

    schema = typing.get_type_hints(Config)[section]
    return {f.name for f in dataclasses.fields(schema)}


def check_declared_sections(
    values: Mapping[str, Any],
    factories: Sequence[tuple[str, str, Callable[..., Any]]],
    blame: Callable[[str], str] = lambda path: "<config>",
    strict: bool = True,
) -> None:
    """Refuse (ConfigError, one line) the unknown keys of each free-form section whose every
    factory declares its keys. ``values``: the resolved config; ``factories``: ``(entry key,
    import path, callable)`` of each configured builder; ``blame(path)``: where a key came
    from (an override or the file), for the message."""
    from koochak.loop.config import ConfigError

    readers: dict[str, list[tuple[str, str, frozenset[str] | None]]] = {}
    for key, path, fn in factories:
        section = SECTION_OF[key]
        readers.setdefault(section, []).append((key, path, declared_keys(fn, f"{key}={path!r}")))
    for section, builders in readers.items():
        if any(keys is None for _, _, keys in builders):
            continue  # some reader takes any key
        known = _schema_keys(section).union(*(keys for _, _, keys in builders if keys))
        given = values.get(section) or {}
        unknown = [str(k) for k in given if str(k) not in known]
        if not unknown:
            continue
        parts = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f" (did you mean '{section}.{close[0]}'?)" if close else ""
            parts.append(f"'{section}.{key}'{hint}")
        who = " and ".join(f"{key}={path!r}" for key, path, _ in builders)
        message = (
            f"{blame(f'{section}.{unknown[0]}')}: unknown config key {', '.join(parts)}: "
            f"{who} declare{'s' if len(builders) == 1 else ''} the {section} section's keys "
            f"({', '.join(sorted(known))})"
        )
        if strict:
            raise ConfigError(
                message + "; fix the key, or declare it (a keyword-only parameter or the "
                "factory's config_keys), or set train.strict_config: false"
            )
        warnings.warn(message + " (kept: train.strict_config is false)", UserWarning,
                      stacklevel=2)  # fmt: skip
