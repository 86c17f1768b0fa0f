"""User code of the koochak-train runs in the Slurm and Scruffy tests (copied into the run's
cwd, named by the config's entry points): batch t depends only on t, and each step can be
slowed down (STEP_SLEEP) and announces itself (MARK_DIR/started) so a test can evacuate it."""

import os
import time

import torch
from torch.nn import functional as F

# A koochak-train config naming this module's entry points (train.out_dir comes from prepare_run).
CONFIG = """\
train: {max_steps: 20, ckpt_every: 5, log_every: 1000, device: cpu, progress_bar: false,
        evacuation_enabled: true}
optim: {optimizer: {name: sgd, lr: 0.05}}
logging: {stdout: false}
entry: {model: "slurm_user:make_model", dataset: "slurm_user:dataset", step: "slurm_user:step_fn"}
"""


def make_model(cfg):
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def dataset(cfg, start_step=0):
    step = start_step
    while True:
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1000 + step))
        yield x, x @ torch.tensor([[1.0], [-1.0], [2.0]])
        step += 1


def step_fn(model, batch, ctx):
    if ctx.step >= 1:
        open(os.path.join(os.environ["MARK_DIR"], "started"), "a").close()
    time.sleep(float(os.environ["STEP_SLEEP"]))
    x, y = batch
    return {"loss": F.mse_loss(model(x), y)}
