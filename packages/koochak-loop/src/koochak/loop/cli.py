"""``koochak-train --config cfg.yaml [key=value ...] [--resume auto|none] [--debug]``.

Loads the config (defaults <- YAML <- overrides), prints the startup summary, imports the
``entry`` callables (``module:callable``, with the working directory on ``sys.path``), builds the
optimizer and scheduler from ``optim``, attaches the logging hooks from ``logging``/``wandb`` and
runs `training_loop`. Every entry builder is called with the whole resolved config; the dataset
builders also get ``start_step=`` when their signature accepts it, so a resumed run can continue
the data stream where the checkpoint says.

Errors in the config or the entry points print one line on stderr and exit 2 before training;
an error raised during training prints one line and exits 1. ``--debug`` shows tracebacks.
Under Scruffy, a checkpoint Scruffy did not acknowledge exits 76 and a rejected one 77, each
after one JSON line on stderr (`koochak.loop.scruffy_exit`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn

from koochak.loop.checkpoint import checkpoint_store, resolve_auto_resume
from koochak.loop.checkpoint.tiers import checkpoint_locations
from koochak.loop.config import (
    ConfigError,
    _blame,
    format_summary,
    get_section,
    load_config_with_report,
    to_container,
)
from koochak.loop.console import console_logging, set_level
from koochak.loop.declared import check_declared_sections, keyword_values
from koochak.loop.dist import exit_distributed_process
from koochak.loop.evacuation import Evacuated, make_evacuation
from koochak.loop.health import GpuUnhealthy
from koochak.loop.logging.wandb_logger import check_restart_settings
from koochak.loop.masking import mask_text, masked_output, masking_active, recorded_config
from koochak.loop.parent_death import tie_to_parent
from koochak.loop.scruffy_exit import checkpoint_exit_code
from omegaconf import DictConfig, OmegaConf

EXIT_USAGE = 2
EXIT_TRAINING_FAILED = 1


class EntryError(ValueError):
    """An ``entry.*`` path that cannot be imported or is not callable."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse with koochak's CLI error shape: one line on stderr, exit 2."""

    def error(self, message: str) -> NoReturn:
        # One line like every other koochak-train error, instead of argparse's usage block.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="koochak-train",
        description="Run koochak's training_loop from a YAML config and user entry points.",
        epilog=(
            "Every config key, its default and what it does: examples/config_template.yaml in "
            "the Koochak source tree (docs/loop.md, 'Configuration'). The config needs an entry "
            "section naming your code (entry.model, entry.dataset, entry.step as "
            "module:callable); a model's hyperparameters go under model:. Under torchrun-style "
            "DDP launch with `python -m koochak.loop.launch` to keep the exit code (75 on "
            "evacuation)."
        ),
    )
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotlist overrides, e.g. train.max_steps=100",
    )
    parser.add_argument(
        "--resume",
        choices=("auto", "none"),
        default="auto",
        help="auto: continue from the highest valid published checkpoint (default); none: start fresh",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    return parser


def import_entry(path: str | None, key: str) -> Callable[..., Any]:
    """Import ``module:callable`` named by config key ``key`` (``entry.model`` etc.).

    Every failure, whatever the imported module does (a syntax error, an exception, even
    ``sys.exit()`` at import), is an `EntryError` naming the key and the import string.
    """
    if path is None or path == "":
        raise EntryError(
            f"{key} is not set: add it to the config's entry section as 'module:callable' "
            f"(or override {key}=my_pkg.module:function)"
        )
    where = f"{key}={path!r}"
    if not isinstance(path, str) or ":" not in path:
        raise EntryError(f"{key}: expected 'module:callable', got {path!r}")
    module_name, _, attr = path.partition(":")
    if module_name.startswith("."):
        raise EntryError(
            f"{where}: relative module {module_name!r} has no package to be relative to; "
            "name the module absolutely, e.g. my_pkg.module:function"
        )
    if not _dotted(module_name) or not _dotted(attr):
        raise EntryError(
            f"{where}: expected 'module:callable' with dotted Python names on both sides "
            "(e.g. my_pkg.module:function)"
        )
    if os.getcwd() not in sys.path:  # user code next to the config, as `python -m` finds it
        sys.path.insert(0, os.getcwd())
    module = _import_module(module_name, where)
    target: Any = module
    parts = attr.split(".")
    for i, part in enumerate(parts):
        try:
            target = getattr(target, part)
        except AttributeError:
            names = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            fix = (
                f" (did you mean '{module_name}:{'.'.join([*parts[:i], *close])}'?)"
                if close
                else ""
            )
            raise EntryError(
                f"{where}: module {module_name!r} has no attribute {attr!r}{fix}"
            ) from None
        except Exception as exc:  # a module __getattr__ or a property that raises
            raise EntryError(f"{where}: looking up {attr!r} raised {_described(exc)}") from None
    if not callable(target):
        raise EntryError(f"{where}: {path!r} is not callable")
    return target


def _dotted(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def _import_module(name: str, where: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name != exc.name and not name.startswith(exc.name + "."):
            raise EntryError(
                f"{where}: module {name!r} imports {exc.name!r}, which is not installed ({exc})"
            ) from None
        raise EntryError(f"{where}: cannot import module {name!r} ({exc})") from None
    except SyntaxError as exc:
        at = f" ({exc.filename}, line {exc.lineno})" if exc.filename else ""
        raise EntryError(f"{where}: module {name!r} has a syntax error: {exc.msg}{at}") from None
    except SystemExit as exc:
        raise EntryError(
            f"{where}: importing module {name!r} called sys.exit({exc.code!r}); a module must "
            "not exit when it is imported (move that code under `if __name__ == '__main__':`)"
        ) from None
    except Exception as exc:
        raise EntryError(f"{where}: importing module {name!r} raised {_described(exc)}") from None


def _described(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _build(key: str, path: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call an entry builder; what it raises (or a sys.exit in it) names the key."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as exc:
        raise EntryError(f"{key}={path!r}: the builder called sys.exit({exc.code!r})") from None
    except Exception as exc:
        raise EntryError(f"{key}={path!r}: the builder raised {_described(exc)}") from exc


def _call_builder(fn: Callable[..., Any], cfg: DictConfig, start_step: int | None = None) -> Any:
    """A dataset builder: ``fn(cfg)``, plus ``start_step=`` when it takes it and the ``data``
    keys it declares as keyword-only parameters (`koochak.loop.declared`)."""
    declared = keyword_values(fn, to_container(cfg.data))
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some callables have no signature: call them plainly
        return fn(cfg)
    accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if start_step is not None and ("start_step" in params or accepts_kwargs):
        return fn(cfg, start_step=start_step, **declared)
    return fn(cfg, **declared)


def build_hooks(cfg: DictConfig) -> dict[str, list[Callable[[dict[str, Any]], None]]]:
    """stdout / CSV / JSONL / W&B / progress hooks as the ``logging`` and ``wandb`` sections say,
    plus Scruffy event hooks when running as a Scruffy worker (SCRUFFY_ROOT and SCRUFFY_JOB_ID)."""
    from koochak.loop import logging as sinks
    from koochak.loop.hooks import merge

    out_dir = str(cfg.train.out_dir)
    parts = []
    if cfg.logging.stdout:
        parts.append(sinks.make_stdout_hooks(print_config=bool(cfg.logging.print_config)))
    parts.append(sinks.make_csv_hooks(cfg.logging.csv_path or os.path.join(out_dir, "log.csv")))
    parts.append(
        sinks.make_jsonl_hooks(cfg.logging.jsonl_path or os.path.join(out_dir, "log.jsonl"))
    )
    if cfg.wandb.enabled:
        parts.append(sinks.make_wandb_hooks(cfg))
    if cfg.logging.tensorboard:
        log_dir = cfg.logging.tensorboard_dir or os.path.join(out_dir, "tensorboard")
        parts.append(sinks.make_tensorboard_hooks(log_dir))
    if cfg.train.progress_bar:
        parts.append(sinks.make_progress_hooks())
    if os.environ.get("SCRUFFY_ROOT") and os.environ.get("SCRUFFY_JOB_ID"):
        parts.append(_scruffy_hooks())
    if cfg.entry.hooks:  # the user's own (early stopping with StopTraining, a budget, ...)
        make_hooks = import_entry(cfg.entry.hooks, "entry.hooks")
        parts.append(_build("entry.hooks", cfg.entry.hooks, make_hooks, cfg))
    return merge(*parts)


def _scruffy_hooks() -> dict[str, list[Callable[[dict[str, Any]], None]]]:
    # Inside a Scruffy worker the run reports its lifecycle and checkpoints there. The client is
    # imported and validated now, before any training, so a missing one fails the launch.
    try:
        from koochak.events import make_scruffy_hooks
    except ImportError:
        raise ConfigError(
            "SCRUFFY_ROOT and SCRUFFY_JOB_ID are set, so koochak-train publishes workload events "
            "to Scruffy, which needs koochak-events: pip install 'koochak-loop[events]'"
        ) from None
    return make_scruffy_hooks()


def _find_resume(cfg: DictConfig, mode: str) -> tuple[str | None, dict[str, Any] | None]:
    if mode != "auto":
        return None, None
    if cfg.train.fsdp.enabled:
        # Every rank verifies a share of the parts and later reads only its own shards: that
        # needs the process group now (training_loop then uses the same one).
        from koochak.loop.checkpoint.resume import resume_checkpoint
        from koochak.loop.config import resolve_train_config
        from koochak.loop.ddp import setup_ddp
        from koochak.loop.device import get_device
        from koochak.loop.fsdp import shard_size

        train = resolve_train_config(cfg.train)
        setup = setup_ddp(train, get_device(str(cfg.train.device)))
        passed: list[dict[str, Any]] = []  # (the sharded selection does not list what it skips)
        size = shard_size(train.fsdp, setup.world_size)  # HSDP: the rows of its shard group
        found = resume_checkpoint("auto", checkpoint_locations(cfg.train), sharded=True,
                                  shard_size=size)  # fmt: skip
    else:
        passed = []
        found = resolve_auto_resume(checkpoint_locations(cfg.train), passed)  # every tier
    if int(os.environ.get("RANK", "0")) == 0:  # the run history's resume record
        from koochak.loop.run_history import record_resume_selection

        record_resume_selection(str(cfg.train.out_dir), checkpoint_locations(cfg.train),
                                found[0] if found else None, found[1] if found else None,
                                passed, cfg.train.max_steps)  # fmt: skip
    return (None, None) if found is None else (str(found[0]), found[1])


def _check_launch(cfg: DictConfig) -> None:
    """What training_loop would refuse in its first lines, refused now as a usage error (exit 2):
    a device this machine lacks, DDP without a launcher, a checkpoint_dir no store serves."""
    from koochak.loop.device import get_device
    from koochak.loop.dist import check_launch_environment

    get_device(str(cfg.train.device))
    if cfg.train.ddp or cfg.train.fsdp.enabled:
        check_launch_environment("train.fsdp.enabled" if cfg.train.fsdp.enabled else "train.ddp")
    if cfg.train.fsdp.enabled and cfg.train.fsdp.hsdp:  # the shard groups tile the world
        from koochak.loop.config import resolve_train_config
        from koochak.loop.fsdp import shard_size

        shard_size(resolve_train_config(cfg.train).fsdp, int(os.environ.get("WORLD_SIZE", "1")))
    for location in checkpoint_locations(cfg.train):
        checkpoint_store(location)
    from koochak.loop.checkpoint.tier_marker import check_reachable
    from koochak.loop.config import resolve_train_config

    check_reachable(resolve_train_config(cfg.train))  # every tier can be listed


def _hold_location(cfg: DictConfig, resume: str) -> None:
    """Claim the run's locations now (the leases, then the tier markers: ``claim_run``), before
    the model and data are built; training_loop finds the claim. Under DDP/FSDP with several
    ranks the process group starts here, so that every rank learns of a refusal through one
    broadcast (training_loop then uses the same group)."""
    from koochak.loop.config import resolve_train_config
    from koochak.loop.run_lease import claim_run

    train = resolve_train_config(cfg.train)
    if (train.ddp or train.fsdp.enabled) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from koochak.loop.ddp import setup_ddp
        from koochak.loop.device import get_device

        setup_ddp(train, get_device(str(cfg.train.device)))
    claim_run(train, int(os.environ.get("RANK", "0")), fresh=resume == "none", early=True)


def _prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Everything up to the call of training_loop; any error here is a usage error (exit 2)."""
    from koochak.loop.optim import build_scheduler
    from koochak.loop.seed import set_all_seeds

    cfg, report = load_config_with_report(args.config, args.overrides)
    set_level(cfg.logging.level)  # Koochak's lines on stderr from here on at the configured level
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(report), flush=True)
    _check_launch(cfg)
    # Install the evacuation handler before building the model and data (which can take minutes):
    # a SIGUSR1 in that window is then recorded and honoured after the first update, instead of
    # killing the process with the signal's default action.
    evacuation = make_evacuation(None, cfg.train)
    if evacuation is not None:
        evacuation.install()
    entry = get_section(cfg, "entry")
    make_model = import_entry(entry.model, "entry.model")
    make_dataset = import_entry(entry.dataset, "entry.dataset")
    # A custom update (entry.update) may compute its losses itself and need no step_fn.
    update = entry.get("update")  # not entry.update: a mapping's own method of that name
    step_fn = import_entry(entry.step, "entry.step") if entry.step or not update else None
    update_fn = import_entry(update, "entry.update") if update else None
    make_state = import_entry(entry.state, "entry.state") if entry.state else None
    make_eval = (
        import_entry(entry.eval_dataset, "entry.eval_dataset") if entry.eval_dataset else None
    )
    eval_fn = import_entry(entry.eval_fn, "entry.eval_fn") if entry.eval_fn else None
    if (make_eval is None) != (eval_fn is None):
        raise ConfigError("entry.eval_dataset and entry.eval_fn must be given together")
    builders = [("entry.model", entry.model, make_model), ("entry.dataset", entry.dataset,
                make_dataset)] + ([("entry.eval_dataset", entry.eval_dataset, make_eval)]
                                  if make_eval is not None else [])  # fmt: skip
    check_declared_sections(to_container(cfg), builders, lambda key: _blame(key, args.config,
                            args.overrides), strict=bool(cfg.train.strict_config))  # fmt: skip
    # Claim the location once every usage error above has had its say (a refused start, or one
    # with a misspelt key, changes nothing there) and before anything is built (exit 2).
    _hold_location(cfg, args.resume)

    set_all_seeds(int(cfg.train.seed))
    resume_path, checkpoint = _find_resume(cfg, args.resume)
    start_step = int(checkpoint["next_step"]) if checkpoint is not None else 0
    if checkpoint is not None and cfg.wandb.enabled and cfg.wandb.mode != "disabled":
        check_restart_settings(to_container(cfg.wandb), start_step)
    model = _build("entry.model", entry.model, make_model, cfg,
                   **keyword_values(make_model, to_container(cfg.model)))  # fmt: skip
    optimizer: Any = _optimizer_for(model, cfg)
    # A resumed run with a longer train.max_steps continues the checkpoint's schedule.
    scheduler: Any = build_scheduler(
        optimizer, cfg.optim.scheduler, cfg.train, checkpoint=checkpoint
    )
    if cfg.train.fsdp.enabled:
        # Sharding replaces the parameters: training_loop builds both again once it has sharded
        # (the ones above only proved the sections valid, before any training).
        optimizer = partial(_optimizer_for, cfg=cfg)
        scheduler = partial(build_scheduler, cfg=cfg.optim.scheduler, train_cfg=cfg.train,
                            checkpoint=checkpoint)  # fmt: skip
    return {
        "model": model,
        "dataset": _build(
            "entry.dataset", entry.dataset, _call_builder, make_dataset, cfg, start_step
        ),
        "step_fn": step_fn,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "train_cfg": cfg.train,
        # What the run records (config.yaml, checkpoints, W&B): secrets masked (masking.py).
        "config_json": recorded_config(
            to_container(cfg), OmegaConf.to_container(cfg, resolve=False)
        ),
        "checkpoint_dict": checkpoint,
        "eval_dataset": (
            _build("entry.eval_dataset", entry.eval_dataset, _call_builder, make_eval, cfg)
            if make_eval is not None
            else None
        ),
        "eval_fn": eval_fn,
        "hooks": build_hooks(cfg),
        "resume": args.resume,
        "auto_resume_path": resume_path,
        "evacuation": evacuation,
        **({"update_fn": update_fn} if update_fn is not None else {}),
        # Called by training_loop once the model is on its device (and sharded).
        **({"state": partial(_state_for, make_state, entry.state, cfg)} if make_state else {}),
    }


def _state_for(make_state: Any, path: str, cfg: DictConfig, model: Any) -> Any:
    """``entry.state(model, cfg)``: the stateful objects every checkpoint carries."""
    return _build("entry.state", path, make_state, model, cfg)


def _optimizer_for(model: Any, cfg: DictConfig) -> Any:
    """``entry.optimizer(model, cfg)`` when the config names one, else ``optim.optimizer``'s."""
    import torch
    from koochak.loop.optim import build_optimizer

    entry = get_section(cfg, "entry")
    if not entry.optimizer:
        return build_optimizer(model, get_section(cfg, "optim").optimizer)
    make_optimizer = import_entry(entry.optimizer, "entry.optimizer")
    optimizer = _build("entry.optimizer", entry.optimizer, make_optimizer, model, cfg)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"entry.optimizer: {entry.optimizer} returned {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer; it is called as fn(model, cfg)"
        )
    return optimizer


def _fail(prefix: str, exc: BaseException, suffix: str = "", prog: str = "koochak-train") -> None:
    # An exception's message is foreign text: the run's named secrets are masked in it.
    message = " ".join(mask_text(str(exc)).split()) or type(exc).__name__
    print(f"{prog}: {prefix}{message}{suffix}", file=sys.stderr)


def _debug_traceback(code: int) -> int:
    """``--debug``: re-raise for the interpreter's traceback; under named secrets, or when the
    traceback holds a credential (a URL password ...), print it here, masked, and return
    ``code`` (the interpreter would print it after the masking ended)."""
    text = traceback.format_exc()
    if not masking_active() and mask_text(text) == text:
        raise  # called from an except block: re-raises the error being handled
    sys.stderr.write(text)  # masked on its way out (masked_output)
    return code


def run_with_one_line_errors(
    prog: str, main: Callable[[list[str]], Any], argv: Sequence[str] | None = None
) -> int:
    """Call ``main(argv)`` the way a script's ``__main__`` should: 0 when it returns; an exception
    is one line on stderr and exit code 1, with the traceback only when argv has ``--debug``."""
    args = list(sys.argv[1:] if argv is None else argv)
    with masked_output():
        try:
            main(args)
        except Exception as exc:
            if "--debug" in args:
                return _debug_traceback(EXIT_TRAINING_FAILED)
            suffix = " (rerun with --debug for the traceback)"
            _fail(f"{type(exc).__name__}: ", exc, suffix, prog=prog)
            return EXIT_TRAINING_FAILED
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    tie_to_parent()  # under `uv run` or the launcher: no orphan trainer when it is killed
    # Overrides may stand on both sides of a flag (`--config c a=1 --resume none b=2`, as users
    # append flags to a command line): parse_args would take only the first run of them.
    args = _parser().parse_intermixed_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        with masked_output():
            return _run(args)
    # One rank of several (torchrun): leave with the code through exit_distributed_process, the
    # 75 of an evacuation and the 79 of a GPU-health stop included.
    try:
        with masked_output():
            code = _run(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    exit_distributed_process(code)


def _run(args: argparse.Namespace) -> int:
    # Logging is configured once, before the config is read (its warnings are one line too);
    # the level follows logging.level as soon as the config is loaded.
    with console_logging("INFO"):
        return _run_configured(args)


def _run_configured(args: argparse.Namespace) -> int:
    from koochak.loop.run_lease import release_unclaimed

    try:
        return _train(args)
    finally:
        release_unclaimed()  # taken in _prepare for a run that never reached training_loop


def _train(args: argparse.Namespace) -> int:
    try:
        kwargs = _prepare(args)
    except Exception as exc:
        if args.debug:
            return _debug_traceback(EXIT_USAGE)
        _fail("error: ", exc)
        return EXIT_USAGE
    from koochak.loop.loop import training_loop

    try:
        training_loop(**kwargs)
    except SystemExit as exc:
        if isinstance(exc, (Evacuated, GpuUnhealthy)):
            raise  # 75 and 79: the codes the launcher and the scheduler act on
        # sys.exit() in a step_fn or hook: never a silent 0 for a run that did not finish.
        code = exc.code if isinstance(exc.code, int) and exc.code != 0 else EXIT_TRAINING_FAILED
        _fail(
            "training failed: ",
            RuntimeError(
                f"the training code called sys.exit({exc.code!r}) before the run finished; no "
                "terminal checkpoint was saved (raise koochak.loop.hooks.StopTraining to end a run "
                "with one)"
            ),
        )
        return code
    except ConfigError as exc:  # a resume that changed the run, or a lost lease (run_lease)
        if args.debug:
            raise
        _fail("error: ", exc)
        return EXIT_USAGE
    except Exception as exc:
        code = checkpoint_exit_code(exc)  # Scruffy did not accept a checkpoint: 76 or 77
        if code is not None:
            if args.debug:
                traceback.print_exception(type(exc), exc, exc.__traceback__)
            return code
        if args.debug:
            return _debug_traceback(EXIT_TRAINING_FAILED)
        _fail(
            f"training failed ({type(exc).__name__}): ",
            exc,
            " (rerun with --debug for the traceback)",
        )
        return EXIT_TRAINING_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
