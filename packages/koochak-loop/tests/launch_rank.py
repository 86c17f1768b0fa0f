"""One DDP rank for test_launch.py: ``launch_rank.py OUT_DIR MAX_STEPS``.

It ties itself to the launcher (as koochak-train does), writes ``OUT_DIR/pid-<rank>``, then
sleeps ``STARTUP_DELAY`` seconds (a rank still starting: no evacuation handler yet), then trains
on 2 gloo ranks with
evacuation on, ``STEP_DELAY`` seconds per step (only on rank ``SLOW_RANK`` when set: the other
waits for it in the gradient all-reduce), touching ``OUT_DIR/stepped-<rank>`` once it has done an
update; it ends with the loop's code (75 when evacuated) like koochak-train does.
"""

import os
import sys
import time
import traceback

out_dir, max_steps = sys.argv[1], int(sys.argv[2])
rank = os.environ["RANK"]
from koochak.loop.parent_death import tie_to_parent  # noqa: E402  (koochak-train's first call)

tie_to_parent()
with open(os.path.join(out_dir, f"pid-{rank}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(float(os.environ.get("STARTUP_DELAY", "0")))

import torch  # noqa: E402
from koochak.loop import training_loop  # noqa: E402
from koochak.loop.dist import exit_distributed_process  # noqa: E402


def step_fn(model, batch, ctx):
    if ctx.step >= 1:
        open(os.path.join(out_dir, f"stepped-{ctx.rank}"), "w").close()
    if rank == os.environ.get("SLOW_RANK", rank):  # the other rank waits in the all-reduce
        time.sleep(float(os.environ.get("STEP_DELAY", "0")))
    return {"loss": ((model(batch) - 1.0) ** 2).mean()}


torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
try:
    training_loop(
        model=model,
        dataset=(torch.ones(2, 2) for _ in range(max_steps)),
        step_fn=step_fn,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        train_cfg={"max_steps": max_steps, "device": "cpu", "out_dir": out_dir, "ddp": True,
                   "evacuation_enabled": True, "progress_bar": False, "log_every": 1000},
    )  # fmt: skip
    code = 0
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
except Exception:
    traceback.print_exc()
    code = 1
exit_distributed_process(code)
