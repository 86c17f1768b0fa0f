"""One rank of an FSDP test world: ``python fsdp_world.py OUT SCENARIO [SCENARIO ...]``.

test_fsdp.py starts each world (1, 2 or 4 gloo processes on CPU, with torchrun's environment set
by hand) once and has it run several scenarios in a row, because starting processes is what costs
here. Every scenario writes what it saw under OUT (rank 0: ``<name>.pt`` results; every rank: the
sample ids it consumed), and the test asserts on those files.

The model is a tiny transformer whose ``Block`` modules get their own ``fully_shard``; its sizes
(vocabulary 13, hidden 17) do not divide by 2 or 4, so shards are uneven and some are empty.
The data is an ``ElasticBatches`` stream over 52 records of global batch 8 in 4 lanes (rank r of
W reads only its lanes; 52 is no multiple of 8, so epochs start mid-batch).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback

import torch
from torch import nn

VOCAB, DIM, SEQ, RECORDS, GLOBAL_BATCH = 13, 8, 6, 52, 8
MAX_STEPS, SAVE_AT = 8, 3  # the periodic checkpoint after update 3 resumes at update 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)  # a key bias has no gradient but noise
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(
            nn.Linear(DIM, 2 * DIM + 1), nn.GELU(), nn.Linear(2 * DIM + 1, DIM)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer()


def records() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [
        {"id": i, "tokens": torch.randint(0, VOCAB, (SEQ + 1,), generator=g)}
        for i in range(RECORDS)
    ]


SEEN: list[list[int]] = []  # [step, micro_step, rank, *ids] per micro-batch of this process
DTYPES: set[str] = set()  # the dtypes of the logits step_fn saw in this run


def step_fn(model, batch, ctx):
    SEEN.append([ctx.step, ctx.micro_step, ctx.rank, *batch["id"].tolist()])
    if os.environ.get("EVACUATE_AT") == str(ctx.step) and ctx.rank == ctx.world_size - 1:
        os.kill(os.getpid(), signal.SIGUSR1)  # only the last rank is asked to leave
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    DTYPES.add(str(logits.dtype))
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    if os.environ.get("NAN_AT") == str(ctx.step) and ctx.rank == ctx.world_size - 1:
        loss = loss * float("nan")
    scale = float(os.environ.get("LOSS_SCALE", "1"))
    return {"loss": loss * scale if scale != 1 else loss}


def eval_fn(model, dataset, ctx):
    with torch.no_grad():
        batch = dataset[0]
        logits = model(batch["tokens"][:, :-1])
        return {
            "loss": nn.functional.cross_entropy(
                logits.float().reshape(-1, VOCAB), batch["tokens"][:, 1:].reshape(-1)
            )
        }


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


def train_cfg(out_dir: str, **overrides) -> dict:
    cfg = {
        "max_steps": MAX_STEPS,
        "log_every": 1,
        "device": "cpu",
        "out_dir": out_dir,
        "ckpt_every": SAVE_AT + 1,
        "keep_last_k": None,
        "grad_accum": 2,
        "grad_clip": 0.5,
        "nonfinite_grad_check_every": 1,
        "progress_bar": False,
        "evacuation_enabled": True,
        "ema": {"decay": 0.9},
        "fsdp": {"enabled": True, "shard_modules": ["Block"]},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def rank() -> int:
    return torch.distributed.get_rank()


def world() -> int:
    return torch.distributed.get_world_size()


def run(out: str, name: str, resume_dir: str | None = None, **overrides) -> dict:
    """One training_loop run named ``name`` (resuming from the checkpoint in ``resume_dir``);
    records its sample ids and logged metrics, and rank 0 its final state, gathered."""
    from koochak.loop import fsdp, training_loop
    from koochak.loop.elastic import ElasticBatches

    SEEN.clear()
    DTYPES.clear()
    logs: list[dict] = []
    if resume_dir is not None:
        overrides["checkpoint_dir"] = resume_dir
    data = ElasticBatches(records(), global_batch=GLOBAL_BATCH, seed=3, lanes=4)  # 52 % 8: phases
    eval_set = [records()[0:4]]
    eval_set = [{"id": torch.tensor([r["id"] for r in eval_set[0]]),
                 "tokens": torch.stack([r["tokens"] for r in eval_set[0]])}]  # fmt: skip
    try:
        result = training_loop(
            model=make_model(),
            dataset=data,
            step_fn=step_fn,
            optimizer=optimizer,
            scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)),
            train_cfg=train_cfg(os.path.join(out, name), **overrides),
            eval_dataset=eval_set,
            eval_fn=eval_fn,
            hooks={
                "on_log": [lambda info: logs.append({"step": info["step"], **info["metrics"]})],
                "on_eval_end": [lambda info: logs.append({"eval_at": info["step"]})],
            },
            resume="auto" if resume_dir else None,
        )
        outcome = {"code": 0}
    except SystemExit as exc:  # an evacuation (75)
        result, outcome = None, {"code": exc.code}
    except Exception as exc:
        result, outcome = None, {"code": 1, "error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(out, f"{name}.seen.{rank()}.json"), "w") as f:
        json.dump({"seen": SEEN, "logs": logs, "dtypes": sorted(DTYPES), **outcome}, f)
    if result is not None:
        result = fsdp.full(result)  # this rank's shards -> global tensors (every rank at once)
    if rank() == 0 and result is not None:
        torch.save({"model": result["model"], "optimizer": result["optimizer"],
                    "ema": result["ema"], "data": result.get("data")},
                   os.path.join(out, f"{name}.final.pt"))  # fmt: skip
    return outcome


SELECTED: list[list[str]] = []  # the part keys each HSDP restore's selection read


def restored_state(location: str, fsdp_enabled: bool = True, hsdp: bool = False) -> dict:
    """Restore the checkpoint at ``location`` the way a resume does (under FSDP: chosen by every
    rank, each reading its slabs) into a fresh model, optimizer and EMA, and gather them back
    into global tensors: what a resume on this world size starts from."""
    from koochak.loop import fsdp
    from koochak.loop.checkpoint import resolve_auto_resume, restore_training_state
    from koochak.loop.checkpoint.resume import resume_checkpoint
    from koochak.loop.config import resolve_train_config
    from koochak.loop.ema import make_model_ema

    model = make_model()
    cfg = resolve_train_config(train_cfg("unused", fsdp={"enabled": fsdp_enabled, **HSDP}
                                         if hsdp else {"enabled": fsdp_enabled}))  # fmt: skip
    if fsdp_enabled:
        fsdp.shard_model(model, cfg.fsdp, torch.device("cpu"))
        size = fsdp.shard_size(cfg.fsdp, world())
        found = resume_checkpoint("auto", location, sharded=True, shard_size=size)
        if hsdp:  # each rank read at selection exactly the parts that hold the rows it holds
            SELECTED.append(sorted(found.checkpoint["model"]["pos"].source.verified))
    else:
        found = resolve_auto_resume(location)
    opt = optimizer(model)
    ema = make_model_ema(cfg.ema, model)
    restore_training_state(found.checkpoint, model, opt, ema=ema)
    return fsdp.full({"model": model.state_dict(), "optimizer": opt.state_dict(),
                      "ema": ema.state_dict()})  # fmt: skip


def run_of(out: str, run_name: str) -> str:
    """The run id of ``run_name``'s checkpoints (derived from its out_dir): a run resumed from a
    copy of them under another out_dir names it, or its tiers are another run's (issue 35)."""
    from types import SimpleNamespace

    from koochak.loop.checkpoint.tier_marker import default_run_id

    return default_run_id(SimpleNamespace(out_dir=os.path.join(out, run_name)))


def only(out: str, run_name: str, step: int, copy_name: str) -> str:
    """A directory holding nothing but ``run_name``'s checkpoint of ``step`` (all its objects,
    as ``checkpoint_objects`` lists them), so that resume="auto" there chooses it."""
    import shutil

    from koochak.loop.checkpoint import checkpoint_name
    from koochak.loop.checkpoint.publication import checkpoint_objects

    source, target = os.path.join(out, run_name), os.path.join(out, copy_name)
    if rank() == 0:
        os.makedirs(target, exist_ok=True)
        for key in checkpoint_objects(source, checkpoint_name(step)):
            shutil.copy2(os.path.join(source, key), os.path.join(target, key))
    torch.distributed.barrier()
    return target


def compare_restore(
    out: str, name: str, location: str, fsdp_enabled: bool = True, hsdp: bool = False
) -> None:
    from koochak.loop.checkpoint import checkpoint_name, load

    SELECTED.clear()
    state = restored_state(location, fsdp_enabled, hsdp)
    if SELECTED:
        with open(os.path.join(out, f"{name}.selected.{rank()}.json"), "w") as f:
            json.dump(SELECTED[0], f)
    if rank() == 0:
        saved = load(os.path.join(location, checkpoint_name(SAVE_AT)))
        problems = diff(saved["model"], state["model"], "model")
        problems += diff(saved["optimizer"]["state"], state["optimizer"]["state"], "optimizer")
        problems += diff([s["state_dict"] for s in saved["ema"]["shadows"]],
                         [s["state_dict"] for s in state["ema"]["shadows"]], "ema")  # fmt: skip
        with open(os.path.join(out, f"{name}.restore.json"), "w") as f:
            json.dump({"problems": problems}, f)


def diff(a, b, path: str) -> list[str]:
    """Where two trees of tensors differ (exact equality)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        return [] if ok and torch.equal(a, b) else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [p for k in a for p in diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length"]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def damaged(out: str) -> None:
    """A checkpoint with a damaged part is passed over for the older one; a part that goes
    missing after selection is not read again (the load restores the bytes the selection
    verified), and a second load of the same selection, which reads the store, fails on every
    rank naming it."""
    import shutil

    from koochak.loop.checkpoint import checkpoint_name
    from koochak.loop.checkpoint.resume import resume_checkpoint

    location = only(out, "save2", SAVE_AT, "damaged.ckpt")
    newest = checkpoint_name(MAX_STEPS)
    if rank() == 0:
        for key in os.listdir(os.path.join(out, "save2")):
            if key.startswith(newest):
                shutil.copy2(os.path.join(out, "save2", key), os.path.join(location, key))
        with open(os.path.join(location, f"{newest}.part-00001-00000"), "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))  # same size, another digest
    torch.distributed.barrier()
    chosen = resume_checkpoint("auto", location, sharded=True)
    torch.distributed.barrier()
    if rank() == 0:  # gone between selection and load
        os.remove(os.path.join(location, f"{checkpoint_name(SAVE_AT)}.part-00001-00000"))
    torch.distributed.barrier()
    model = make_model()
    from koochak.loop import fsdp
    from koochak.loop.config import FsdpConfig

    fsdp.shard_model(model, FsdpConfig(shard_modules=["Block"]), torch.device("cpu"))
    first = _restore_error(chosen.checkpoint, model)
    error = _restore_error(chosen.checkpoint, model)
    stalled = _stalled_on_rank_1(out, model)
    with open(os.path.join(out, f"damaged.{rank()}.json"), "w") as f:
        json.dump({"chosen": chosen.path, "first": first, "error": error, "stalled": stalled}, f)


def _restore_error(checkpoint: dict, model: nn.Module) -> str | None:
    from koochak.loop.checkpoint import restore_training_state

    try:
        restore_training_state(checkpoint, model, optimizer(model))
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _stalled_on_rank_1(out: str, model: nn.Module) -> str | None:
    """Rank 1's read of its own part (one rank 0 never reads) delivers nothing in a second load
    of a selection (the first took the bytes the selection verified): every rank must still
    fail, naming that part, once the stall bound passes (lowered to 1 s here)."""
    import io
    import threading

    import koochak.loop.checkpoint.sharded_read as sharded_read
    from koochak.loop.checkpoint.resume import resume_checkpoint
    from koochak.storage.store import LocalStore

    location = only(out, "save2", SAVE_AT, "stalled.ckpt")
    found = resume_checkpoint("auto", location, sharded=True)
    _restore_error(found.checkpoint, model)
    release, real_open = threading.Event(), LocalStore.open

    class Hung(io.RawIOBase):
        def readinto(self, buffer):
            release.wait()
            return 0

    def open_(store, key):
        return (
            Hung() if rank() == 1 and key.endswith(".part-00001-00000") else real_open(store, key)
        )

    LocalStore.open, sharded_read.READ_STALL_SECONDS = open_, 1.0
    try:
        return _restore_error(found.checkpoint, model)
    finally:
        LocalStore.open, sharded_read.READ_STALL_SECONDS = real_open, 120.0
        release.set()


def count_reductions(out: str) -> None:
    """Gradient reductions per update with grad_accum 2: one per FSDP group, not two."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    calls = []
    original = group_module.foreach_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    group_module.foreach_reduce = counting
    try:
        run(out, "accum", max_steps=3, ckpt_every=None, grad_accum=2)
    finally:
        group_module.foreach_reduce = original
    if rank() == 0:
        with open(os.path.join(out, "accum.reductions.json"), "w") as f:
            json.dump({"calls": len(calls), "updates": 3, "groups": 3}, f)


HSDP = {"hsdp": True, "shard_size": 2}  # 2 "nodes" of 2 ranks on 4


def hsdp_scenario(out: str, what: str) -> None:
    """HSDP (shard within 2 ranks, replicate across): ``hsdp`` trains on a ``{node}`` first tier
    (node = rank // 2) and a durable replica; ``hsdpcut<S>`` resumes hsdp<S>'s checkpoint from
    the durable tier alone (HSDP on 4 ranks, else 1-D FSDP), checking the restore first;
    ``hsdpfrom<S>``: save<S>'s 1-D checkpoint restored and resumed under HSDP."""
    w = world()
    os.environ["KOOCHAK_NODE_INDEX"] = str(rank() // 2)
    here = HSDP if w % 2 == 0 and w > 2 else {}
    if what == "hsdp":
        run(out, f"hsdp{w}", fsdp=HSDP,
            checkpoint_dir=os.path.join(out, f"hsdp{w}", "node{node}"),
            checkpoint_replicas=[{"location": os.path.join(out, f"hsdp{w}", "durable"),
                                  "create": True}])  # fmt: skip
    elif what.startswith("hsdpcut"):
        source, name = what[len("hsdpcut") :], f"hsdpcut{what[len('hsdpcut') :]}to{w}"
        durable = only(out, os.path.join(f"hsdp{source}", "durable"), SAVE_AT,
                       os.path.join(name, "durable"))  # fmt: skip
        compare_restore(out, name, durable, hsdp=bool(here))
        run(out, name, resume_dir=os.path.join(out, name, "node{node}"), fsdp=here,
            checkpoint_replicas=[durable], run_id=run_of(out, f"hsdp{source}"))  # fmt: skip
    elif what.startswith("hsdpfrom"):
        source = what[len("hsdpfrom") :]
        name = f"hsdpfrom{source}to{w}"
        location = only(out, f"save{source}", SAVE_AT, f"{name}.ckpt")
        compare_restore(out, name, location, hsdp=True)
        run(out, name, resume_dir=location, fsdp=HSDP, run_id=run_of(out, f"save{source}"))
    else:
        raise SystemExit(f"unknown scenario {what!r}")


def scenario(out: str, what: str) -> None:
    w = world()
    if what.startswith("hsdp"):
        hsdp_scenario(out, what)
        return
    if what == "save":  # an uninterrupted FSDP run on this world size, checkpointed after SAVE_AT
        run(out, f"save{w}")
    elif what == "async":  # save<W> again, its periodic checkpoint written in the background
        run(out, f"async{w}", checkpoint_async=True)
    elif what == "plain":  # the same run on one process without FSDP (today's checkpoints)
        run(out, "plain", fsdp={"enabled": False})
    elif what.startswith("resume"):  # resume<W>: continue save<W>'s checkpoint on this world
        source = what[len("resume") :]
        name = f"resume{source}to{w}"
        run_name = f"save{source}" if source != "plain" else "plain"
        location = only(out, run_name, SAVE_AT, f"{name}.ckpt")
        compare_restore(out, name, location)
        run(out, name, resume_dir=location, run_id=run_of(out, run_name))
    elif what.startswith("back"):  # back<W>: an FSDP checkpoint restored without FSDP
        source = what[len("back") :]
        location = only(out, f"save{source}", SAVE_AT, f"back{source}.ckpt")
        compare_restore(out, f"back{source}", location, fsdp_enabled=False)
    elif what.startswith("cli"):  # cli<N>: koochak-train on examples/fsdp up to update N
        from koochak.loop.cli import main as cli_main

        code = cli_main(["--config", "examples/fsdp/config.yaml", f"train.out_dir={out}/cli",
                         f"train.max_steps={what[3:]}", "train.ckpt_every=2", "train.log_every=1",
                         "train.eval_every=2", "data.records=40", "optim.scheduler.warmup_steps=1",
                         "logging.stdout=false",
                         "train.progress_bar=false"])  # fmt: skip
        if code:  # only reached on one process: on several, cli_main ends the process itself
            raise SystemExit(f"koochak-train exited {code}")
    elif what == "tiers":  # a node-local first tier ({node}: node = rank here) and a durable one
        os.environ["KOOCHAK_NODE_INDEX"] = str(rank())
        run(out, f"tiers{w}", checkpoint_dir=os.path.join(out, f"tiers{w}", "node{node}"),
            checkpoint_replicas=[{"location": os.path.join(out, f"tiers{w}", "durable"),
                                  "create": True}])  # fmt: skip
    elif what == "tiersshared":  # one first tier every rank writes to, a durable one behind it
        run(out, f"tiersshared{w}", checkpoint_replicas=[os.path.join(out, f"tiersshared{w}.d")],
            checkpoint_async=True)  # fmt: skip
    elif what.startswith("tierscut"):  # tierscut<S>: resume tiers<S>'s step from the durable tier
        os.environ["KOOCHAK_NODE_INDEX"] = str(rank())
        source, name = what[len("tierscut") :], f"tierscut{what[len('tierscut') :]}to{w}"
        durable = only(out, os.path.join(f"tiers{source}", "durable"), SAVE_AT,
                       os.path.join(name, "durable"))  # fmt: skip
        # No first tier at all: every node's directory is gone.
        run(out, name, resume_dir=os.path.join(out, name, "node{node}"),
            checkpoint_replicas=[durable], run_id=run_of(out, f"tiers{source}"))  # fmt: skip
    elif what == "damaged":
        damaged(out)
    elif what == "export":  # save4's checkpoint as one weights file, read on one process
        from koochak.loop.checkpoint import export_weights

        if rank() == 0:
            for shadow, name in ((None, "model.pt"), (0, "ema.pt")):
                export_weights(os.path.join(out, "save4"), os.path.join(out, "export"),
                               ema=shadow, name=name)  # fmt: skip
    elif what == "accum":
        count_reductions(out)
    elif what == "evacuate":
        os.environ["EVACUATE_AT"] = "2"
        try:
            run(out, "evacuate", ckpt_every=None)
        finally:
            del os.environ["EVACUATE_AT"]
    elif what == "nan":
        os.environ["NAN_AT"] = "1"
        try:
            run(out, "nan", ckpt_every=None, max_steps=3)
        finally:
            del os.environ["NAN_AT"]
    elif what == "overflow":  # finite gradients whose sum of squares overflows float32
        os.environ["LOSS_SCALE"] = "1e30"
        try:
            run(out, "overflow", ckpt_every=None, max_steps=2, grad_clip=1.0)
        finally:
            del os.environ["LOSS_SCALE"]
    elif what == "eval":  # eval with the EMA swapped in must not change training at all
        shared = {"ckpt_every": None, "max_steps": 6, "ema": {"eval_with_ema": True}}
        run(out, "noeval", fsdp={"reshard_after_forward": False}, **shared)
        run(out, "witheval", fsdp={"reshard_after_forward": False}, eval_every=2, **shared)
    elif what == "bf16":
        run(out, "bf16", ckpt_every=None, max_steps=3, fsdp={"mixed_precision": "bf16"})
    elif what == "amp":  # train.amp under FSDP: autocast around step_fn on every rank
        run(out, "amp", ckpt_every=None, max_steps=3, amp="bf16")
    elif what == "compile":
        run(out, "compile", ckpt_every=None, max_steps=3, compile=True)
    else:
        raise SystemExit(f"unknown scenario {what!r}")


def main() -> None:
    from koochak.loop.dist import exit_distributed_process

    out, scenarios = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    code = 0
    try:
        for what in scenarios:
            scenario(out, what)
            torch.distributed.barrier()
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_distributed_process(code)


if __name__ == "__main__":
    main()
