"""One consolidated weights file for inference, from any checkpoint.

``export_weights(source, dest)`` reads a published checkpoint (the highest valid one in a
location, or the one of a given step; single file or written in parts by any number of FSDP
ranks), takes the model's weights (or an EMA shadow's) as global tensors, and publishes them as one
``torch.save`` file holding nothing but that state dict: ``torch.load(path, weights_only=True)``
loads it and ``model.load_state_dict`` takes it, on any machine, without Koochak. It is published
like a checkpoint (create-only, then ``<name>.ready.json`` with its size and SHA256, artifact ID
``weights/<name>``; provenance names the checkpoint it came from).

    python -m koochak.loop.checkpoint.export runs/exp0 exports/ [--step 1200] [--ema 0]
                                             [--dtype bf16] [--name model.pt]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from koochak.loop.checkpoint.format import checkpoint_name
from koochak.loop.checkpoint.publication import checkpoint_store, publication_path
from koochak.loop.checkpoint.resume import read_published, resolve_auto_resume
from koochak.storage import artifact
from koochak.storage.store import Store

__all__ = ["export_weights"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export_weights(
    source: str | os.PathLike[str] | Store,
    dest: str | os.PathLike[str] | Store,
    *,
    step: int | None = None,
    ema: int | None = None,
    dtype: str | None = None,
    name: str = "model.pt",
) -> artifact.Publication:
    """Publish the weights of a checkpoint in ``source`` as ``dest/name``; returns its Publication.

    ``step`` picks the checkpoint ``step{N:09d}.pt`` (verified against its manifest), else the
    highest valid one is used. ``ema`` picks that EMA shadow instead of the training weights.
    ``dtype`` (``bf16``, ``fp16``, ``fp32``) casts the floating-point tensors. Raises ValueError
    naming the checkpoint when there is none, it has no such shadow, or an option is wrong.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"export_weights: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    store = checkpoint_store(source)
    if step is None:
        found = resolve_auto_resume(store)
        if found is None:
            raise ValueError(f"{store.location}: no valid published checkpoint to export")
        path, ckpt = found
    else:
        path, ckpt = read_published(store, checkpoint_name(step))
    weights = _weights(ckpt, ema, path)
    if dtype is not None:
        weights = {
            k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in weights.items()
        }
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    provenance = {"checkpoint": path, "step": int(ckpt["step"]), "ema": ema, "dtype": dtype}
    return artifact.publish(
        checkpoint_store(dest), name, buffer.getbuffer(), kind="weights", latest=None,
        provenance=provenance,
    )  # fmt: skip


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
    # Contiguous copies of exactly these tensors: no views into larger storages get saved.
    return {str(k): v.detach().clone().contiguous() for k, v in state.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m koochak.loop.checkpoint.export",
        description="Export a checkpoint's weights as one weights_only-loadable file.",
    )
    parser.add_argument("source", help="checkpoint location (directory or scheme:// URI)")
    parser.add_argument("dest", help="where to publish the weights (directory or scheme:// URI)")
    parser.add_argument(
        "--step", type=int, default=None, help="checkpoint step (default: highest valid)"
    )
    parser.add_argument("--ema", type=int, default=None, help="export EMA shadow N instead")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--name", default="model.pt")
    args = parser.parse_args(argv)
    try:
        publication = export_weights(args.source, args.dest, step=args.step, ema=args.ema,
                                     dtype=args.dtype, name=args.name)  # fmt: skip
    except (ValueError, OSError, artifact.InvalidArtifact) as exc:
        print(f"export: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(
        f"{publication_path(checkpoint_store(args.dest), publication)} sha256={publication.sha256}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
