"""GPU smoke check: exercise koochak.loop's CUDA-only paths in one short run (~3 min on one GPU).

The CPU test suite cannot reach these paths (a real GradScaler, pinned-memory prefetch on a side
stream, torch.compile with Triton, the GPU health readings, CUDA RNG in checkpoints), so a session
that is lent a GPU runs this script once:

    uv run python tools/gpu_smoke.py --out $OUT            # every check
    uv run python tools/gpu_smoke.py --out $OUT --only amp,checkpoint

Each check prints one ``PASS``/``FAIL``/``SKIP`` line (with its details) and the whole run is
written to ``<out>/gpu_smoke.json`` (``version`` 1; one record per check with its status, seconds,
details and error). Without CUDA every check is SKIP and the exit code is 0, so the script itself
is tested on CPU (tools/tests/test_gpu_smoke.py). Exit code: 0 unless a check FAILED.

Checks (one function each, in this order):

- ``amp``: ``training_loop`` on CUDA with ``train.amp`` bf16 and fp16, grad accumulation and
  clipping; under fp16 an injected inf loss must make the GradScaler skip that update (weights
  unchanged) and lower its scale instead of raising.
- ``prefetch``: ``train.cuda_prefetch`` with pinned CPU batches and a ``prepare_batch_fn``: the
  batches arrive on the GPU with the same values, and training matches the run without prefetch.
- ``compile``: ``train.compile`` (Inductor/Triton) trains a tiny model and matches eager.
- ``health``: ``train.gpu_health_every`` with real readings: a healthy run passes; the reading
  fields are printed.
- ``checkpoint``: publish, ``resolve_auto_resume``, restore into a fresh CUDA model/optimizer,
  and the continuation is bit-identical to an uninterrupted run (dropout draws on the CUDA RNG).
- ``throughput``: samples ("tokens", one per row) per second of ``training_loop`` against a
  hand-written CUDA loop on a small MLP, measured in the same run; reported as a ratio.
- ``fsdp``: ``train.fsdp`` on a 1-rank NCCL world (the CPU suite uses gloo): a model of residual
  ``Block`` modules sharded per block trains like the unsharded run (grad accumulation, clipping,
  EMA), with ``cpu_offload`` too, and a CPU value reduced over NCCL comes back; bf16 mixed
  precision trains; under ``train.amp: fp16`` an injected inf loss makes the ShardedGradScaler
  skip that update; a checkpoint resumes bit-identically to an uninterrupted run, both handed
  over as a dict and found by ``resume="auto"`` (the collective sharded read onto the GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

SUMMARY_NAME = "gpu_smoke.json"
SUMMARY_VERSION = 1


class Skip(Exception):
    """Raised by a check that cannot run here (no CUDA); its message is the reason."""


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # PASS | FAIL | SKIP
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


# ----------------------------------------------------------------------------- shared pieces


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise Skip("no CUDA device")
    return torch.device("cuda")


def _mlp(seed: int, width: int = 64, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers)


def _batches(count: int, size: int = 32, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 16, generator=gen), torch.randn(size, 4, generator=gen))
        for _ in range(count)
    ]


def _mse_step(model: nn.Module, batch: Any, ctx: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    return {"loss": F.mse_loss(model(x).float(), y)}


def _cfg(out: Path, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "device": str(_cuda()),
        "max_steps": 10,
        "log_every": 1,
        "out_dir": str(out),
        "keep_last_k": None,
        "progress_bar": False,
    }
    cfg.update(overrides)
    return cfg


def _train(
    out: Path,
    model: nn.Module,
    data: Sequence[Any],
    step_fn: Callable[..., Any] = _mse_step,
    optimizer: torch.optim.Optimizer | None = None,
    hooks: dict[str, list[Callable[[dict[str, Any]], None]]] | None = None,
    **train: Any,
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Run ``training_loop``; return its terminal checkpoint and the metrics of every log line."""
    from koochak.loop import training_loop

    logged: list[dict[str, float]] = []
    all_hooks = dict(hooks or {})
    all_hooks["on_log"] = [
        *all_hooks.get("on_log", []),
        lambda info: logged.append(info["metrics"]),
    ]
    model = model.to(_cuda())
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = training_loop(
        model=model,
        dataset=data,
        step_fn=step_fn,
        optimizer=optimizer,
        train_cfg=_cfg(out, **train),
        hooks=all_hooks,
    )
    return ckpt, logged


def _max_diff(
    a: nn.Module | dict[str, torch.Tensor], b: nn.Module | dict[str, torch.Tensor]
) -> float:
    sa = a.state_dict() if isinstance(a, nn.Module) else a
    sb = b.state_dict() if isinstance(b, nn.Module) else b
    if sa.keys() != sb.keys():
        raise AssertionError(f"state dicts differ in keys: {sorted(sa)} vs {sorted(sb)}")
    return max(float((sa[k].float().cpu() - sb[k].float().cpu()).abs().max()) for k in sa)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


# ----------------------------------------------------------------------------- the checks


def check_amp(out: Path) -> dict[str, Any]:
    """bf16 and fp16 training with grad_accum=2 and clipping; fp16 skips an injected inf step."""
    _cuda()
    details: dict[str, Any] = {}
    data = _batches(24)  # 12 updates x 2 micro-batches

    seen_dtype: list[torch.dtype] = []

    def bf16_step(model: nn.Module, batch: Any, ctx: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        pred = model(x)
        seen_dtype.append(pred.dtype)
        return {"loss": F.mse_loss(pred.float(), y)}

    _, logged = _train(
        out / "bf16", _mlp(0), data, bf16_step, amp="bf16", grad_accum=2, grad_clip=0.5
    )
    _expect(seen_dtype[0] == torch.bfloat16, f"bf16: forward ran in {seen_dtype[0]}, not bfloat16")
    _expect(all(math.isfinite(m["loss"]) for m in logged), "bf16: a logged loss is not finite")
    _expect(
        "grad_clip_coefficient" in logged[-1], f"bf16: no clipping metrics in {sorted(logged[-1])}"
    )
    details["bf16_losses"] = [round(m["loss"], 5) for m in logged]

    bad_step = 5
    scales: dict[int, float] = {}
    weights: dict[int, torch.Tensor] = {}
    model = _mlp(0)

    def fp16_step(model: nn.Module, batch: Any, ctx: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        if ctx.micro_step == 0:
            scales[ctx.step] = ctx.scaler.get_scale()
        pred = model(x)
        seen_dtype.append(pred.dtype)
        loss = F.mse_loss(pred.float(), y)
        if ctx.step == bad_step and ctx.micro_step == 1:
            loss = loss * float("inf")  # every gradient becomes inf/NaN
        return {"loss": loss}

    def snapshot(info: dict[str, Any]) -> None:
        weights[info["step"]] = model[0].weight.detach().clone()

    seen_dtype.clear()
    _, logged = _train(
        out / "fp16",
        model,
        data,
        fp16_step,
        hooks={"on_step_end": [snapshot]},
        amp="fp16",
        grad_accum=2,
        grad_clip=0.5,
    )
    _expect(seen_dtype[0] == torch.float16, f"fp16: forward ran in {seen_dtype[0]}, not float16")
    _expect(len(weights) == 12, f"fp16: expected 12 completed updates, got {len(weights)}")
    _expect(
        torch.equal(weights[bad_step - 1], weights[bad_step]),
        f"fp16: update {bad_step} with inf gradients changed the weights (not skipped)",
    )
    # The GradScaler may also skip an early update on its own (its first scale is high), so the
    # checks are: the injected one was skipped, and training went on changing the weights after.
    skipped = [s for s in range(1, 12) if torch.equal(weights[s - 1], weights[s])]
    _expect(
        not torch.equal(weights[bad_step], weights[11]),
        f"fp16: no update after the skipped step {bad_step} changed the weights",
    )
    before, after = scales[bad_step], scales[bad_step + 1]
    _expect(
        after < before, f"fp16: scale {before} -> {after} after an inf step; expected it lowered"
    )
    finite = [m["loss"] for i, m in enumerate(logged) if i != bad_step]
    _expect(
        all(math.isfinite(v) for v in finite),
        "fp16: a loss other than the injected one is not finite",
    )
    details.update(fp16_scale_before=before, fp16_scale_after=after, fp16_skipped_updates=skipped)
    return details


def check_prefetch(out: Path) -> dict[str, Any]:
    """cuda_prefetch with pinned batches and a prepare_batch_fn equals the plain path."""
    _cuda()
    data = [(x.pin_memory(), y.pin_memory()) for x, y in _batches(12)]

    def prepare(batch: Any) -> Any:
        x, y = batch
        return x * 2.0 - 1.0, y  # GPU-side preprocessing (runs on the side stream when prefetching)

    def run(prefetch: bool) -> tuple[list[torch.Tensor], dict[str, Any], list[bool]]:
        seen: list[torch.Tensor] = []
        on_gpu: list[bool] = []

        def step(model: nn.Module, batch: Any, ctx: Any) -> dict[str, torch.Tensor]:
            on_gpu.append(batch[0].is_cuda and batch[1].is_cuda)
            seen.append(batch[0].detach().cpu())  # a sync here is fine: correctness, not speed
            return _mse_step(model, batch, ctx)

        from koochak.loop import training_loop

        model = _mlp(1).to(_cuda())
        ckpt = training_loop(
            model=model,
            dataset=data,
            step_fn=step,
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            train_cfg=_cfg(out / f"prefetch_{prefetch}", max_steps=12, cuda_prefetch=prefetch),
            prepare_batch_fn=prepare,
        )
        return seen, ckpt["model"], on_gpu

    plain, plain_model, _ = run(False)
    fetched, fetched_model, on_gpu = run(True)
    _expect(all(on_gpu) and len(on_gpu) == 12, f"prefetch: batches on GPU: {on_gpu}")
    _expect(len(plain) == len(fetched), f"prefetch: {len(fetched)} batches vs {len(plain)} without")
    for i, (a, b) in enumerate(zip(plain, fetched)):
        _expect(torch.equal(a, b), f"prefetch: batch {i} differs from the non-prefetched one")
        _expect(
            torch.equal(a, data[i][0] * 2.0 - 1.0), f"prefetch: batch {i} lost prepare_batch_fn"
        )
    diff = _max_diff(plain_model, fetched_model)
    _expect(diff <= 1e-6, f"prefetch: final weights differ by {diff} from the plain run")
    return {"batches": len(fetched), "max_weight_diff": diff}


def check_compile(out: Path) -> dict[str, Any]:
    """train.compile: true trains a tiny model and lands within tolerance of eager."""
    _cuda()
    data = _batches(20)
    started = time.perf_counter()
    eager, eager_log = _train(out / "eager", _mlp(2), data, max_steps=20)
    eager_s = time.perf_counter() - started
    started = time.perf_counter()
    compiled, compiled_log = _train(out / "compiled", _mlp(2), data, max_steps=20, compile=True)
    compiled_s = time.perf_counter() - started
    # Random targets: the loss need not fall in 20 steps, but the weights must have moved.
    moved = _max_diff(_mlp(2).state_dict(), compiled["model"])
    _expect(moved > 0.0, "compile: the compiled run left the weights at their initial values")
    _expect(all(math.isfinite(m["loss"]) for m in compiled_log), "compile: a loss is not finite")
    diff = _max_diff(eager["model"], compiled["model"])
    loss_diff = abs(eager_log[-1]["loss"] - compiled_log[-1]["loss"])
    _expect(diff < 1e-3, f"compile: weights differ from eager by {diff} (tolerance 1e-3)")
    _expect(loss_diff < 1e-3, f"compile: final loss differs from eager by {loss_diff}")
    return {
        "max_weight_diff": diff,
        "final_loss_diff": loss_diff,
        "eager_s": round(eager_s, 2),
        "compiled_s_incl_compile": round(compiled_s, 2),
    }


def check_health(out: Path) -> dict[str, Any]:
    """gpu_health_every with real readings: a healthy run finishes and records every check."""
    device = _cuda()
    from koochak.loop.health import HEALTH_SUMMARY_NAME, read_gpu_health

    reading = dataclasses.asdict(read_gpu_health(device))
    print(f"  reading: {json.dumps(reading, sort_keys=True)}", flush=True)
    run_dir = out / "health"
    _train(run_dir, _mlp(3), _batches(6), max_steps=6, gpu_health_every=2)
    lines = [json.loads(line) for line in (run_dir / HEALTH_SUMMARY_NAME).read_text().splitlines()]
    _expect(len(lines) == 3, f"health: expected 3 checks in 6 updates (every 2), got {len(lines)}")
    _expect(all(line["healthy"] for line in lines), f"health: a check was unhealthy: {lines}")
    _expect(all(line["reading"]["kernel_ok"] for line in lines), "health: the test kernel failed")
    absent = sorted(k for k, v in reading.items() if v is None)
    return {"reading": reading, "fields_absent_here": absent, "checks_recorded": len(lines)}


def check_checkpoint(out: Path) -> dict[str, Any]:
    """Publish, resolve_auto_resume, restore fresh, continue: bit-identical to uninterrupted."""
    _cuda()
    from koochak.loop.checkpoint import resolve_auto_resume
    from koochak.loop.seed import set_all_seeds

    total, cut = 10, 5
    data = _batches(total)

    def make_step(losses: dict[int, float]) -> Callable[..., dict[str, torch.Tensor]]:
        def step(model: nn.Module, batch: Any, ctx: Any) -> dict[str, torch.Tensor]:
            x, y = batch
            noise = torch.randn_like(x) * 0.01  # a second CUDA RNG consumer beside dropout
            loss = F.mse_loss(model(x + noise), y)
            losses[ctx.step] = float(loss.detach())
            return {"loss": loss}

        return step

    def fresh(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _mlp(seed, dropout=0.2).to(_cuda())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    whole_losses: dict[int, float] = {}
    set_all_seeds(7)
    model, opt = fresh(4)
    whole, _ = _train(out / "whole", model, data, make_step(whole_losses), opt, max_steps=total)

    first_losses: dict[int, float] = {}
    set_all_seeds(7)
    model, opt = fresh(4)
    _train(out / "split", model, data, make_step(first_losses), opt, max_steps=cut)

    # Disturb every RNG and start from different weights: the restore must undo both.
    set_all_seeds(999)
    torch.randn(100, device=_cuda())
    found = resolve_auto_resume(out / "split")
    _expect(found is not None, "checkpoint: resolve_auto_resume found nothing published")
    assert found is not None
    path, ckpt = found
    _expect(ckpt["next_step"] == cut, f"checkpoint: next_step {ckpt['next_step']}, expected {cut}")
    _expect(ckpt["rng"].get("cuda") is not None, "checkpoint: no CUDA RNG state captured")

    from koochak.loop import training_loop

    rest_losses: dict[int, float] = {}
    model, opt = fresh(123)
    resumed = training_loop(
        model=model,
        dataset=data[ckpt["next_step"] :],
        step_fn=make_step(rest_losses),
        optimizer=opt,
        train_cfg=_cfg(out / "split", max_steps=total),
        checkpoint_dict=ckpt,
        auto_resume_path=path,
    )
    for step in range(cut, total):
        _expect(
            rest_losses.get(step) == whole_losses[step],
            f"checkpoint: step {step} loss {rest_losses.get(step)} != uninterrupted {whole_losses[step]}",
        )
    diff = _max_diff(whole["model"], resumed["model"])
    _expect(diff == 0.0, f"checkpoint: resumed weights differ from uninterrupted by {diff}")
    opt_equal = all(
        torch.equal(a, b)
        for sa, sb in zip(
            whole["optimizer"]["state"].values(), resumed["optimizer"]["state"].values()
        )
        for a, b in zip(sa.values(), sb.values())
        if isinstance(a, torch.Tensor)
    )
    _expect(opt_equal, "checkpoint: resumed optimizer state differs from uninterrupted")
    return {"resumed_from": str(path), "steps_compared": total - cut, "max_weight_diff": diff}


def check_throughput(out: Path, steps: int = 300, repeats: int = 3) -> dict[str, Any]:
    """Samples/s of training_loop vs a hand-written CUDA loop on the same MLP and batches."""
    device = _cuda()
    warmup, log_every, batch, width = 50, 50, 256, 1024
    gen = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randn(batch, 256, generator=gen).to(device),
            torch.randn(batch, 16, generator=gen).to(device),
        )
        for _ in range(warmup + steps)
    ]

    def model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(256, width),
            nn.GELU(),
            nn.Linear(width, width),
            nn.GELU(),
            nn.Linear(width, 16),
        )
        model = model.to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def raw() -> float:
        model, opt = model_and_opt()
        start = 0.0
        for i, (x, y) in enumerate(data):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if (i + 1) % log_every == 0:
                loss.item()  # the same host read koochak does on a logging step
                if i + 1 == warmup:
                    start = time.perf_counter()
        return steps * batch / (time.perf_counter() - start)

    def koochak(run: int) -> float:
        marks: dict[int, float] = {}
        model, opt = model_and_opt()
        # on_log fires right after the logging step's host read, so both marks are synchronised.
        hook = {"on_log": [lambda info: marks.__setitem__(info["step"], time.perf_counter())]}
        _train(
            out / f"throughput{run}",
            model,
            data,
            _mse_step,
            opt,
            hooks=hook,
            max_steps=warmup + steps,
            log_every=log_every,
        )
        return steps * batch / (marks[warmup + steps - 1] - marks[warmup - 1])

    raw_rates, koochak_rates = [], []
    for run in range(repeats):  # interleaved, alternating order, so drift hits both alike
        if run % 2 == 0:
            raw_rates.append(raw())
            koochak_rates.append(koochak(run))
        else:
            koochak_rates.append(koochak(run))
            raw_rates.append(raw())
    raw_rate, koochak_rate = statistics.median(raw_rates), statistics.median(koochak_rates)
    ratio = koochak_rate / raw_rate
    print(
        f"  samples/s: raw {raw_rate:,.0f}, koochak {koochak_rate:,.0f}, ratio {ratio:.3f}",
        flush=True,
    )
    return {
        "raw_samples_per_s": raw_rate,
        "koochak_samples_per_s": koochak_rate,
        "ratio_koochak_over_raw": ratio,
        "size": f"MLP 256-{width}-{width}-16, batch {batch}, {steps} timed steps after {warmup}, {repeats} repeats",
    }


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _blocks(seed: int, width: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), _Block(width), _Block(width), nn.Linear(width, 8))


def check_fsdp(out: Path) -> dict[str, Any]:
    """FSDP2 with NCCL on one GPU: like unsharded, mixed precision, fp16 skip, exact resume."""
    device = _cuda()
    import torch.distributed as torch_dist

    out.mkdir(parents=True, exist_ok=True)
    created = not torch_dist.is_initialized()
    if created:  # a 1-rank world of our own; a launcher's group would be used as it is
        torch_dist.init_process_group(
            "nccl", init_method=f"file://{out / 'rendezvous'}", rank=0, world_size=1
        )
    try:
        gen = torch.Generator().manual_seed(3)
        data = [(torch.randn(32, 16, generator=gen), torch.randn(32, 8, generator=gen))
                for _ in range(12)]  # fmt: skip
        fsdp = {"enabled": True, "shard_modules": lambda m: isinstance(m, _Block)}
        common = {"grad_accum": 2, "grad_clip": 0.5, "ema": {"decay": 0.9}}

        def run(
            name: str, max_steps: int = 6, resume: Any = None, start: int = 0, **train: Any
        ) -> dict[str, Any]:
            """``resume``: a checkpoint dict, or "auto" (the loop's collective sharded lookup
            in ``out/name``, which reads each slab straight onto the GPU)."""
            from koochak.loop import training_loop
            from koochak.loop.fsdp import full

            start = resume.get("next_step", 0) if isinstance(resume, dict) else start
            return full(
                training_loop(  # under FSDP it returns DTensors: gather them
                    model=_blocks(1).to(device),
                    dataset=data[start * 2 :],
                    step_fn=_mse_step,
                    optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                    train_cfg=_cfg(out / name, max_steps=max_steps, **{**common, **train}),
                    checkpoint_dict=resume if isinstance(resume, dict) else None,
                    resume=resume if isinstance(resume, str) else None,
                )
            )

        plain = run("plain")
        sharded = run("sharded", fsdp=fsdp)
        diff = _max_diff(plain["model"], sharded["model"])
        _expect(diff < 1e-5, f"fsdp: sharded run differs from the unsharded one by {diff}")
        bf16 = run("bf16", fsdp={**fsdp, "mixed_precision": "bf16"})
        _expect(all(torch.isfinite(t).all() for t in bf16["model"].values()), "fsdp: bf16 NaN")

        skipped: list[float] = []

        def inf_at_2(model: nn.Module, batch: Any, ctx: Any) -> dict[str, torch.Tensor]:
            out = _mse_step(model, batch, ctx)
            return {"loss": out["loss"] * float("inf")} if ctx.step == 2 else out

        from koochak.loop import training_loop

        scaled = training_loop(
            model=_blocks(1).to(device), dataset=data, step_fn=inf_at_2,
            optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
            train_cfg=_cfg(out / "fp16", max_steps=4, amp="fp16",
                           fsdp={**fsdp, "mixed_precision": "fp16"}),
            hooks={"on_step_end": [lambda info: skipped.append(info["step"])]},
        )  # fmt: skip
        _expect(scaled["scaler"] is not None and scaled["scaler"]["scale"] < 65536.0,
                "fsdp: the ShardedGradScaler did not lower its scale after an inf loss")  # fmt: skip

        offloaded = run("offload", fsdp={**fsdp, "cpu_offload": True})
        offload_diff = _max_diff(plain["model"], offloaded["model"])
        _expect(offload_diff < 1e-5,
                f"fsdp: cpu_offload run differs from the unsharded one by {offload_diff}")  # fmt: skip
        from koochak.loop.fsdp import ShardReduction

        # An offloaded shard's norm lives on the CPU; NCCL reduces it on the GPU and hands it back.
        reduced = ShardReduction(device).sum(torch.tensor([2.0]))
        _expect(reduced.device.type == "cpu" and float(reduced) == 2.0,
                f"fsdp: a CPU value reduced over NCCL came back as {reduced}")  # fmt: skip

        whole = run("whole", fsdp=fsdp, ckpt_every=3)
        run("split", max_steps=3, fsdp=fsdp)
        from koochak.loop.checkpoint import resolve_auto_resume

        found = resolve_auto_resume(out / "split")
        _expect(found is not None, "fsdp: no checkpoint published")
        assert found is not None
        import shutil

        shutil.copytree(out / "split", out / "split_auto", symlinks=True)
        resumed = run("split", fsdp=fsdp, resume=found.checkpoint)
        exact = _max_diff(whole["model"], resumed["model"])
        _expect(exact == 0.0, f"fsdp: resumed weights differ from uninterrupted by {exact}")
        auto = run("split_auto", fsdp=fsdp, resume="auto", start=found.checkpoint["next_step"])
        auto_exact = _max_diff(whole["model"], auto["model"])
        _expect(auto_exact == 0.0,
                f"fsdp: resume='auto' weights differ from uninterrupted by {auto_exact}")  # fmt: skip
        return {"max_diff_vs_unsharded": diff, "cpu_offload_diff": offload_diff,
                "resume_diff": exact, "auto_resume_diff": auto_exact,
                "fp16_scale_after_inf": float(scaled["scaler"]["scale"])}  # fmt: skip
    finally:
        if created:
            torch_dist.destroy_process_group()


CHECKS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "amp": check_amp,
    "prefetch": check_prefetch,
    "compile": check_compile,
    "health": check_health,
    "checkpoint": check_checkpoint,
    "throughput": check_throughput,
    "fsdp": check_fsdp,
}


# ----------------------------------------------------------------------------- driver


def run_check(
    name: str, fn: Callable[[Path], dict[str, Any]], work: Path, debug: bool
) -> CheckResult:
    started = time.perf_counter()
    try:
        details = fn(work / name)
    except Skip as exc:
        return CheckResult(name, "SKIP", time.perf_counter() - started, error=str(exc))
    except Exception as exc:  # a failed check is a result, and the remaining checks still run
        if debug:
            traceback.print_exc()
        return CheckResult(
            name, "FAIL", time.perf_counter() - started, error=f"{type(exc).__name__}: {exc}"
        )
    return CheckResult(name, "PASS", time.perf_counter() - started, details=details)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Smoke-test koochak.loop's CUDA-only paths.")
    parser.add_argument("--out", required=True, help=f"folder for {SUMMARY_NAME}")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {','.join(CHECKS)}")
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback of a failed check"
    )
    args = parser.parse_args(argv)
    chosen = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = [n for n in chosen if n not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown check(s) {unknown}; expected names from {list(CHECKS)}")
    args.chosen = chosen
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    print(
        f"gpu_smoke: torch {torch.__version__}, "
        f"{torch.cuda.get_device_name(0) if cuda else 'no CUDA device'}",
        flush=True,
    )
    results: list[CheckResult] = []
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as work:
        for name in args.chosen:
            result = run_check(name, CHECKS[name], Path(work), args.debug)
            results.append(result)
            note = result.error or json.dumps(result.details, default=str)
            print(f"{result.status} {name} ({result.seconds:.1f}s): {note}", flush=True)
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    summary = {
        "version": SUMMARY_VERSION,
        "torch": torch.__version__,
        "cuda_available": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "counts": counts,
        "checks": [dataclasses.asdict(r) for r in results],
    }
    (out / SUMMARY_NAME).write_text(
        json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8"
    )
    print(
        f"gpu_smoke: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped",
        flush=True,
    )
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
