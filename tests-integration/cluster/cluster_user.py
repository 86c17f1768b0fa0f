"""User code of the koochak-train runs on the two-node cluster (copied into the run's cwd, named
by the config's entry points).

The data is koochak.loop's elastic stream over record ids 0..RECORDS-1 (a fixed global batch
split over the ranks), so a record's place in the run does not depend on the world size. Every
step appends one line per rank to ``$MARK_DIR/ids-<host>-<pid>.log``: ``attempt step rank
world host id,id,...`` (the sample-id log). ``STEP_SLEEP`` slows steps down, ``$MARK_DIR/started``
appears once step 1 began, and ``HANG_ON=<host>`` (with ``HANG_AT=<step>``) blocks that host's
ranks forever inside ``step_fn``."""

import os
import socket
import threading
import time

import torch
from torch.nn import functional as F

RECORDS = 96
GLOBAL_BATCH = 4

CONFIG = """\
train: {max_steps: 12, ckpt_every: 3, keep_last_k: null, log_every: 1000, device: cpu,
        progress_bar: false, ddp: true, warn_unsharded: false, evacuation_enabled: true}
optim: {optimizer: {name: sgd, lr: 0.05}}
logging: {stdout: false}
entry: {model: "cluster_user:make_model", dataset: "cluster_user:dataset",
        step: "cluster_user:step_fn"}
"""


def make_model(cfg):
    torch.manual_seed(0)
    # The first layer's rows split over two ranks, so under FSDP every rank holds a shard.
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))


def dataset(cfg):
    from koochak.loop.elastic import ElasticBatches

    return ElasticBatches(
        list(range(RECORDS)), global_batch=GLOBAL_BATCH, shuffle=False, collate=torch.tensor
    )


def _features(ids):
    rows = [torch.randn(3, generator=torch.Generator().manual_seed(int(i))) for i in ids]
    return torch.stack(rows)


def step_fn(model, ids, ctx):
    host = socket.gethostname()
    mark = os.environ["MARK_DIR"]
    attempt = f"{os.environ.get('SLURM_JOB_ID', '-')}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    with open(os.path.join(mark, f"ids-{host}-{os.getpid()}.log"), "a") as log:
        print(attempt, ctx.step, ctx.rank, ctx.world_size, host,
              ",".join(str(int(i)) for i in ids), file=log, flush=True)  # fmt: skip
    if ctx.step >= 1:
        open(os.path.join(mark, "started"), "a").close()
    if os.environ.get("HANG_ON") == host and ctx.step >= int(os.environ.get("HANG_AT", "0")):
        open(os.path.join(mark, f"hung-{host}"), "a").close()
        threading.Event().wait()  # forever
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    x = _features(ids)
    return {"loss": F.mse_loss(model(x), x @ torch.tensor([[1.0], [-1.0], [2.0]]))}
