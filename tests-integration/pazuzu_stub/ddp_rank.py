"""One DDP rank of koochak-loop's own DDP recipe (packages/koochak-loop/tests/test_ddp.py),
launched by examples/jobs/slurm_ddp/ddp.sbatch:  python ddp_rank.py OUT_DIR MAX_STEPS

The recipe is reused as is; only each step is slowed down (STEP_SLEEP seconds) and announced
(OUT_DIR/started once step 1 began) so that a test can evacuate the job mid-run."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "packages" / "koochak-loop" / "tests" / "test_ddp.py"


def load_recipe():
    spec = importlib.util.spec_from_file_location("koochak_loop_ddp_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(out_dir: str, max_steps: int) -> None:
    import torch

    recipe = load_recipe()
    os.makedirs(out_dir, exist_ok=True)
    step_fn, pause = recipe._step_fn, float(os.environ.get("STEP_SLEEP", "0"))

    def slowed(model, batch, ctx):
        if ctx.step >= 1 and ctx.rank == 0:
            Path(out_dir, "started").touch()
        time.sleep(pause)
        return step_fn(model, batch, ctx)

    recipe._step_fn = slowed
    try:
        recipe._train(out_dir, max_steps, ddp=True)  # exits 75 (Evacuated) when evacuated
    finally:
        # Also on evacuation: a rank that exits with the group still up can abort in gloo's
        # teardown (std::terminate, exit 134) while its peer is closing the connection.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
