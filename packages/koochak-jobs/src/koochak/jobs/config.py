"""Deterministic config materialisation: base YAML + patches + a pinned ``train.out_dir``.

The result is the resolved YAML text a run will read: the same inputs always give the same
bytes, so its digest can be pinned in the launch manifest. Interpolations between keys
(``${train.out_dir}/log.csv``) are resolved here, on the submitting machine; resolvers that
read the machine (``${oc.env:...}``, any ``${name:...}``) are refused, because they would bake
this machine's environment (perhaps a secret) into a file meant to be the same everywhere.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ConfigPatch", "materialize_config"]

_RESOLVER = re.compile(r"\$\{\s*[A-Za-z_][\w.\-]*\s*:")


@dataclass(frozen=True)
class ConfigPatch:
    """Set ``path`` (a dotted key such as ``"data.max_length"``) to ``value``.

    With ``merge=True`` a mapping value is merged into an existing mapping; with ``merge=False``
    it replaces it. Missing keys are created. ``value`` must be plain YAML data.
    """

    path: str
    value: Any
    merge: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path.strip():
            raise ValueError(f"ConfigPatch path={self.path!r}; expected a dotted key such as 'a.b'")
        if any(not part for part in self.path.split(".")):
            raise ValueError(f"ConfigPatch path={self.path!r}: empty segment in the dotted key")
        if not isinstance(self.merge, bool):
            raise ValueError(f"ConfigPatch({self.path!r}) merge={self.merge!r}; expected a bool")
        _check_plain(self.value, f"ConfigPatch({self.path!r}) value")


def _check_plain(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, str) and _RESOLVER.search(value):
            raise ValueError(f"{where}: resolver interpolation {value!r} is not allowed")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value!r} is not a finite number")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: key {key!r} is not a string")
            _check_plain(item, f"{where}.{key}")
        return
    raise ValueError(f"{where}: {type(value).__name__} is not plain YAML data")


def materialize_config(
    base_config: str | os.PathLike[str],
    *,
    run_dir: str,
    patches: Sequence[ConfigPatch] = (),
    out_dir_config_key: str | None = "train.out_dir",
    run_id: str | None = None,
) -> str:
    """The resolved YAML text of ``base_config`` with ``out_dir_config_key`` set to ``run_dir``
    (unless it is None or empty), ``train.run_id`` set to ``run_id`` where the config names no
    run (``run_id`` None: left as it is), and then ``patches`` applied in order."""
    from koochak.storage.strict_yaml import load_yaml_file
    from omegaconf import OmegaConf  # only prepare_run needs it; the runner never does
    from omegaconf.errors import OmegaConfBaseException

    where = os.fspath(base_config)
    if isinstance(patches, (str, bytes)) or not isinstance(patches, Sequence):
        raise ValueError("prepare_run patches=: expected a sequence of ConfigPatch")
    for patch in patches:
        if not isinstance(patch, ConfigPatch):
            raise ValueError(f"prepare_run patches=: {patch!r} is not a ConfigPatch")
    doc = load_yaml_file(base_config)
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: a training config must be a YAML mapping")
    _check_plain(doc, where)
    try:
        cfg = OmegaConf.create(doc)
        if out_dir_config_key:
            OmegaConf.update(cfg, out_dir_config_key, run_dir, merge=True, force_add=True)
        if run_id is not None and OmegaConf.select(cfg, "train.run_id") is None:
            OmegaConf.update(cfg, "train.run_id", run_id, merge=True, force_add=True)
        for patch in patches:
            value = list(patch.value) if isinstance(patch.value, tuple) else patch.value
            OmegaConf.update(cfg, patch.path, value, merge=patch.merge, force_add=True)
        return OmegaConf.to_yaml(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        message = " ".join(str(exc).split())
        raise ValueError(f"{where}: cannot materialise the config: {message}") from None
