"""MNIST under DDP: ``torchrun --nproc_per_node=N -m examples.mnist.ddp_main --config ...``.

Initialises the process group from torchrun's environment (NCCL with CUDA, else gloo), pins
this process to ``cuda:$LOCAL_RANK`` when CUDA is available, forces ``train.ddp: true`` and runs
the same `examples.mnist.main` with the same logging configuration. Each rank trains on its own
strided, equal-length slice of the training set.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

import torch
from koochak.loop import dist

from examples.mnist.main import cli


def launch(argv: Sequence[str] | None = None) -> NoReturn:
    """Train as one rank; the process ends here, with the training's exit code."""
    if torch.cuda.is_available():
        # Before any CUDA work, so NCCL and every default-device allocation use this rank's GPU.
        torch.cuda.set_device(dist.get_local_rank())
    dist.init_process_group()
    try:
        code = cli(argv, force_ddp=True)
    except SystemExit as exc:  # an evacuation (75) or a GPU-health stop (79)
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception:
        traceback.print_exc()
        code = 1
    # Ends the group and leaves without interpreter finalisation, which can abort a DDP rank.
    dist.exit_distributed_process(code)


if __name__ == "__main__":
    sys.exit(launch())
