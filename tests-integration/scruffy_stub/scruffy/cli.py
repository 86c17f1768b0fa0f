"""``python -m scruffy --root ROOT serve --launcher local --inventory INV.json [...]``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from scruffy import _contract
from scruffy.controller import Controller, load_inventory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scruffy")
    parser.add_argument("--root", required=True, type=Path)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("--launcher", choices=("auto", "local"), default="auto")
    serve.add_argument("--inventory", type=Path)
    serve.add_argument("--allocation-id", default="local")
    serve.add_argument("--poll-interval", type=float, default=0.2)
    serve.add_argument("--cancel-grace", type=float, default=30.0)
    serve.add_argument("--contract", choices=_contract.CONTRACTS, default=_contract.CONTRACT)
    args = parser.parse_args(argv)
    if args.contract != _contract.CONTRACT:  # re-exec so client and controller agree
        env = {**os.environ, "SCRUFFY_STUB_CONTRACT": args.contract}
        os.execve(sys.executable, [sys.executable, "-m", "scruffy", *(argv or sys.argv[1:])], env)
    if args.launcher == "auto" and os.environ.get("SLURM_JOB_ID"):
        parser.exit(2, "scruffy: this stub has only the local launcher\n")
    if args.inventory is None:
        parser.exit(2, "scruffy: --inventory is required outside Slurm\n")
    try:
        inventory = load_inventory(args.inventory)
        controller = Controller(
            args.root,
            inventory,
            allocation_id=args.allocation_id,
            poll_interval=args.poll_interval,
            cancel_grace=args.cancel_grace,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        parser.exit(2, f"scruffy: {exc}\n")
    controller.serve()
    return 0
