"""`training_loop`: the one function that owns the repetitive mechanics of training.

It reads in the order it runs. Setup once: device -> [resume lookup] -> [shard] -> [FSDP] ->
optimizer -> attempt record -> start hook -> compile -> [DDP] -> [restore]. Then, per update:
batch -> micro-steps x grad_accum (``update_fn``; ``update.standard_update`` by default) ->
gradient gate -> update (optimizer -> scaler -> [EMA] -> scheduler) -> observe (hooks, log) ->
[GPU health] -> maybe eval -> maybe save -> [evacuate]. Finally the terminal state is packed into a resume-ready
checkpoint, saved, and returned. Checkpoints are one component the loop opens once
(``checkpoint.run_checkpoints``: the claim on the run's locations, the checkpoint to continue
from, its restore, every save and the release); the rest in ``evacuation``, ``health``, ``ddp``
and ``fsdp``.

The user's ``step_fn(model, batch, ctx) -> {"loss": Tensor, ...}`` owns the model semantics;
an ``update_fn`` (``koochak.loop.update``: its contract) may own the whole update's gradients,
and ``state`` adds the user's own stateful objects to every checkpoint.
Every optional behaviour is a helper call or a hook. On the ordinary path the loop adds no
device->host synchronisation at all, except one scalar per step when clipping is on and one
batched read of the logged scalars on logging steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from itertools import chain, repeat
from typing import Any

import torch
from koochak.loop import ddp, dist, fsdp, run_history
from koochak.loop.batch import to_device
from koochak.loop.checkpoint.run_checkpoints import RunCheckpoints, open_checkpoints
from koochak.loop.config import TrainConfig, resolve_train_config
from koochak.loop.device import get_device, get_lr
from koochak.loop.elastic import elastic_cursor
from koochak.loop.ema import ModelEma, make_model_ema
from koochak.loop.evacuation import Evacuated, EvacuationController, make_evacuation
from koochak.loop.health import GpuHealthWatchdog, GpuUnhealthy, make_gpu_health
from koochak.loop.hooks import StopTraining, emit, merge
from koochak.loop.init_from import apply_init_weights, load_init_weights
from koochak.loop.metric_reduction import CountedBatches, reduce_eval, reduce_logged
from koochak.loop.precision import Scaler, autocast_factory
from koochak.loop.prefetch import cuda_prefetch
from koochak.loop.resumable import say_if_not_resumable
from koochak.loop.throughput import make_throughput_hooks
from koochak.loop.update import (
    DataEnd,
    GradientGate,
    StepContext,
    UpdateFn,
    bind_update,
    standard_update,
    to_host,
)
from koochak.loop.user_state import StateArg, resolve_state, untracked_parameters

_NULL = contextlib.nullcontext()


def training_loop(
    *,
    model: torch.nn.Module,
    dataset: Iterable[Any],
    step_fn: Callable[[torch.nn.Module, Any, StepContext], Mapping[str, Any]] | None = None,
    optimizer: torch.optim.Optimizer | Callable[[torch.nn.Module], torch.optim.Optimizer],
    scheduler: Any = None,
    train_cfg: Mapping[str, Any] | TrainConfig,
    config_json: Mapping[str, Any] | None = None,
    checkpoint_dict: dict[str, Any] | None = None,
    eval_dataset: Iterable[Any] | None = None,
    eval_fn: Callable[[torch.nn.Module, Any, StepContext], Mapping[str, Any]] | None = None,
    hooks: Mapping[str, list[Callable[[dict[str, Any]], None]]] | None = None,
    prepare_batch_fn: Callable[[Any], Any] | None = None,
    resume: str | None = None,
    auto_resume_path: str | None = None,
    evacuation: bool | EvacuationController | None = None,
    gpu_health: GpuHealthWatchdog | None = None,
    update_fn: UpdateFn = standard_update,
    state: StateArg = None,
) -> dict[str, Any]:
    """Train ``model`` on ``dataset`` until ``train.max_steps`` updates or the data runs out.

    ``dataset`` is any iterable, finite or infinite; it is iterated once (no hidden epochs).
    Returns the resume-ready terminal checkpoint dict (also saved to ``train.checkpoint_dir``).
    See the package README for ``ctx``, the hook events and every ``train`` key.

    ``optimizer`` may be a factory ``model -> Optimizer`` and ``scheduler`` one
    ``optimizer -> scheduler``, called once the model is on its device (and sharded: with
    ``train.fsdp`` they must be factories, because sharding replaces the parameters).

    ``resume="auto"`` continues from the highest valid published checkpoint in
    ``train.checkpoint_dir`` (else ``out_dir``), or starts at step 0 when there is none; pass the
    one you resolved yourself (to build the dataset from its ``next_step``) as ``checkpoint_dict``
    with ``auto_resume_path``. ``evacuation`` (or ``train.evacuation_enabled``) saves a terminal
    checkpoint and exits 75 on SIGUSR1; ``gpu_health`` checks a CUDA device (exit 79 when bad).
    See docs/checkpoints.md.

    ``update_fn(batches, model, optimizer, ctx) -> outputs`` computes one update's gradients
    (default `standard_update`: the micro-steps); its contract is in ``koochak.loop.update``.
    ``state`` (or a factory ``model -> mapping``) names further objects with ``state_dict``/
    ``load_state_dict`` that every checkpoint carries and a resume restores (``ctx.state``).
    """
    cfg = resolve_train_config(train_cfg)
    if step_fn is None and update_fn is standard_update:
        raise TypeError("training_loop: step_fn is required unless a custom update_fn is given")
    hooks = merge(hooks)
    warned: set[int] = set()  # hooks that already warned once
    started = time.perf_counter()
    train_dict = dataclasses.asdict(cfg)  # what leaves the loop (ctx, hooks): plain data

    # ---- setup once: device -> [resume lookup] -> [shard] -> start hook -> compile -> [DDP]
    #      -> [EMA] -> [restore] -> checkpoints, [GPU health]
    setup = ddp.setup_ddp(cfg, get_device(cfg.device))  # process group; device from LOCAL_RANK
    device, rank, world_size = setup.device, setup.rank, setup.world_size
    # The run's checkpoints, opened once: the claim on every place it writes, the checkpoint it
    # continues from (refused here if this model or config cannot continue it), later its saves.
    checkpoints = open_checkpoints(
        cfg, rank=rank, world_size=world_size, resume=resume, checkpoint_dict=checkpoint_dict,
        auto_resume_path=auto_resume_path, model=model, config=_config_of(config_json, cfg),
        shard_size=fsdp.shard_size(cfg.fsdp, world_size) if cfg.fsdp.enabled else None,
    )  # fmt: skip
    resume_path, checkpoint_dict = checkpoints.resume_path, checkpoints.resumed
    start_step, origin = checkpoints.start_step, checkpoints.origin
    try:
        if checkpoint_dict is None and cfg.init_from:  # a fine-tune: weights only, all else fresh
            weights, origin = load_init_weights(cfg.init_from, ema=cfg.init_from_ema)
            apply_init_weights(model, weights, cfg.init_from)
        raw_model = model.to(device)
        if cfg.fsdp.enabled:  # parameters become DTensor shards: build the optimizer after this
            fsdp.shard_model(raw_model, cfg.fsdp, device)
        optimizer, scheduler = _built(optimizer, scheduler, raw_model, cfg)
        user_state = resolve_state(state, raw_model)  # a second optimizer, its scheduler, ...
        # The user's DataLoader as handed in (DDP's sharding hides it in a sharded iterable next):
        dataset = say_if_not_resumable(dataset, rank)  # a shuffling DataLoader: one line, at start
        dataset, eval_dataset = ddp.shard_datasets(dataset, eval_dataset, cfg, setup)
        data_cursor = elastic_cursor(dataset, checkpoint_dict, start_step, cfg.grad_accum)
        scaler = Scaler(cfg.amp, device, sharded=cfg.fsdp.enabled)
        ctx = StepContext(
            device=device,
            rank=rank,
            world_size=world_size,
            autocast=autocast_factory(cfg.amp, device),
            scaler=scaler,
            config_json=config_json,
            train_cfg=train_dict,
            step=start_step,
            step_fn=step_fn,
            grad_accum=cfg.grad_accum,
            amp=cfg.amp != "none",
            state=user_state,
        )
        num_params = sum(p.numel() for p in raw_model.parameters())
        if rank == 0:
            print(_param_banner(raw_model, num_params), flush=True)
    except BaseException:  # a failed setup gives the claim back: the next run need not wait
        checkpoints.release()
        raise
    step = start_step
    evac: EvacuationController | None = None
    finished = False
    try:
        # Record a request from here on: the signal's default action would kill the process
        # during the slow parts of setup (hooks, compile, restore); it is honoured after update 0.
        evac = make_evacuation(evacuation, cfg)
        if evac is not None:
            evac.install()
        start_info = {"step": start_step, "max_steps": cfg.max_steps, "train_cfg": train_dict,
                      "config_json": config_json, "model": raw_model, "num_params": num_params,
                      "rank": rank, "world_size": world_size, "out_dir": cfg.out_dir,
                      "resumed": checkpoint_dict is not None, "resume_path": resume_path,
                      "origin": origin}  # fmt: skip
        # The attempt record every sink starts with; <out_dir>/attempts.jsonl keeps the history.
        attempt = run_history.begin_attempt(cfg.out_dir, checkpoints.tiers, resume_path,
                                            checkpoint_dict, start_step, cfg.max_steps,
                                            rank)  # fmt: skip
        history_first, history_last = run_history.make_history_hooks(cfg.out_dir, attempt)
        rows = make_throughput_hooks(cfg, world_size)  # progress, ETA, tokens/s, MFU per row
        hooks = merge(history_first, rows, hooks, history_last)
        start_info["attempt"] = attempt
        if len(checkpoints.tiers) > 1 and rank == 0:  # where others read it, once announced
            start_info["resume_publication_path"] = checkpoints.resume_publication_path()
        emit(hooks, "on_train_start", start_info)
        # Compile the bare module first so DDP wraps the compiled graph (torch's recommended order).
        train_model = torch.compile(raw_model) if cfg.compile else raw_model
        train_model = ddp.wrap_model(train_model, setup, cfg)
        ema = make_model_ema(cfg.ema, raw_model, start_step)  # one shadow per rank, no comms
        # What every checkpoint is captured from (live objects: each capture reads them anew),
        # first restored from the resumed checkpoint (all but the RNG, which comes last).
        parts = {"model": raw_model, "optimizer": optimizer, "scheduler": scheduler,
                 "scaler": scaler, "ema": ema, "config": _config_of(config_json, cfg),
                 "data": data_cursor, "run_id": checkpoints.run_id, "state": user_state,
                 "origin": origin}  # fmt: skip
        checkpoints.restore(
            parts, started=started, on_checkpoint=lambda info: fire("on_checkpoint", info),
            on_replication=lambda info: fire("on_replication", info),
        )  # fmt: skip
        raw_model.train()
        health = make_gpu_health(cfg, device, cfg.out_dir, gpu_health)

        # Everything the per-step code needs, looked up once: an ordinary update (no logging,
        # check, eval, save or health step) then costs what a hand-written loop costs.
        named_params = _stepped_params(raw_model, optimizer)  # what the gradient gate sees
        if rank == 0:
            _warn_untracked(untracked_parameters(raw_model, optimizer, user_state))
        grad_accum, clip, log_every = cfg.grad_accum, cfg.grad_clip, cfg.log_every
        max_steps, check_every = cfg.max_steps, cfg.nonfinite_grad_check_every
        end_step = max_steps if max_steps is not None else sys.maxsize
        if checkpoints.stopped_before:
            end_step = start_step  # no update runs; the terminal state is saved again
        step_scheduler = scheduler is not None and cfg.scheduler_step == "update"
        scaled = scaler.enabled  # fp16 on CUDA
        step_end_hooks, log_hooks = hooks.get("on_step_end"), hooks.get("on_log")
        before_step = None
        if hooks.get("on_before_optimizer_step"):  # gradients unscaled; clipped if clipping is on

            def before_step(at: int) -> None:
                fire("on_before_optimizer_step",
                     {"step": at, "model": raw_model, "optimizer": optimizer})  # fmt: skip

        ctx.no_sync = _no_sync(train_model, raw_model, cfg)  # all but the last micro-step's sync
        # Sharded gradients: norms and finite checks are taken over every rank's shards.
        across = (
            fsdp.ShardReduction.for_model(raw_model, device)
            if cfg.fsdp.enabled and world_size > 1
            else None
        )
        gradient_gate = GradientGate(named_params, scaler, optimizer, clip, across, before_step)
        clip_every_step = gradient_gate.every_step
        poll = checkpoints.poller()  # None when nothing can finish in the background
        # The cadences, as the index of the next update that ends one of them: ordinary updates
        # compare one integer; the due ones decide which cadence it is.
        periods = _periods(cfg, eval_fn, health)
        # Logged scalars are the mean over ranks (one gather per logging step), unless opted out.
        reduce = (
            frozenset(cfg.reduce_metrics_exclude) | {"step_time_s"}
            if world_size > 1 and cfg.reduce_metrics
            else None
        )
        reduce_eval_set = reduce if cfg.shard_eval_dataset else None  # unsharded: all equal
        # A hook's StopTraining is recorded here and honoured at the end of the update. Under DDP
        # the ranks agree on it after every update in which a hook could have asked.
        stop: list[str] = []
        ask_every_step = bool(step_end_hooks) or (  # (the run history's never stops a run)
            cfg.checkpoint_async
            and any(not getattr(h, "never_stops", False) for h in hooks.get("on_checkpoint", ()))
        )

        def fire(event: str, info: dict[str, Any]) -> None:
            try:
                emit(hooks, event, info, warned=warned)
            except StopTraining as request:
                stop.append(request.reason)

        eval_weights = ema if ema is not None and cfg.ema.eval_with_ema else None
        if cfg.cuda_prefetch:
            batches = cuda_prefetch(dataset, device, prepare_batch_fn)
        else:
            batches = _on_device(dataset, device, prepare_batch_fn)
        if hooks.get("on_after_backward"):
            ctx.after_backward = lambda: fire(
                "on_after_backward",
                {"step": ctx.step, "micro_step": ctx.micro_step, "model": raw_model},
            )
        # One call per update, its fixed arguments bound once.
        run_update = bind_update(update_fn, batches, train_model, optimizer, ctx)
        # A custom update may leave gradients outside the main optimizer (a GAN's D): zero all.
        zero_grad = optimizer.zero_grad if update_fn is standard_update else raw_model.zero_grad
        forward_ran = _ForwardSeen(train_model) if cfg.compile and rank == 0 else None

        # FSDP: free the weights eval gathered (the EMA shadow's, maybe) before training resumes.
        settle = (lambda: fsdp.reshard(raw_model)) if cfg.fsdp.enabled else None

        def evaluate(at: int) -> dict[str, float]:
            metrics = _evaluate(
                eval_fn, raw_model, eval_dataset, ctx, eval_weights, reduce_eval_set, settle
            )
            fire("on_eval_end", {"step": at, "metrics": metrics})
            return metrics

        metrics: dict[str, float] = {}
        eval_metrics: dict[str, float] = {}
        if eval_fn is not None and cfg.eval_at_step_zero and start_step == 0:
            eval_metrics = evaluate(0)

        # The logging window: the updates since the last log (from window_from to step).
        window_start, window_from = time.perf_counter(), step
        outputs: Mapping[str, Any] | None = None
        last_batch: Any = None
        next_due = _next_due(step, periods, max_steps)
        optimizer.zero_grad(set_to_none=True)
        checkpoints.restore_rng()  # last thing before the first step: nothing draws after it
        while step < end_step:
            ctx.step = step
            if poll is not None:
                poll()  # deliver a finished async publication; raise if it failed

            # ---- update_fn: micro-steps (autocast -> step_fn -> scaled backward) x grad_accum
            try:
                outputs, last_batch = run_update()
            except DataEnd:
                zero_grad(set_to_none=True)  # a partial update is dropped, not applied
                break

            # ---- cadences: which of log, finite check, GPU health, eval, save end this update;
            #      then the gradient gate: unscale -> finite check -> clip (when one needs it)
            due = step == next_due
            if due:
                is_log = (step + 1) % log_every == 0 or step + 1 == max_steps
                is_check = bool(check_every) and (step + 1) % check_every == 0
                is_health = health is not None and health.due(step)
                is_eval = bool(eval_fn is not None and cfg.eval_every) and (
                    (step + 1) % cfg.eval_every == 0
                )
                is_save = checkpoints.due(step)
                next_due = _next_due(step + 1, periods, max_steps)
                gate, host = gradient_gate(outputs, is_log, is_check, step)
                lr = get_lr(optimizer) if is_log else 0.0  # the rate this update used
            elif clip_every_step:
                gradient_gate(outputs, False, False, step)  # its metrics are only logged

            # ---- update: optimizer -> scaler -> [EMA] -> scheduler
            if scaled:  # an fp16 GradScaler skips an update with inf/NaN gradients
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if ema is not None:
                ema.update(step + 1)  # host-side decay, multi-tensor lerp: no device sync
            if step_scheduler:
                _step_scheduler(scheduler, outputs)
            zero_grad(set_to_none=True)

            # ---- observe: hooks; on the updates a cadence ends: log, GPU health, eval, save
            if step_end_hooks:
                fire("on_step_end", {"step": step, "outputs": outputs})
            if due:
                if forward_ran is not None:  # compiled: did its forward ever run? (said once)
                    forward_ran = forward_ran.check()
                if is_log:
                    assert host is not None
                    metrics = _log_metrics(host, gate, lr, time.perf_counter() - window_start)
                    metrics = _add_rate(metrics, last_batch, step + 1 - window_from, grad_accum,
                                        world_size, reduce)  # fmt: skip
                    if log_hooks:
                        fire("on_log", {"step": step, "metrics": metrics})
                    window_start, window_from = time.perf_counter(), step + 1

                # ---- protect: GPU health (every rank checks its device; one bad one stops all)
                if is_health:
                    _check_health(health, step, device, checkpoints, {**metrics, **eval_metrics})

                # ---- maybe eval
                if is_eval:
                    eval_metrics = evaluate(step)
                    if scheduler is not None and cfg.scheduler_step == "eval":
                        _step_scheduler(scheduler, eval_metrics)

                # ---- maybe save (periodic: keeps its zero-based index, resumes at step + 1)
                if is_save:  # a lost lease stops the run here, never publishing (exit 2)
                    checkpoints.periodic(step, {**metrics, **eval_metrics})
            step += 1

            # ---- stop: a hook asked for it (early stopping, a budget); every rank agrees
            if ask_every_step or due:
                if world_size > 1 and ddp.any_rank(bool(stop), ddp.collective_device()):
                    stop.append("requested by a hook on another rank")
                if stop:
                    break

            # ---- evacuate: all ranks agree at the end of a completed update, then leave (75)
            if evac is not None and evac.should_evacuate():
                final_metrics = {**metrics, **eval_metrics}
                path, checkpoint = checkpoints.terminal("evacuation", step, final_metrics)
                if rank == 0:
                    _announce_evacuation(step, path)
                end = {"step": step, "checkpoint": checkpoint, "metrics": final_metrics}
                emit(hooks, "on_train_end", {**end, "reason": "evacuation"}, warned=warned)
                raise Evacuated(step, checkpoint, path)

        # ---- finish: the last update is always logged, the terminal state saved and returned
        if step > window_from:  # updates since the last log (so outputs is not None)
            assert outputs is not None
            window_s = time.perf_counter() - window_start
            metrics = _log_metrics(to_host(outputs, None), None, get_lr(optimizer), window_s)
            metrics = _add_rate(metrics, last_batch, step - window_from, grad_accum, world_size,
                                reduce)  # fmt: skip
            emit(hooks, "on_log", {"step": step - 1, "metrics": metrics}, warned=warned)
        final_metrics = {**metrics, **eval_metrics}
        reason = "stopped" if stop or checkpoints.stopped_before else "terminal"
        _, checkpoint = checkpoints.terminal(reason, step, final_metrics)
        end = {"step": step, "checkpoint": checkpoint, "metrics": final_metrics}
        if stop:
            end.update(reason="stopped", stop_reason=stop[0])
            if rank == 0:
                print(f"koochak: stopped at step {step} ({stop[0]}); terminal checkpoint "
                      "published", flush=True)  # fmt: skip
        emit(hooks, "on_train_end", end, warned=warned)
        # Ranks leave together: one that ends its process (or group) while a peer still finishes
        # its last collective can make gloo abort that peer at exit (SIGABRT, exit 134).
        if world_size > 1:
            dist.barrier()
        finished = True
        return checkpoint
    # A GPU-health stop is a failure the hooks must hear of (an evacuation already ended cleanly
    # through on_train_end), and so is a sys.exit() in the training code: it ends the run without
    # a terminal checkpoint, unlike StopTraining.
    except (Exception, KeyboardInterrupt, SystemExit) as exc:
        if isinstance(exc, Evacuated):
            raise
        emit(hooks, "on_exception", {"step": step, "exception": exc}, warned=warned)
        checkpoints.close()  # an in-flight publication finishes; the original error stays primary
        raise
    finally:
        if evac is not None:
            evac.uninstall()
        checkpoints.release()
        if not finished:
            ddp.release_after_failure(setup)


# ------------------------------------------------------------------ per-step helpers, in run order


def _on_device(
    dataset: Iterable[Any], device: torch.device, prepare_batch_fn: Callable[[Any], Any] | None
) -> Iterator[Any]:
    """The batches on ``device``. ``iter(dataset)`` runs at the first batch, after the RNG is
    restored (a DataLoader draws its base seed there)."""
    if prepare_batch_fn is None:
        # chain asks _moved for the map at the first batch, then hands out the map's batches:
        # no Python runs per batch but ``to_device``'s own.
        return chain.from_iterable(_moved(dataset, device))
    return _prepared(dataset, device, prepare_batch_fn)


def _moved(dataset: Iterable[Any], device: torch.device) -> Iterator[Iterator[Any]]:
    yield map(to_device, dataset, repeat(device))


def _prepared(
    dataset: Iterable[Any], device: torch.device, prepare_batch_fn: Callable[[Any], Any]
) -> Iterator[Any]:
    # A loop, not map: a StopIteration escaping prepare_batch_fn is an error, not the data's end.
    for batch in dataset:
        yield prepare_batch_fn(to_device(batch, device))


def _periods(cfg: TrainConfig, eval_fn: Any, health: GpuHealthWatchdog | None) -> list[int]:
    """Every cadence an update can end: logging, the finite check, eval, a periodic save, the
    GPU health check (each a period in updates)."""
    periods = [cfg.log_every, cfg.nonfinite_grad_check_every, cfg.ckpt_every,
               cfg.eval_every if eval_fn is not None else None,
               getattr(health, "every", 1) if health is not None else None]  # fmt: skip
    return [int(p) for p in periods if p]


def _next_due(step: int, periods: Sequence[int], max_steps: int | None) -> int:
    """The first update index ``i >= step`` that ends one of ``periods`` (``(i + 1) % p == 0``),
    or the last update."""
    due = max_steps - 1 if max_steps is not None else sys.maxsize
    for period in periods:
        due = min(due, step + (-(step + 1)) % period)
    return due


def _step_scheduler(scheduler: Any, metrics: Mapping[str, Any]) -> None:
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        # Plateau needs a number: the monitored eval metric, or the step's loss (one sync).
        key = getattr(scheduler, "monitor", "eval_loss")
        value = metrics.get(key, metrics.get("loss"))
        if value is None:
            raise KeyError(f"plateau scheduler: metric {key!r} not found in {sorted(metrics)}")
        scheduler.step(float(value))
    else:
        scheduler.step()


def _log_metrics(
    host: dict[str, float], gate: dict[str, float] | None, lr: float, window_s: float
) -> dict[str, float]:
    metrics = dict(host)
    metrics["lr"] = lr
    if gate is not None:
        metrics.update(gate)
    metrics["step_time_s"] = window_s
    return metrics


def _add_rate(
    metrics: dict[str, float],
    batch: Any,
    steps: int,
    grad_accum: int,
    world_size: int,
    reduce: Collection[str] | None = None,
) -> dict[str, float]:
    """Turn the window time into per-step time (per rank) and samples/s when the batch says;
    under DDP, with ``reduce`` (names kept as this rank's), the scalars become their mean over
    ranks, gathered with the step times in one collective."""
    steps = max(steps, 1)
    step_time = metrics["step_time_s"] / steps
    metrics["step_time_s"] = step_time
    if world_size > 1:  # per-rank timing: the slowest rank sets the pace
        if reduce is not None:
            metrics, times = reduce_logged(metrics, step_time, exclude=reduce)
        else:
            times = [row[0] for row in dist.all_gather_floats([step_time], ddp.collective_device())]
        metrics["step_time_s_max"] = max(times)
        metrics["step_time_s_min"] = min(times)
    size = _batch_size(batch)
    if size and step_time > 0:
        metrics["samples_per_s"] = size * grad_accum * world_size / step_time
    return metrics


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = _batch_size(item)
            if size:
                return size
    return None


def _check_health(
    health: GpuHealthWatchdog,
    step: int,
    device: torch.device,
    checkpoints: RunCheckpoints,
    metrics: Any,
) -> None:
    """Every rank checks its device; one bad device makes all save a terminal checkpoint, exit 79."""
    verdict = health.check(step)
    if ddp.any_rank(not verdict.healthy, device):
        path, _ = checkpoints.terminal("gpu_health", step + 1, metrics, best_effort=True)
        raise GpuUnhealthy(step + 1, verdict, path)


def _evaluate(
    eval_fn: Callable[..., Mapping[str, Any]] | None,
    model: torch.nn.Module,
    eval_dataset: Any,
    ctx: StepContext,
    ema: ModelEma | None = None,
    reduce: Collection[str] | None = None,
    settle: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Run ``eval_fn`` under no_grad and eval mode (with ``ema``'s shadow swapped in, if given);
    ``eval_``-prefixed floats. With ``reduce`` (a sharded eval set under DDP) each metric is the
    mean over ranks weighted by the batches each rank evaluated, except the names in ``reduce``.
    ``settle`` runs right after ``eval_fn``, before the training weights are swapped back (FSDP:
    reshard, so the swap sees the shards, and the next forward gathers the training weights
    rather than reusing the shadow's)."""
    assert eval_fn is not None
    data = CountedBatches(eval_dataset) if reduce is not None else eval_dataset
    model.eval()
    try:
        with torch.no_grad(), ema.swapped_in() if ema is not None else _NULL:
            try:
                raw = eval_fn(model, data, ctx)
            finally:
                if settle is not None:
                    settle()
    finally:
        model.train()
    if not isinstance(raw, Mapping):
        raise TypeError(f"eval_fn must return a dict of scalars, got {type(raw).__name__}")
    metrics = {(k if k.startswith("eval_") else f"eval_{k}"): float(v) for k, v in raw.items()}
    if reduce is not None:
        batches = data.count or (len(eval_dataset) if hasattr(eval_dataset, "__len__") else 1)
        metrics = reduce_eval(metrics, batches, exclude={f"eval_{k}" for k in reduce} | set(reduce))
    return metrics


# ----------------------------------------------------------------------------- setup helpers


def _built(
    optimizer: Any, scheduler: Any, model: torch.nn.Module, cfg: TrainConfig
) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer and scheduler, calling the factories among them (``model -> optimizer``,
    ``optimizer -> scheduler``) now that the model's parameters are final."""
    built = not isinstance(optimizer, torch.optim.Optimizer)
    if built:
        if not callable(optimizer):
            raise TypeError(f"training_loop(optimizer=...): expected a torch.optim.Optimizer or a "
                            f"factory model -> Optimizer, got {type(optimizer).__name__}")  # fmt: skip
        optimizer = optimizer(model)
    elif cfg.fsdp.enabled:
        raise ValueError(
            "train.fsdp.enabled: sharding replaced the model's parameters, so an optimizer built "
            "before cannot update them; pass a factory instead, e.g. optimizer=lambda model: "
            "torch.optim.AdamW(model.parameters(), lr=...) (and scheduler=lambda opt: ...)"
        )
    if scheduler is not None and not hasattr(scheduler, "step") and callable(scheduler):
        scheduler = scheduler(optimizer)
    elif (
        built
        and scheduler is not None
        and getattr(scheduler, "optimizer", optimizer) is not optimizer
    ):
        raise ValueError("training_loop(scheduler=...): the scheduler drives another optimizer than "
                         "the one the factory built; pass a factory optimizer -> scheduler")  # fmt: skip
    return optimizer, scheduler


def _no_sync(
    train_model: torch.nn.Module, raw_model: torch.nn.Module, cfg: TrainConfig
) -> Callable[[], AbstractContextManager[Any]] | None:
    """What keeps a micro-step's gradients local: DDP's no_sync, FSDP's gradient-sync switch."""
    if isinstance(train_model, torch.nn.parallel.DistributedDataParallel):
        return train_model.no_sync
    if cfg.fsdp.enabled:
        return lambda: fsdp.no_gradient_sync(raw_model)
    return None


def _stepped_params(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.nn.Parameter]]:
    """The model's trainable parameters that the main optimizer steps, by name: what the
    gradient gate measures and clips (a custom update's other optimizers keep their own)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) in stepped]


def _warn_untracked(names: Sequence[str]) -> None:
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        warnings.warn(
            f"{len(names)} parameter(s) require grad but are in no checkpointed optimizer or "
            f"state entry: {shown}. Whatever updates them keeps state that a resume loses; pass "
            "their optimizer in training_loop(state={...}) (koochak-train: entry.state), or set "
            "requires_grad=False",
            UserWarning,
            stacklevel=3,
        )


class _ForwardSeen:
    """Whether the compiled module's forward ran during the first update (``torch.compile``
    compiles nothing when the update calls submodules directly); says so once if not."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.ran = False
        self.handle = model.register_forward_pre_hook(self._seen)

    def _seen(self, module: Any, args: Any) -> None:
        self.ran = True

    def check(self) -> None:
        self.handle.remove()
        if not self.ran:
            warnings.warn(
                "train.compile: the compiled model's forward never ran in the first update (the "
                "step_fn/update_fn called its submodules directly), so nothing was compiled; call "
                "model(...) itself, e.g. dispatch on an argument: model(z, 'G')",
                UserWarning,
                stacklevel=3,
            )


def _param_banner(model: torch.nn.Module, num_params: int) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (
        f"koochak: {type(model).__name__} with {num_params:,} parameters "
        f"({_human(num_params)}; trainable {_human(trainable)})"
    )


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _config_of(config_json: Mapping[str, Any] | None, cfg: TrainConfig) -> dict[str, Any]:
    return dict(config_json) if config_json is not None else {"train": dataclasses.asdict(cfg)}


def _announce_evacuation(step: int, path: str | None) -> None:
    """What a person watching the run needs: where it stopped and how to go on (one line)."""
    from koochak.loop.console import announce

    where = path or "(the checkpoint directory)"
    announce(f"evacuated after step {step}: terminal checkpoint {where} published; exit 75. "
             "Rerun the same command (koochak-train resumes with --resume auto; your own script "
             "with resume='auto') to continue.", level=logging.WARNING)  # fmt: skip
