"""MNIST under DDP: ``torchrun --nproc_per_node=N -m examples.mnist.ddp_main --config ...``.

Initialises the process group from torchrun's environment (NCCL with CUDA, else gloo), pins
this process to ``cuda:$LOCAL_RANK`` when CUDA is available, forces ``train.ddp: true`` and runs
the same `examples.mnist.main` with the same logging configuration. Each rank trains on its own
strided, equal-length slice of the training set.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from koochak.loop import dist

from examples.mnist.main import cli


def launch(argv: Sequence[str] | None = None) -> int:
    if torch.cuda.is_available():
        # Before any CUDA work, so NCCL and every default-device allocation use this rank's GPU.
        torch.cuda.set_device(dist.get_local_rank())
    dist.init_process_group()
    try:
        return cli(argv, force_ddp=True)
    finally:
        if dist.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(launch())
