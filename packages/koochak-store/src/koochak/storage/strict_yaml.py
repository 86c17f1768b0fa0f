"""One strict YAML reader for every file a person writes for Koochak (training configs, the stores
file, environment profiles): safe tags only, a duplicate mapping key is an error naming it (never
last-one-wins), a file that is not UTF-8 text or is larger than ``max_bytes`` is refused, and
anchors/aliases are allowed only while the document they expand to stays under ``max_nodes``
nodes. A 1 KB "billion laughs" file (nine aliases per level, a handful of levels) is refused in
microseconds instead of keeping a constructor, OmegaConf or a validator busy for minutes."""

from __future__ import annotations

import os
from typing import Any

import yaml

MAX_YAML_BYTES = 4 << 20
"""Default size limit: a training config or profile is kilobytes."""
MAX_YAML_NODES = 10_000
"""Default bound on the expanded document: every scalar, list and mapping, aliases counted each
time they are used."""

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys instead of keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:  # '<<: *base' merges; explicit keys may override it
            continue
        key = loader.construct_object(key_node)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key: construct_mapping below says so
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _expanded_size(node: yaml.Node, memo: dict[int, int], limit: int, where: str) -> int:
    """Nodes the document holds once every alias is expanded; memoised on node identity, so
    the count itself costs one visit per distinct node however large the expansion."""
    known = memo.get(id(node))
    if known is not None:
        return known
    memo[id(node)] = 0  # a recursive alias (anchor inside itself) counts once, not forever
    size = 1
    if isinstance(node, yaml.SequenceNode):
        for child in node.value:
            size += _expanded_size(child, memo, limit, where)
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            size += _expanded_size(key, memo, limit, where)
            size += _expanded_size(value, memo, limit, where)
    if size > limit:
        raise ValueError(
            f"{where}: the YAML expands to more than {limit:,} nodes (aliases re-use anchored "
            "content each time they appear); write the values out or use fewer aliases"
        )
    memo[id(node)] = size
    return size


def loads_yaml(
    text: str | bytes,
    where: str,
    *,
    max_bytes: int = MAX_YAML_BYTES,
    max_nodes: int = MAX_YAML_NODES,
) -> Any:
    """Parse one YAML document strictly. Every failure is a ``ValueError`` whose message starts
    with ``where`` (a file name, usually) and fits on one line."""
    if len(text) > max_bytes:
        raise ValueError(
            f"{where}: {len(text):,} bytes is larger than the {max_bytes:,}-byte limit"
        )
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{where}: not a UTF-8 text file (byte {exc.start} is {text[exc.start]:#04x}); "
                "is this the right file?"
            ) from None
    if "\x00" in text:
        raise ValueError(
            f"{where}: not a text file (it contains NUL bytes); is this the right file?"
        )
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, max_nodes, where)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {_one_line(exc)}") from None
    except RecursionError:
        raise ValueError(f"{where}: YAML nested too deeply") from None
    finally:
        loader.dispose()


def load_yaml_file(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = MAX_YAML_BYTES,
    max_nodes: int = MAX_YAML_NODES,
) -> Any:
    """Read and parse ``path`` with :func:`loads_yaml`; the size is checked before reading.
    ``FileNotFoundError`` and other ``OSError`` pass through for the caller to word."""
    where = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise ValueError(f"{where}: {size:,} bytes is larger than the {max_bytes:,}-byte limit")
        data = f.read(max_bytes + 1)
    return loads_yaml(data, where, max_bytes=max_bytes, max_nodes=max_nodes)


def _one_line(exc: yaml.YAMLError) -> str:
    return " ".join(str(exc).split())
