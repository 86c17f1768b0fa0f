"""The stores file: a private YAML file mapping scheme names to stores and their settings.

Site facts (mount points, publish modes, endpoints, measured profiles) stay out of code and out
of this repository. ``open_store("archive://datasets/foo")`` finds the ``archive`` entry here and
returns a LocalStore rooted at ``<root>/datasets/foo`` with that entry's settings. An entry with
``backend: NAME`` instead hands its ``options`` mapping (and ``profile``) to the store factory
registered under NAME (``register_store`` or a ``koochak.stores`` entry point), so a plugin store
takes its settings from here without this module knowing what they mean. The file is read again
whenever its modification time or size changes, so edits apply without restarting.
"""

from __future__ import annotations

import os
import pathlib
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from koochak.storage.keys import PUBLISH_MODES, validate_key
from koochak.storage.profile import StoreProfile, parse_size
from koochak.storage.strict_json import require_version
from koochak.storage.strict_yaml import loads_yaml

__all__ = [
    "STORES_FILE_VERSION",
    "StoreSettings",
    "stores_file_path",
    "load_stores_file",
    "settings_for_scheme",
]

STORES_FILE_VERSION = 1

_TOP_KEYS = {"version", "stores"}
_ENTRY_KEYS = {
    "root",
    "publish",
    "fsync",
    "verify_readback",
    "settle_seconds",
    "read_settle_seconds",
    "profile",
}
# An entry naming a plugin backend has only these; what its options mean is the backend's affair.
_BACKEND_KEYS = {"backend", "options", "profile"}
_PROFILE_KEYS = set(StoreProfile.__dataclass_fields__)
# The file is meant to be shared between people and machines; credentials belong elsewhere.
_SECRET_WORDS = re.compile(
    r"secret|passw(or)?d|token|credential|api[_-]?key|access[_-]?key|private[_-]?key",
    re.IGNORECASE,
)
_ENV_REF = re.compile(r"\$\{\s*oc\.env\s*:\s*([^,}\s]+)")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")


@dataclass(frozen=True)
class StoreSettings:
    """One resolved entry of the stores file.

    A LocalStore entry has ``root`` and the LocalStore settings; a plugin entry has ``backend``
    (the factory's name), ``options`` (a plain mapping for that factory) and ``root`` empty.
    """

    scheme: str
    root: str
    publish: str = "link"
    fsync: bool = True
    verify_readback: bool = False
    settle_seconds: float = 0.0
    read_settle_seconds: float = 0.0
    profile: StoreProfile | None = None
    backend: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def open_backend(self, path: str, location: str, factory: Callable[..., Any] | None) -> Any:
        """Build the store of a ``backend:`` entry: ``factory(path, options=..., profile=...)``.

        ``factory`` is the one ``open_store`` found for the backend name (None: none is
        installed). ``path`` is the text after ``scheme://``; the backend decides what it means
        (typically a key prefix below the one in its options).
        """
        where = f"open_store({location!r}): stores file entry {self.scheme!r}"
        if factory is None:
            raise ValueError(
                f"{where} names backend {self.backend!r}, but no register_store factory or "
                f"'koochak.stores' entry point provides it (is its distribution installed?)"
            )
        try:
            store = factory(path, options=dict(self.options), profile=self.profile)
        except TypeError as exc:
            if "options" not in str(exc) and "profile" not in str(exc):
                raise
            raise TypeError(
                f"{where}: the factory of backend {self.backend!r} does not take the keyword "
                f"arguments options= and profile= that stores-file entries pass ({exc})"
            ) from None
        except ValueError as exc:
            raise ValueError(f"{where}: options: {exc}") from None
        if not _is_store(store):
            raise TypeError(
                f"{where}: backend {self.backend!r} returned {type(store).__name__}, which does "
                "not implement the Store protocol"
            )
        return store

    def root_for(self, path: str = "") -> pathlib.Path:
        """The directory a LocalStore for ``path`` under this entry is rooted at ("" = root).

        ``open_store`` builds that LocalStore with this entry's settings; this module only
        reads the file, so it never imports the store it describes.
        """
        path = path.strip("/")
        root = pathlib.Path(self.root)
        return root / validate_key(path) if path else root


_STORE_METHODS = ("get", "open", "put", "stat", "list", "delete", "local_path")


def _is_store(obj: Any) -> bool:
    """What ``isinstance(obj, Store)`` checks, without importing the store module (which
    imports this one)."""
    return isinstance(getattr(obj, "location", None), str) and all(
        callable(getattr(obj, name, None)) for name in _STORE_METHODS
    )


def stores_file_path() -> pathlib.Path:
    """``$KOOCHAK_STORES``, else ``$XDG_CONFIG_HOME/koochak/stores.yaml``, else ``~/.config/...``."""
    explicit = os.environ.get("KOOCHAK_STORES")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(
        os.path.expanduser("~"), ".config"
    )
    return pathlib.Path(config_home) / "koochak" / "stores.yaml"


# Validated (not yet resolved) files keyed by path, each with the (mtime_ns, size, inode) it was
# parsed from. The cache keeps repeated open_store calls cheap; the stat check makes edits visible.
_CACHE: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}
_CACHE_LOCK = threading.Lock()


def _validated(file: pathlib.Path) -> dict[str, Any]:
    st = file.stat()
    stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    name = str(file)
    with _CACHE_LOCK:
        cached = _CACHE.get(name)
        if cached is not None and cached[0] == stamp:
            return cached[1]
    raw = _parse(file, file.read_bytes())
    with _CACHE_LOCK:
        _CACHE[name] = (stamp, raw)
    return raw


def load_stores_file(path: str | os.PathLike[str] | None = None) -> dict[str, StoreSettings]:
    """Parse, validate and resolve a whole stores file (default: ``stores_file_path()``).

    Returns scheme -> settings. Raises ``FileNotFoundError`` when the file is missing and
    ``ValueError`` naming the file and key for anything malformed: unknown keys, secret-looking
    keys, values that do not resolve or do not fit, an unknown version.
    """
    file = pathlib.Path(path) if path is not None else stores_file_path()
    raw = _validated(file)
    return {scheme: _resolve_entry(file, raw, scheme) for scheme in _schemes(raw)}


def settings_for_scheme(scheme: str, location: str) -> StoreSettings:
    """The resolved entry for ``scheme`` (called by ``open_store`` for ``scheme://...``).

    Only the requested entry is resolved, so an unset variable in another entry does not
    break this one. ValueError naming ``location`` when there is no file or no such entry.
    """
    file = stores_file_path()
    try:
        raw = _validated(file)
    except FileNotFoundError:
        raise ValueError(
            f"open_store({location!r}): no store is registered for scheme {scheme!r}: no "
            f"register_store factory, no 'koochak.stores' entry point, and no stores file at "
            f"{file} (set $KOOCHAK_STORES to use another file)"
        ) from None
    schemes = _schemes(raw)
    if scheme not in schemes:
        known = ", ".join(sorted(schemes)) or "none"
        raise ValueError(
            f"open_store({location!r}): scheme {scheme!r} is not in the stores file {file} "
            f"(it defines: {known})"
        )
    return _resolve_entry(file, raw, scheme)


def _schemes(raw: dict[str, Any]) -> dict[str, str]:
    """Lower-cased scheme -> the spelling used in the file."""
    return {name.lower(): name for name in raw.get("stores") or {}}


def _parse(file: pathlib.Path, text: bytes) -> dict[str, Any]:
    raw = loads_yaml(text, f"stores file {file}")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"stores file {file}: expected a mapping with 'version' and 'stores'")
    _refuse_secrets(file, raw, "")
    _only_keys(file, raw, _TOP_KEYS, "")
    require_version(raw, f"stores file {file}", STORES_FILE_VERSION)  # exact int: not true, 1.0
    stores = raw.get("stores") or {}
    if not isinstance(stores, dict):
        raise ValueError(f"stores file {file}: 'stores' must map scheme names to settings")
    for scheme, entry in stores.items():
        if not isinstance(scheme, str) or not _SCHEME.fullmatch(scheme):
            raise ValueError(f"stores file {file}: {scheme!r} is not a scheme name like 'archive'")
        if scheme.lower() == "file":
            raise ValueError(f"stores file {file}: 'file' always means a local path; rename it")
        if not isinstance(entry, dict):
            raise ValueError(f"stores file {file}: stores.{scheme} must be a mapping with 'root'")
        allowed = _BACKEND_KEYS if "backend" in entry else _ENTRY_KEYS
        _only_keys(file, entry, allowed, f"stores.{scheme}.")
        if isinstance(entry.get("profile"), dict):
            _only_keys(file, entry["profile"], _PROFILE_KEYS, f"stores.{scheme}.profile.")
    lowered = [name.lower() for name in stores]
    if len(set(lowered)) != len(lowered):
        raise ValueError(
            f"stores file {file}: scheme names differ only by case; schemes ignore case"
        )
    return raw


def _refuse_secrets(file: pathlib.Path, node: Any, where: str) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, str) and _SECRET_WORDS.search(key):
                raise ValueError(
                    f"stores file {file}: key {where}{key} looks like a secret; the stores file "
                    "must hold no secrets (keep credentials in the backend's own configuration)"
                )
            _refuse_secrets(file, value, f"{where}{key}.")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            _refuse_secrets(file, value, f"{where}{index}.")
    elif isinstance(node, str):
        for var in _ENV_REF.findall(node):
            if _SECRET_WORDS.search(var):
                raise ValueError(
                    f"stores file {file}: {where.rstrip('.')} reads ${{oc.env:{var}}}, which "
                    "looks like a secret; the stores file must hold no secrets"
                )


def _only_keys(file: pathlib.Path, node: dict[Any, Any], allowed: set[str], where: str) -> None:
    for key in node:
        if key not in allowed:
            raise ValueError(
                f"stores file {file}: unknown key {where}{key}; expected one of "
                f"{', '.join(sorted(allowed))}"
            )


def _resolve_entry(file: pathlib.Path, raw: dict[str, Any], scheme: str) -> StoreSettings:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    name = _schemes(raw)[scheme]
    try:
        # Built from the whole file so interpolations may point at other entries.
        conf = OmegaConf.create(raw)
        entry = OmegaConf.to_container(conf.stores[name], resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or f"stores.{name}"
        message = str(exc).splitlines()[0]
        raise ValueError(f"stores file {file}: cannot resolve {key}: {message}") from None
    return _settings(file, name, entry)  # type: ignore[arg-type]


def _settings(file: pathlib.Path, scheme: str, entry: dict[str, Any]) -> StoreSettings:
    where = f"stores file {file}: stores.{scheme}"
    if "backend" in entry:
        return _backend_settings(where, scheme, entry)
    root = entry.get("root")
    if not isinstance(root, str) or not root:
        raise ValueError(f"{where}.root is required: an absolute directory path")
    root = os.path.expanduser(root)
    if not os.path.isabs(root):
        raise ValueError(f"{where}.root={root!r} must be an absolute path")
    publish = entry.get("publish", "link")
    if publish not in PUBLISH_MODES:
        raise ValueError(f"{where}.publish={publish!r}; expected one of {', '.join(PUBLISH_MODES)}")
    flags = {}
    for name, default in (("fsync", True), ("verify_readback", False)):
        value = entry.get(name, default)
        if not isinstance(value, bool):
            raise ValueError(f"{where}.{name}={value!r}; expected true or false")
        flags[name] = value
    seconds = {}
    for name in ("settle_seconds", "read_settle_seconds"):
        value = entry.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{where}.{name}={value!r}; expected a number of seconds >= 0")
        seconds[name] = float(value)
    profile = None
    if entry.get("profile") is not None:
        profile = _profile(where + ".profile", entry["profile"])
    return StoreSettings(
        scheme=scheme.lower(), root=root, publish=publish, profile=profile, **flags, **seconds
    )


def _backend_settings(where: str, scheme: str, entry: dict[str, Any]) -> StoreSettings:
    backend = entry["backend"]
    if not isinstance(backend, str) or not _SCHEME.fullmatch(backend):
        raise ValueError(
            f"{where}.backend={backend!r}; expected the name of an installed store backend "
            "such as 's3'"
        )
    if backend.lower() == "file":
        raise ValueError(f"{where}.backend='file': local directories use root: instead")
    options = entry.get("options") or {}
    if not isinstance(options, dict):
        raise ValueError(f"{where}.options must be a mapping of the backend's settings")
    profile = None
    if entry.get("profile") is not None:
        profile = _profile(where + ".profile", entry["profile"])
    return StoreSettings(
        scheme=scheme.lower(), root="", profile=profile, backend=backend.lower(), options=options
    )


def _profile(where: str, block: Any) -> StoreProfile:
    if not isinstance(block, dict):
        raise ValueError(f"{where} must be a mapping of StoreProfile fields")
    missing = sorted(_PROFILE_KEYS - set(block))
    if missing:
        raise ValueError(f"{where} is missing {', '.join(missing)}")
    values = dict(block)
    for name in ("stream_bytes_per_second", "part_bytes"):
        value = values[name]
        if isinstance(value, str):
            try:
                values[name] = parse_size(value)
            except ValueError as exc:
                raise ValueError(f"{where}.{name}: {exc}") from None
    if isinstance(values["request_seconds"], int) and not isinstance(
        values["request_seconds"], bool
    ):
        values["request_seconds"] = float(values["request_seconds"])
    try:
        return StoreProfile(**values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
