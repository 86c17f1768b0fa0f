"""FSDP2 with elastic data: a tiny GPT learns a copy task, on as many ranks as you launch.

    torchrun --nproc-per-node=2 -m examples.fsdp.main [key=value ...]     # or --nproc-per-node=1, 4

The functions below are the ``entry`` points of ``config.yaml`` (the same run as
``torchrun ... -m koochak.loop.cli --config examples/fsdp/config.yaml``). Each record is a
sequence whose second half repeats its first; ``ElasticBatches`` deals every rank its slice of
each global batch of ``data.batch_size`` records, and the loop stores the global record cursor in
every checkpoint. So a run stopped on 2 ranks and resumed on 1 or 4 continues with the very next
records, with its weights, optimizer state and EMA resharded exactly (docs/fsdp.md).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from koochak.loop.elastic import ElasticBatches
from torch import nn
from torch.nn import functional as F

CONFIG = os.path.join(os.path.dirname(__file__), "config.yaml")


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            *(z.transpose(1, 2) for z in (q, k, v)), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int = 64, depth: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_model(cfg: Any) -> nn.Module:
    torch.manual_seed(int(cfg.train.seed))  # every rank starts from the same weights
    return TinyGPT(int(cfg.data.vocab), int(cfg.data.seq_len))


class CopyTask:
    """``n`` records, each ``{"id", "tokens"}``: random tokens whose second half repeats the
    first. Record ``i`` depends only on ``(seed, i)``, so any rank can build any record."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        self.n, self.seq_len, self.vocab, self.seed = n, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        half = torch.randint(0, self.vocab, (self.seq_len // 2,), generator=g)
        return {"id": torch.tensor(i), "tokens": torch.cat([half, half])}


def _records(cfg: Any, seed_offset: int = 0) -> CopyTask:
    data = cfg.data
    return CopyTask(
        int(data.records), int(data.seq_len), int(data.vocab), int(data.seed) + seed_offset
    )


def train_dataset(cfg: Any) -> ElasticBatches:
    # The global batch is data.batch_size on any world size; the loop puts the cursor back.
    return ElasticBatches(
        _records(cfg), global_batch=int(cfg.data.batch_size), seed=int(cfg.data.seed)
    )


def eval_dataset(cfg: Any) -> list[dict[str, torch.Tensor]]:
    held_out = _records(cfg, seed_offset=1)  # other sequences; every rank evaluates all of them
    return [
        torch.utils.data.default_collate([held_out[i] for i in range(j, j + 32)]) for j in (0, 32)
    ]


def _loss(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(tokens[:, :-1]).float()
    half = tokens.shape[1] // 2  # only the repeated half is predictable
    target = tokens[:, 1:]
    loss = F.cross_entropy(
        logits[:, half - 1 :].reshape(-1, logits.shape[-1]), target[:, half - 1 :].reshape(-1)
    )
    accuracy = (logits[:, half - 1 :].argmax(-1) == target[:, half - 1 :]).float().mean()
    return loss, accuracy


def step_fn(model: nn.Module, batch: dict[str, torch.Tensor], ctx: Any) -> dict[str, torch.Tensor]:
    loss, accuracy = _loss(model, batch["tokens"])
    return {"loss": loss, "accuracy": accuracy}


def eval_fn(model: nn.Module, dataset: Any, ctx: Any) -> dict[str, float]:
    results = [_loss(model, batch["tokens"]) for batch in dataset]
    return {"loss": sum(float(r[0]) for r in results) / len(results),
            "accuracy": sum(float(r[1]) for r in results) / len(results)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from koochak.loop.cli import main as cli_main

    return cli_main(["--config", CONFIG, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
