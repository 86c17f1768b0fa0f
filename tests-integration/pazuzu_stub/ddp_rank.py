"""One DDP rank of koochak-loop's own DDP recipe (packages/koochak-loop/tests/test_ddp.py),
launched by examples/jobs/slurm_ddp/ddp.sbatch:  python ddp_rank.py OUT_DIR MAX_STEPS

The recipe is reused as is; only each step is slowed down (STEP_SLEEP seconds) and announced
(OUT_DIR/started once step 1 began) so that a test can evacuate the job mid-run."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "packages" / "koochak-loop" / "tests" / "test_ddp.py"


def load_recipe():
    spec = importlib.util.spec_from_file_location("koochak_loop_ddp_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(out_dir: str, max_steps: int) -> None:
    from koochak.loop.dist import exit_distributed_process

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
        recipe._train(out_dir, max_steps, ddp=True)
        code = 0
    except SystemExit as exc:  # 75 (Evacuated) when evacuated
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception:
        traceback.print_exc()
        code = 1
    # Ends the group and leaves without interpreter finalisation: a gloo DDP rank can abort
    # there (std::terminate, exit 134) instead of exiting with its code.
    exit_distributed_process(code)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
