"""MNIST with koochak, end to end: ``python -m examples.mnist.main --config examples/mnist/config.yaml``.

Extra arguments are dotlist overrides (``train.max_steps=200``). Data comes from the four raw IDX
files in ``data.data_dir`` (or its ``MNIST/raw`` subfolder, where torchvision puts them); when
they are missing, torchvision downloads them there first. The run logs TSV to stdout, CSV and
JSONL to ``train.out_dir`` (and W&B when ``wandb.enabled``), evaluates every
``train.eval_every`` updates and publishes numbered checkpoints. Rerunning the same command
resumes from the highest valid checkpoint, on the exact data stream an uninterrupted run would
have seen (``--resume none`` starts fresh).
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from koochak.loop import dist, load_config, to_container, training_loop
from koochak.loop.batch import shuffled_batches
from koochak.loop.checkpoint import resolve_auto_resume
from koochak.loop.cli import build_hooks, run_with_one_line_errors
from koochak.loop.optim import build_optimizer, build_scheduler
from koochak.loop.seed import make_worker_init_fn, set_all_seeds
from koochak.loop.sharding import shard_map_dataset
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

DEFAULT_CONFIG = Path(__file__).with_name("config.yaml")
# name -> (images file, labels file), as published and as torchvision stores them.
SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# The IDX type byte -> big-endian NumPy dtype.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_MEAN, _STD = 0.1307, 0.3081  # MNIST training-set pixel statistics


# ----------------------------------------------------------------------------- data


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed): 2 zero bytes, a type byte, the rank, then
    one big-endian uint32 per dimension and the big-endian data."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (magic bytes {raw[:4]!r})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: IDX header promises {expected} data bytes for shape {shape}, "
            f"file holds {len(raw) - header}"
        )
    return (
        np.frombuffer(raw, dtype=dtype, offset=header)
        .reshape(shape)
        .astype(dtype.newbyteorder("="))
    )


def _find(data_dir: Path, name: str) -> Path | None:
    for folder in (data_dir, data_dir / "MNIST" / "raw"):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def download_mnist(data_dir: str | os.PathLike[str]) -> None:
    """Fetch MNIST with torchvision into ``data_dir/MNIST/raw`` (needs network and torchvision)."""
    try:
        from torchvision.datasets import MNIST
    except ImportError:
        raise ImportError(
            f"MNIST IDX files are not in {data_dir} and torchvision is not installed to download "
            "them: pip install torchvision, or put the four IDX files in data.data_dir"
        ) from None
    for train in (True, False):
        MNIST(root=str(data_dir), train=train, download=True)


def load_mnist(
    data_dir: str | os.PathLike[str], split: str, *, download: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images float32 [N, 1, 28, 28] normalised, labels int64 [N])`` for ``train`` or ``test``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    data_dir = Path(data_dir)
    paths = [_find(data_dir, name) for name in SPLITS[split]]
    if None in paths and download:
        download_mnist(data_dir)
        paths = [_find(data_dir, name) for name in SPLITS[split]]
    missing = [name for name, path in zip(SPLITS[split], paths) if path is None]
    if missing:
        raise FileNotFoundError(f"data.data_dir={data_dir}: missing MNIST file(s) {missing}")
    images, labels = (read_idx(path) for path in paths)  # type: ignore[arg-type]
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(
            f"{paths[0]} / {paths[1]}: expected images [N, H, W] and labels [N], got "
            f"{images.shape} and {labels.shape}"
        )
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    return (x - _MEAN) / _STD, torch.from_numpy(labels.astype(np.int64))


# ----------------------------------------------------------------------------- model and steps


class MnistNet(nn.Module):
    """Two conv blocks and a linear head: ~0.1M parameters, >98% test accuracy in a few epochs."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 7 * 7, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def step_fn(model: nn.Module, batch: Any, ctx: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    return {"loss": loss, "acc": (logits.argmax(-1) == y).float().mean().detach()}


def eval_fn(model: nn.Module, batches: Any, ctx: Any) -> dict[str, float]:
    """Loss and accuracy over every eval batch (summed on the device, read once at the end)."""
    total_loss = torch.zeros((), device=ctx.device)
    correct = torch.zeros((), device=ctx.device)
    count = 0
    for x, y in batches:
        x, y = x.to(ctx.device), y.to(ctx.device)
        with ctx.autocast():
            logits = model(x)
        total_loss += F.cross_entropy(logits.float(), y, reduction="sum")
        correct += (logits.argmax(-1) == y).sum()
        count += len(y)
    return {"loss": total_loss.item() / count, "acc": correct.item() / count}


# ----------------------------------------------------------------------------- run


def _resume(cfg: DictConfig, mode: str) -> tuple[str | None, dict[str, Any] | None]:
    if mode != "auto":
        return None, None
    found = resolve_auto_resume(str(cfg.train.checkpoint_dir or cfg.train.out_dir))
    return (None, None) if found is None else (str(found[0]), found[1])


def train_loader(
    cfg: DictConfig, x: torch.Tensor, y: torch.Tensor, *, start_step: int = 0
) -> DataLoader:
    """Endless shuffled training batches for this rank, starting at update ``start_step``.

    Pass p is shuffled with seed ``(train.seed, p)`` (``shuffled_batches``), so batch b is the same
    in every run: a resumed run continues the data stream exactly where its checkpoint left it.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seed = int(cfg.train.seed)
    train_set: Any = TensorDataset(x, y)
    if world_size > 1:
        # Equal lengths per rank, so no rank waits in an all-reduce for a step the others skip.
        train_set = shard_map_dataset(train_set, rank, world_size, drop_remainder=True)
    first = start_step * int(cfg.train.grad_accum)  # micro-batches already consumed
    order = shuffled_batches(len(train_set), int(cfg.data.batch_size), seed=seed, start=first)
    return DataLoader(
        train_set,
        batch_sampler=(idx.tolist() for idx in order),  # endless: max_steps decides when to stop
        num_workers=int(cfg.data.num_workers),
        worker_init_fn=make_worker_init_fn(seed, rank),
        # Its own generator: seeding workers must not draw from the RNG the checkpoint restored.
        generator=torch.Generator().manual_seed(seed + rank),
    )


def run(cfg: DictConfig, *, resume: str = "auto") -> dict[str, Any]:
    """Train on MNIST as ``cfg`` says; return the terminal checkpoint dict."""
    train, data = cfg.train, cfg.data
    set_all_seeds(int(train.seed) + dist.get_rank())  # per-rank streams: no shared randomness

    train_x, train_y = load_mnist(data.data_dir, "train")
    test_x, test_y = load_mnist(data.data_dir, "test")
    # Resume before building the data stream: it starts at the checkpoint's next_step.
    resume_path, checkpoint = _resume(cfg, resume)
    start_step = int(checkpoint["next_step"]) if checkpoint is not None else 0
    loader = train_loader(cfg, train_x, train_y, start_step=start_step)
    eval_batches = DataLoader(TensorDataset(test_x, test_y), batch_size=512)

    model = MnistNet()
    optimizer = build_optimizer(model.parameters(), cfg.optim.optimizer)
    scheduler = build_scheduler(optimizer, cfg.optim.scheduler, train)
    return training_loop(
        model=model,
        dataset=loader,
        step_fn=step_fn,
        optimizer=optimizer,
        scheduler=scheduler,
        train_cfg=train,
        config_json=to_container(cfg),
        checkpoint_dict=checkpoint,
        eval_dataset=eval_batches,
        eval_fn=eval_fn,
        hooks=build_hooks(cfg),
        resume=resume,
        auto_resume_path=resume_path,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotlist overrides")
    parser.add_argument("--resume", choices=("auto", "none"), default="auto")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, *, force_ddp: bool = False) -> dict[str, Any]:
    """Parse ``argv``, load the config and train; ``force_ddp`` is the DDP launcher's switch."""
    args = parse_args(argv)
    overrides = list(args.overrides) + (["train.ddp=true"] if force_ddp else [])
    cfg = load_config(args.config, overrides)
    return run(cfg, resume=args.resume)


def cli(argv: Sequence[str] | None = None, *, force_ddp: bool = False) -> int:
    """``main`` with one-line errors on stderr (tracebacks only with ``--debug``)."""
    return run_with_one_line_errors(
        "examples.mnist", lambda args: main(args, force_ddp=force_ddp), argv
    )


if __name__ == "__main__":
    sys.exit(cli())
