"""One consolidated weights file for inference, from any checkpoint, and the model's config.

``export_weights(source, dest)`` reads a published checkpoint (the highest valid one in a
location, or the one of a given step; single file or written in parts by any number of FSDP
ranks), takes the model's weights (or an EMA shadow's) as global tensors, and publishes them in
``dest``:

- the weights as one file: ``model.pt`` (``torch.save`` of the state dict and nothing else:
  ``torch.load(path, weights_only=True)`` loads it and ``model.load_state_dict`` takes it, on
  any machine, without Koochak), or with ``format="safetensors"`` ``model.safetensors``,
  streamed tensor by tensor (``safetensors_out``; the ``koochak-loop[safetensors]`` extra);
- beside it ``model.yaml``, the run's ``model:`` section and ``entry`` from the checkpoint's
  recorded config, so inference can rebuild the model (left out, with one line, when the
  checkpoint recorded no config).

Each is published like a checkpoint (create-only, then ``<name>.ready.json`` with its size and
SHA256, artifact ID ``weights/<name>`` / ``config/<name>``; the provenance names the checkpoint
and its SHA256). Exports are create-only: a destination file that exists and was not written by
the same export of the same checkpoint is refused (``ExportExists``; exit 2 from the command)
unless ``replace=True`` (``--replace``); the same export again is a no-op.

    koochak-export runs/exp0 exports/ [--step 1200] [--ema 0] [--dtype bf16]
                   [--format torch|safetensors] [--name model.pt] [--replace]

(``python -m koochak.loop.checkpoint.export`` is the same command.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import yaml
from koochak.loop.checkpoint.commit import publication_path
from koochak.loop.checkpoint.format import checkpoint_name
from koochak.loop.checkpoint.layouts import read_checkpoint
from koochak.loop.checkpoint.publication import checkpoint_store
from koochak.loop.checkpoint.resume import highest_valid
from koochak.loop.checkpoint.safetensors_out import (
    check_names,
    check_written,
    require_safetensors,
    safetensors_chunks,
)
from koochak.loop.checkpoint.serialization import stream_torch_save
from koochak.storage import artifact
from koochak.storage.store import Store, exists

__all__ = ["export_weights", "ExportExists", "FORMATS"]

log = logging.getLogger("koochak.loop.checkpoint")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORMATS = {"torch": ".pt", "safetensors": ".safetensors"}
CONFIG_VERSION = 1
# What makes two exports "the same export of the same checkpoint", per file.
_WEIGHTS_SAME = ("checkpoint_sha256", "step", "ema", "dtype", "format")
_CONFIG_SAME = ("checkpoint_sha256", "step")


class ExportExists(ValueError):
    """The destination holds a file this export did not write (another checkpoint's export, a
    file of the user's); nothing was changed. ``replace=True`` (``--replace``) replaces it."""


def export_weights(
    source: str | os.PathLike[str] | Store,
    dest: str | os.PathLike[str] | Store,
    *,
    step: int | None = None,
    ema: int | None = None,
    dtype: str | None = None,
    name: str | None = None,
    format: str = "torch",
    replace: bool = False,
) -> artifact.Publication:
    """Publish the weights of a checkpoint in ``source`` as ``dest/name``; returns its Publication.

    ``step`` picks the checkpoint ``step{N:09d}.pt`` (verified against its manifest), else the
    highest valid one is used. ``ema`` picks that EMA shadow instead of the training weights.
    ``dtype`` (``bf16``, ``fp16``, ``fp32``) casts the floating-point tensors. ``format`` is
    ``torch`` (``model.pt``) or ``safetensors`` (``model.safetensors``); ``name`` overrides the
    file name, and the config goes beside it as ``<stem>.yaml``. Raises ValueError naming the
    checkpoint when there is none, it has no such shadow, or an option is wrong; ExportExists
    (a ValueError) when ``dest`` holds one of those files from something else, unless
    ``replace``. Exporting the same checkpoint the same way again returns the existing
    publication and writes nothing.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export_weights: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if format not in FORMATS:
        raise ValueError(
            f"export_weights: format must be one of {', '.join(FORMATS)}, got {format!r}"
        )
    if format == "safetensors":
        require_safetensors()  # before any work: a missing extra is one line, not a traceback
    name = name or "model" + FORMATS[format]
    config_name = os.path.splitext(name)[0] + ".yaml"
    if config_name == name:
        raise ValueError(f"export_weights: name {name!r} would be the config's own name")
    store = checkpoint_store(source)
    path, ckpt, sha256 = _checkpoint(store, step)
    provenance = {"checkpoint": path, "checkpoint_sha256": sha256, "step": int(ckpt["step"]),
                  "ema": ema, "dtype": dtype, "format": format}  # fmt: skip
    state = _weights(ckpt, ema, path)
    if format == "safetensors":
        check_names(list(state))  # before anything is published
    config = _config_doc(ckpt, name, provenance)
    target = checkpoint_store(dest)
    found = {name: _found(target, name, provenance, _WEIGHTS_SAME)}
    if found[name] == "same" and format == "safetensors":
        found[name] = _reads_back(target, name, list(state))
    if config is not None:
        found[config_name] = _found(target, config_name, provenance, _CONFIG_SAME)
    if not replace:
        for key, what in found.items():
            if what not in ("absent", "same"):
                by = "" if what.startswith("does not read back") else (
                    f", not by this export of {path}")  # fmt: skip
                raise ExportExists(
                    f"{target.location.rstrip('/')}/{key} exists and {what}{by}; nothing was "
                    "changed (pass --replace / replace=True to replace it)"
                )
    if config is not None and (replace or found[config_name] != "same"):
        artifact.publish(target, config_name, config, kind="config", latest=None,
                         provenance=provenance)  # fmt: skip
    elif config is None:
        log.warning("%s recorded no config: exporting the weights without %s", path, config_name)
    if not replace and found[name] == "same":
        publication, _ = artifact.read_manifest(target, name)
        log.info("%s/%s is already this export of %s", target.location, name, path)
        return publication
    cast = DTYPES[dtype] if dtype is not None else None
    if format == "safetensors":
        metadata = {"format": "pt", "koochak_checkpoint_sha256": sha256,
                    "koochak_step": str(provenance["step"])}  # fmt: skip
        data = safetensors_chunks(state, dtype=cast, metadata=metadata)
    else:
        data = stream_torch_save(_torch_state(state, cast))
    try:
        publication = artifact.publish(target, name, data, kind="weights", latest=None,
                                       provenance=provenance)  # fmt: skip
    finally:
        data.close()
    if format == "safetensors" and publication.path is not None:
        try:
            check_written(publication.path, list(state))
        except ValueError as exc:  # never left committed as a good export
            artifact.unpublish(target, name)
            raise ValueError(f"{exc}; the export was withdrawn") from None
    return publication


def _reads_back(target: Store, name: str, keys: list[str]) -> str:
    """``"same"`` when the committed safetensors file reads back with ``keys``, else what it is."""
    try:
        publication, _ = artifact.read_manifest(target, name)
        if publication.path is not None:
            check_written(publication.path, keys)
    except (ValueError, OSError) as exc:
        return f"does not read back ({' '.join(str(exc).split())[:200]})"
    return "same"


def _checkpoint(store: Store, step: int | None) -> tuple[str, dict[str, Any], str]:
    """``(path, checkpoint, SHA256 of its commit)``: the given step, or the highest valid."""
    if step is None:
        found = highest_valid([store])
        if found is None:
            raise ValueError(f"{store.location}: no valid published checkpoint to export")
        path = publication_path(found.store, found.publication)
        return path, found.checkpoint, found.publication.sha256
    name = checkpoint_name(step)
    publication, data = artifact.read_verified(store, name)
    path = publication_path(store, publication)
    return path, read_checkpoint(store, name, data, path), publication.sha256


def _found(
    target: Store, key: str, provenance: Mapping[str, Any], same: Sequence[str]
) -> str:
    """``"absent"``, ``"same"`` (committed by an export of these ``same`` fields), or what else
    holds ``key`` (for the refusal: "was committed by another export", "is a file ...")."""
    manifest = exists(target, key + artifact.READY_SUFFIX)
    if not manifest:
        return "is a file without a ready manifest" if exists(target, key) else "absent"
    try:
        committed, raw = artifact.read_manifest(target, key)
        recorded = json.loads(raw).get("provenance") or {}
    except (ValueError, OSError):
        return "has an unreadable ready manifest"
    if not exists(target, key):
        return "has a ready manifest whose file is missing"
    if all(recorded.get(field) == provenance[field] for field in same):
        return "same"
    kind = committed.artifact_id.partition("/")[0]
    other = recorded.get("checkpoint") or "something else"
    return f"was committed as {kind} of {other} (step {recorded.get('step')})"


def _weights(ckpt: dict[str, Any], ema: int | None, path: str | None) -> dict[str, torch.Tensor]:
    if ema is None:
        state = ckpt["model"]
    else:
        shadows = (ckpt.get("ema") or {}).get("shadows") or []
        if not 0 <= ema < len(shadows):
            raise ValueError(
                f"{path}: has {len(shadows)} EMA shadow(s); --ema {ema} does not exist"
            )
        state = shadows[ema]["state_dict"]
    return {str(k): v for k, v in state.items()}


def _torch_state(
    state: Mapping[str, torch.Tensor], cast: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """The tensors to ``torch.save``: cast where asked, and copied only where a tensor is a view
    into a larger storage (``torch.save`` would write the whole storage)."""
    out = {}
    for key, value in state.items():
        value = value.detach()
        if cast is not None and value.is_floating_point():
            value = value.to(cast)
        compact = value.untyped_storage().nbytes() == value.numel() * value.element_size()
        out[key] = value if compact and value.is_contiguous() else value.clone().contiguous()
    return out


def _config_doc(
    ckpt: Mapping[str, Any], weights: str, provenance: Mapping[str, Any]
) -> bytes | None:
    """``model.yaml``: the run's ``model:`` section and ``entry``, or None without a config."""
    config = ckpt.get("config")
    if not isinstance(config, Mapping):
        return None
    doc = {
        "version": CONFIG_VERSION,
        "weights": weights,
        "checkpoint": provenance["checkpoint"],
        "checkpoint_sha256": provenance["checkpoint_sha256"],
        "step": provenance["step"],
        "model": dict(config.get("model") or {}),
        "entry": dict(config.get("entry") or {}),
    }
    text = "# Written by koochak-export: how to rebuild the model these weights belong to.\n"
    return (text + yaml.safe_dump(doc, sort_keys=False)).encode("utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="koochak-export",
        description="Export a checkpoint's weights as one weights_only-loadable file (or "
        "safetensors), with the run's model config beside it. Create-only.",
    )
    parser.add_argument("source", help="checkpoint location (directory or scheme:// URI)")
    parser.add_argument("dest", help="where to publish the weights (directory or scheme:// URI)")
    parser.add_argument(
        "--step", type=int, default=None, help="checkpoint step (default: highest valid)"
    )
    parser.add_argument("--ema", type=int, default=None, help="export EMA shadow N instead")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--format", choices=list(FORMATS), default="torch")
    parser.add_argument("--name", default=None, help="file name (default: model.pt or "
                        "model.safetensors)")  # fmt: skip
    parser.add_argument("--replace", action="store_true",
                        help="replace files in DEST that something else wrote")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        publication = export_weights(args.source, args.dest, step=args.step, ema=args.ema,
                                     dtype=args.dtype, name=args.name, format=args.format,
                                     replace=args.replace)  # fmt: skip
    except ExportExists as exc:
        print(f"koochak-export: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (ValueError, OSError, ImportError) as exc:  # InvalidArtifact is a ValueError
        print(f"koochak-export: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(
        f"{publication_path(checkpoint_store(args.dest), publication)} sha256={publication.sha256}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
