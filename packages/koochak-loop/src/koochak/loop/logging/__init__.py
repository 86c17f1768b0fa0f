"""Logging sinks as hooks: stdout TSV, CSV, JSONL, W&B, TensorBoard, and a TTY-only progress bar."""

from koochak.loop.logging.csv import CSVLogger, make_csv_hooks, read_csv_log
from koochak.loop.logging.jsonl import JSONLLogger, make_jsonl_hooks, read_jsonl_log
from koochak.loop.logging.progress import make_progress_hooks
from koochak.loop.logging.stdout import make_stdout_hooks
from koochak.loop.logging.tensorboard import make_tensorboard_hooks
from koochak.loop.logging.wandb_logger import make_wandb_hooks

__all__ = [
    "CSVLogger",
    "JSONLLogger",
    "make_csv_hooks",
    "make_jsonl_hooks",
    "make_progress_hooks",
    "make_stdout_hooks",
    "make_tensorboard_hooks",
    "make_wandb_hooks",
    "read_csv_log",
    "read_jsonl_log",
]
