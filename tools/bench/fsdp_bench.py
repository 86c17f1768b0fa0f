"""FSDP2 in koochak: the loop's per-step cost against a hand-written FSDP2 loop (issue 23).

    python tools/bench/fsdp_bench.py                 # 2 gloo ranks on CPU, ~2 min
    python tools/bench/fsdp_bench.py --ranks 4 --steps 100 --repeats 7

Every rank builds the same tiny GPT (``Block`` modules sharded on their own, then the root), the
same AdamW and the same batches; the contenders run interleaved, in alternating order, several
times in one process group:

- ``raw``: forward, backward, ``optimizer.step()``, ``zero_grad``; the loss read to the host every
  50 steps (where koochak logs);
- ``koochak``: ``training_loop`` with ``train.fsdp`` on the same model, data and logging cadence
  (on logging steps it also measures the global gradient norm and gathers every rank's step time,
  which the figure therefore includes).

The figure is rank 0's median wall time per step and its ratio against ``raw`` measured in the
same run (and the best run against the best raw run: load only adds time). Target: <= 1.03x.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn
from torch.nn import functional as F

LOG_EVERY = 50
VOCAB, SEQ, DIM, DEPTH = 64, 32, 128, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def fresh() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyGPT()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batches(steps: int, local_batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    return [torch.randint(0, VOCAB, (local_batch, SEQ + 1), generator=g) for _ in range(steps)]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def run_raw(data: list[torch.Tensor]) -> float:
    model = fresh()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logged = []
    torch.distributed.barrier()
    start = time.perf_counter()
    for step, tokens in enumerate(data):
        loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % LOG_EVERY == 0 or step + 1 == len(data):
            logged.append(loss.item())
    return (time.perf_counter() - start) / len(data)


def run_koochak(data: list[torch.Tensor]) -> float:
    from koochak.loop import training_loop

    marks: dict[str, float] = {}

    def on_start(info: dict) -> None:
        torch.distributed.barrier()
        marks["start"] = time.perf_counter()

    def on_log(info: dict) -> None:
        marks["end"] = time.perf_counter()

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        training_loop(
            model=TinyGPT(),
            dataset=data,
            step_fn=lambda model, tokens, ctx: {"loss": loss_of(model, tokens)},
            optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3),
            train_cfg={
                "max_steps": len(data),
                "log_every": LOG_EVERY,
                "out_dir": out,
                "device": "cpu",
                "progress_bar": False,
                "shard_dataset": False,
                "warn_unsharded": False,
                "fsdp": {"enabled": True, "shard_modules": ["Block"]},
            },
            hooks={"on_train_start": [on_start], "on_log": [on_log]},
        )
    return (marks["end"] - marks["start"]) / len(data)


def rank_main(args: argparse.Namespace) -> None:
    from koochak.loop.dist import exit_distributed_process

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    data = batches(args.steps, args.local_batch)
    times: dict[str, list[float]] = {"raw": [], "koochak": []}
    contenders = {"raw": run_raw, "koochak": run_koochak}
    for repeat in range(args.repeats + 1):
        order = list(contenders) if repeat % 2 == 0 else list(contenders)[::-1]
        for name in order:
            seconds = contenders[name](data)
            if repeat:  # the first round warms up (allocator, thread pools)
                times[name].append(seconds)
    if torch.distributed.get_rank() == 0:
        print(json.dumps(times), flush=True)
    exit_distributed_process(0)


def report(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    raw_med, raw_min = statistics.median(times["raw"]), min(times["raw"])
    print(f"FSDP2 loop overhead: {args.ranks} gloo ranks, tiny GPT ({DEPTH} Blocks, dim {DIM}), "
          f"{args.steps} steps x {args.repeats} repeats, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{'contender':10} {'median ms/step':>15} {'ratio':>7} {'best ms/step':>13} {'ratio':>7}")
    for name, values in times.items():
        med, best = statistics.median(values), min(values)
        print(f"{name:10} {med * 1e3:15.2f} {med / raw_med:7.3f} {best * 1e3:13.2f} {best / raw_min:7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--local-batch", type=int, default=8)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.ranks):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.ranks),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank-main"],
                                      env=env, stdout=subprocess.PIPE, text=True))  # fmt: skip
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    report(json.loads(outputs[0].strip().splitlines()[-1]), args)


if __name__ == "__main__":
    main()
