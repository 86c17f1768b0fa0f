"""Run one task of a bench script on N gloo ranks on this host; rank 0's JSON result.

Shared by the benches that measure distributed checkpoints (``fsdp_bench``, ``scale_bench``):
each starts ``ranks`` copies of itself (``script``) with the torch.distributed environment of
one rank each, ``--rank-main --task TASK`` and ``extra`` arguments, and reads the last line
rank 0 printed as JSON. A rank that fails ends the bench with one line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any


def run_world(script: str, ranks: int, task: str, extra: list[str]) -> Any:
    """``task`` of ``script`` on ``ranks`` gloo processes (one thread each); rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        argv = [sys.executable, script, *extra, "--rank-main", "--task", task]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{task} on {ranks} ranks: a rank failed: {[p.returncode for p in procs]}")
    return json.loads(outputs[0].strip().splitlines()[-1])
