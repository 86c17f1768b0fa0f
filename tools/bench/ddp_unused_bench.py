"""What ``train.find_unused_parameters`` costs the DDP GAN recipe (issue 38 leftover).

The recipe's update has two backward passes; D's reaches none of G's parameters, so DDP needs the
flag (docs/loop.md, "A second backward under DDP"). On 2 gloo ranks, interleaved in one run, a
GAN-shaped model (G and D each ``--width`` wide) is updated two ways:

- ``flag``: DDP with ``find_unused_parameters=True``, the recipe's update as written;
- ``nosync`` (the baseline): DDP without the flag, D's backward under ``no_sync`` followed by a
  hand-written all-reduce of D's gradients, G's backward synced as usual.

Printed: bytes all-reduced per update (counted in a DDP communication hook and at the
hand-written all-reduce: a counter, not a time), seconds per update as a ratio flag / nosync
(best of ``--blocks`` blocks), and whether both end with the same weights.

``uv run python tools/bench/ddp_unused_bench.py [--width 1024] [--updates 20] [--blocks 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _task(width: int, updates: int, blocks: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.functional import binary_cross_entropy_with_logits as bce
    from torch.nn.parallel import DistributedDataParallel as DDP

    class GAN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.G = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 2))
            self.D = nn.Sequential(nn.Linear(2, width), nn.ReLU(), nn.Linear(width, 1))

        def forward(self, x, part):
            return self.D(self.G(x)) if part == "GD" else getattr(self, part)(x)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    sent = [0]

    def counting(state, bucket):
        sent[0] += bucket.buffer().numel() * bucket.buffer().element_size()
        return (
            dist.all_reduce(bucket.buffer().div_(world), async_op=True)
            .get_future()
            .then(lambda fut: fut.value()[0])
        )

    def build(flag: bool):
        torch.manual_seed(0)
        raw = GAN()
        model = DDP(raw, find_unused_parameters=flag)
        model.register_comm_hook(None, counting)
        opt_g = torch.optim.Adam(raw.G.parameters(), lr=1e-3)
        opt_d = torch.optim.Adam(raw.D.parameters(), lr=1e-3)
        return raw, model, opt_g, opt_d

    def update(model, raw, opt_g, opt_d, step: int, flag: bool) -> None:
        g = torch.Generator().manual_seed(1000 * rank + step)
        real = torch.randn(64, 2, generator=g)
        z = torch.randn(64, 16, generator=g)
        with torch.no_grad():
            fake = model(z, "G")
        ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)
        opt_d.zero_grad(set_to_none=True)
        if flag:
            bce(model(torch.cat([real, fake]), "D"), torch.cat([ones, zeros])).backward()
        else:
            with model.no_sync():
                bce(model(torch.cat([real, fake]), "D"), torch.cat([ones, zeros])).backward()
            grads = [p.grad for p in raw.D.parameters()]
            flat = torch.cat([t.reshape(-1) for t in grads]).div_(world)
            sent[0] += flat.numel() * flat.element_size()
            dist.all_reduce(flat)
            offset = 0
            for t in grads:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        opt_d.step()
        bce(model(z, "GD"), ones).backward()
        opt_g.step()
        raw.zero_grad(set_to_none=True)

    runs = {name: build(name == "flag") for name in ("flag", "nosync")}
    best = {name: float("inf") for name in runs}
    sent_per_update = {}
    for block in range(blocks):
        for name, (raw, model, opt_g, opt_d) in runs.items():
            sent[0] = 0
            dist.barrier()
            began = time.perf_counter()
            for step in range(updates):
                update(model, raw, opt_g, opt_d, block * updates + step, name == "flag")
            dist.barrier()
            best[name] = min(best[name], (time.perf_counter() - began) / updates)
            sent_per_update[name] = sent[0] / updates
    same = all(
        torch.equal(a, b)
        for a, b in zip(runs["flag"][0].parameters(), runs["nosync"][0].parameters())
    )
    params = {part: sum(p.numel() for p in getattr(runs["flag"][0], part).parameters())
              for part in ("G", "D")}  # fmt: skip
    dist.destroy_process_group()
    return {"params": params, "bytes_per_update": sent_per_update, "s_per_update": best,
            "same_weights": same}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--task", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        print(json.dumps(_task(args.width, args.updates, args.blocks)), flush=True)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _gloo_world import run_world

    out = run_world(os.path.abspath(__file__), 2, "gan",
                    ["--width", str(args.width), "--updates", str(args.updates),
                     "--blocks", str(args.blocks)])  # fmt: skip
    sent, secs = out["bytes_per_update"], out["s_per_update"]
    print(f"GAN on 2 gloo ranks: G {out['params']['G']:,} parameters, D {out['params']['D']:,}")
    print(f"all-reduced per update: flag {sent['flag']:,.0f} B, nosync (baseline) "
          f"{sent['nosync']:,.0f} B: {sent['flag'] / sent['nosync']:.2f}x")  # fmt: skip
    print(f"time per update: flag / nosync = {secs['flag'] / secs['nosync']:.2f}x "
          f"(best of {args.blocks} blocks of {args.updates})")  # fmt: skip
    print(f"same weights at the end: {out['same_weights']}")


if __name__ == "__main__":
    main()
