"""EDM2 post-hoc EMA: choose the averaging length after training, from saved power shadows.

(Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models", section 3
and appendix C.) A power-profile shadow of exponent ``gamma`` taken after model step ``t`` is,
up to discretisation, the average of the weights ``theta_tau`` seen so far under the profile

    p(tau) = (gamma + 1) * tau**gamma / t**(gamma + 1)        for 0 <= tau <= t.

Any linear combination of saved shadows is the same combination of their profiles applied to the
same weights. So a shadow with another ``gamma`` (or ``srel``) at another ``t`` is reconstructed
by the coefficients ``x`` whose combined profile is closest, in L2, to the target profile: the
least-squares solution of ``A x = b`` with ``A[i, j] = <p_i, p_j>`` and ``b[i] = <p_i, p_target>``.
For two power profiles the inner product has a closed form (with ``m = min(t_a, t_b)``):

    <p_a, p_b> = (g_a + 1)(g_b + 1) / (g_a + g_b + 1) * m**(g_a + g_b + 1)
                 / (t_a**(g_a + 1) * t_b**(g_b + 1))

Run with dual EMA (``train.ema.dual``) and periodic checkpoints kept (``train.keep_last_k: null``),
then ``python -m koochak.loop.ema_posthoc RUN_DIR --srel 0.07 --out ema_0.07.pt``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from koochak.loop.ema import check_ema_state, srel_to_gamma

log = logging.getLogger("koochak.loop.ema_posthoc")

__all__ = [
    "collect_power_ema_states",
    "posthoc_coefficients",
    "power_ema_states",
    "power_profile_inner",
    "reconstruct_dual_power_ema_state_dict",
    "reconstruct_power_ema_state_dict",
]


def power_profile_inner(t_a: float, gamma_a: float, t_b: float, gamma_b: float) -> float:
    """``<p_a, p_b>``: the L2 inner product of two power profiles ending at ``t_a`` and ``t_b``."""
    # Written as (m / t_max) ** g_other / t_max, which never overflows for large gammas.
    if t_a <= t_b:
        ratio, power, t_max = t_a / t_b, gamma_b, t_b
    else:
        ratio, power, t_max = t_b / t_a, gamma_a, t_a
    return (gamma_a + 1) * (gamma_b + 1) / (gamma_a + gamma_b + 1) * ratio**power / t_max


def posthoc_coefficients(
    stored: Sequence[tuple[float, float]], target_step: float, target_gamma: float
) -> np.ndarray:
    """Least-squares weights of the ``(step, gamma)`` stored profiles for the target profile."""
    if not stored:
        raise ValueError("post-hoc EMA needs at least one stored power shadow")
    a = np.array([[power_profile_inner(ti, gi, tj, gj) for tj, gj in stored] for ti, gi in stored])
    b = np.array([power_profile_inner(ti, gi, target_step, target_gamma) for ti, gi in stored])
    return np.linalg.lstsq(a, b, rcond=None)[0]


def power_ema_states(ckpt: Mapping[str, Any], source: str = "checkpoint") -> list[dict[str, Any]]:
    """The power shadows of one checkpoint as ``{"gamma", "step", "state_dict"}`` dicts.

    ``step`` is the number of model steps the shadows had taken in (their profile's end).
    """
    slot = ckpt.get("ema") if "ema" in ckpt else None
    if slot is None:
        raise ValueError(f"{source}: has no EMA shadows (field 'ema' is null)")
    check_ema_state(slot, source)
    if slot["start_step"] != 0:
        raise ValueError(
            f"{source}: its EMA shadows started at step {slot['start_step']}, not 0, so their "
            "profiles are not power functions of the whole run; post-hoc EMA cannot use them"
        )
    step = slot["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{source}: field 'ema.step' must be an int >= 1, got {step!r}")
    states = []
    for i, shadow in enumerate(slot["shadows"]):
        if shadow["profile"] != "power":
            continue
        gamma = shadow["gamma"]
        if not _is_number(gamma) or not (math.isfinite(gamma) and gamma >= 0):
            raise ValueError(
                f"{source}: field 'ema.shadows[{i}].gamma' must be a finite number >= 0, "
                f"got {gamma!r}"
            )
        states.append({"gamma": float(gamma), "step": step, "state_dict": shadow["state_dict"]})
    if not states:
        raise ValueError(f"{source}: its EMA shadows use the constant profile, not power")
    return states


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _target_gamma(
    srel: float | None, gamma: float | None, names: tuple[str, str] = ("srel", "gamma")
) -> float:
    """The target exponent, from exactly one of ``srel`` and ``gamma``, both checked as the EMA
    library checks them (``names`` are what errors call them: the CLI says ``--srel``)."""
    if (srel is None) == (gamma is None):
        raise ValueError(
            f"give exactly one of {names[0]} or {names[1]} "
            f"(got {names[0]}={srel!r}, {names[1]}={gamma!r})"
        )
    if srel is not None:
        if not _is_number(srel):
            raise ValueError(f"{names[0]} must be a number, got {srel!r}")
        try:
            return srel_to_gamma(srel)
        except ValueError as exc:
            raise ValueError(f"{names[0]}: {exc}") from None
    if not _is_number(gamma) or not (math.isfinite(gamma) and gamma >= 0):  # type: ignore[arg-type]
        raise ValueError(
            f"{names[1]} must be a finite number >= 0 (the power profile's exponent; "
            f"0 is the uniform average), got {gamma!r}"
        )
    return float(gamma)  # type: ignore[arg-type]


def _layout(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """What must agree between shadows that are combined: each key's shape (or type)."""
    return {
        key: tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        for key, value in state_dict.items()
    }


def _layout_difference(expected: Mapping[str, Any], found: Mapping[str, Any]) -> str | None:
    """How ``found`` differs from ``expected`` (keys first, then shapes), or None."""
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"has extra {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
        return "other state-dict keys: it " + " and ".join(parts)
    for key in expected:
        if found[key] != expected[key]:
            return f"key {key!r} is {_shape(found[key])}, not {_shape(expected[key])}"
    return None


def _shape(layout: Any) -> str:
    return f"shape {list(layout)}" if isinstance(layout, tuple) else f"a {layout}"


def _check_finite(coefficients: np.ndarray, result: Mapping[str, torch.Tensor]) -> None:
    if not np.isfinite(coefficients).all():
        raise ValueError(
            "the post-hoc coefficients are not finite (the stored profiles are degenerate); "
            "nothing was written"
        )
    for key, tensor in result.items():
        floating = isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
        if floating and not bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"the reconstruction of {key!r} is not finite (a stored shadow holds NaN or "
                "Inf?); nothing was written"
            )


def _combine(pairs: Iterable[tuple[float, Mapping[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """``sum_i x_i * state_i`` in float64, cast back; non-float entries from the last state."""
    total: dict[str, torch.Tensor] = {}
    last: Mapping[str, torch.Tensor] = {}
    for x, state in pairs:
        for key, tensor in state.items():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                term = tensor.detach().to("cpu", torch.float64) * float(x)
                total[key] = total[key] + term if key in total else term
        last = state
    return {
        key: total[key].to(tensor.dtype) if key in total else tensor for key, tensor in last.items()
    }


def reconstruct_power_ema_state_dict(
    states: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
    *,
    srel: float | Sequence[float] | None = None,
    gamma: float | Sequence[float] | None = None,
    step: int | None = None,
    srel_target: float | Sequence[float] | None = None,
    gamma_target: float | Sequence[float] | None = None,
) -> Any:
    """The state dict of a power EMA of width ``srel`` (or exponent ``gamma``) at ``step``.

    ``states`` is the flattened list of stored power shadows (``{"gamma", "step",
    "state_dict"}``, e.g. ``power_ema_states`` of several checkpoints, both dual shadows of
    each), or a list of such lists (one per checkpoint), which is flattened. ``step`` defaults
    to the latest stored step. The result is keyed like the model's state dict, in its dtypes.

    Upstream's spellings work too: ``srel_target=`` / ``gamma_target=`` (the same as ``srel``
    / ``gamma``; giving both spellings is an error), and a list of targets
    (``srel=[0.05, 0.1]``) returns a list of state dicts, one per target, in that order.
    """
    srel = _one_spelling("srel", srel, srel_target)
    gamma = _one_spelling("gamma", gamma, gamma_target)
    states = [s for item in states for s in ([item] if isinstance(item, Mapping) else item)]
    for name, targets in (("srel", srel), ("gamma", gamma)):
        if isinstance(targets, Sequence) and not isinstance(targets, (str, bytes)):
            one = {"srel": None, "gamma": None}
            return [
                reconstruct_power_ema_state_dict(states, step=step, **{**one, name: target})
                for target in targets
            ]
    target_gamma = _target_gamma(srel, gamma)  # type: ignore[arg-type]
    if not states:
        raise ValueError("post-hoc EMA needs at least one stored power shadow")
    latest = max(int(s["step"]) for s in states)
    target_step = latest if step is None else int(step)
    if not 0 < target_step <= latest:
        raise ValueError(
            f"step must be in 1..{latest} (the latest stored shadow), got {target_step}"
        )
    # Shapes too: a (1,) tensor broadcasts against a (4,) one, and mixing two models must fail.
    first = _layout(states[0]["state_dict"])
    for i, state in enumerate(states):
        difference = _layout_difference(first, _layout(state["state_dict"]))
        if difference is not None:
            raise ValueError(
                f"stored shadow {i} is not of the same model as shadow 0: {difference}"
            )
    x = posthoc_coefficients([(s["step"], s["gamma"]) for s in states], target_step, target_gamma)
    ordered = sorted(range(len(states)), key=lambda i: states[i]["step"])  # latest last
    result = _combine((float(x[i]), states[i]["state_dict"]) for i in ordered)
    _check_finite(x, result)
    return result


def _one_spelling(name: str, value: Any, upstream: Any) -> Any:
    if value is not None and upstream is not None:
        raise ValueError(f"give {name}= or {name}_target= (the same target), not both")
    return upstream if upstream is not None else value


def reconstruct_dual_power_ema_state_dict(
    ckpt: Mapping[str, Any], *, srel: float | None = None, gamma: float | None = None
) -> dict[str, torch.Tensor]:
    """The lightweight variant: the best fit from the two dual shadows of one checkpoint."""
    return reconstruct_power_ema_state_dict(power_ema_states(ckpt), srel=srel, gamma=gamma)


def collect_power_ema_states(location: Any) -> list[dict[str, Any]]:
    """Every published checkpoint's power shadows in ``location`` (verified reads), flattened.

    A checkpoint that fails verification or has no power shadows is skipped with a logged reason.
    Holds every shadow in memory; ``main`` streams instead (two passes) for large models.
    """
    states: list[dict[str, Any]] = []
    for name, ckpt in _published(location):
        try:
            states.extend(power_ema_states(ckpt, name))
        except ValueError as exc:
            log.warning("skipping %s: %s", name, exc)
    return states


def _published(location: Any) -> Iterable[tuple[str, dict[str, Any]]]:
    from koochak.loop.checkpoint import CHECKPOINT_PATTERN, checkpoint_store
    from koochak.loop.checkpoint.layouts import read_checkpoint
    from koochak.storage import artifact

    store = checkpoint_store(location)
    for _, name in sorted(artifact.published_candidates(store, CHECKPOINT_PATTERN)):
        try:
            _, data = artifact.read_verified(store, name)
            yield name, read_checkpoint(store, name, data, name)  # one file or parts
        except (artifact.InvalidArtifact, ValueError) as exc:
            log.warning("skipping %s: %s", name, exc)


# ----------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    from koochak.loop.cli import OneLineArgumentParser

    parser = OneLineArgumentParser(
        prog="python -m koochak.loop.ema_posthoc",
        description="Reconstruct a power EMA of any width from a run's saved dual-EMA checkpoints.",
    )
    parser.add_argument("location", help="the run's checkpoint directory or scheme:// URI")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--srel", type=float, help="target relative width, e.g. 0.07")
    group.add_argument("--gamma", type=float, help="target power exponent")
    parser.add_argument("--step", type=int, help="profile end in model steps (default: latest)")
    parser.add_argument("--out", required=True, help="state dict to write (create-only)")
    parser.add_argument("--json", action="store_true", help="print the coefficients as JSON")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return parser


def _run(argv: Sequence[str]) -> None:
    args = _parser().parse_args(argv)
    if os.path.lexists(args.out):
        raise FileExistsError(f"{args.out}: already exists; choose another --out")
    target_gamma = _target_gamma(args.srel, args.gamma, ("--srel", "--gamma"))
    # Pass 1: the profiles and layouts only, so the shadows of every checkpoint are never in
    # memory at once. Every shadow must be of one model: same keys, same shapes.
    stored: list[tuple[str, int, int, float]] = []  # (name, shadow index, step, gamma)
    first: tuple[str, int, dict[str, Any]] | None = None
    for name, ckpt in _published(args.location):
        try:
            states = power_ema_states(ckpt, name)
        except ValueError as exc:
            log.warning("skipping %s: %s", name, exc)
            continue
        for i, state in enumerate(states):
            layout = _layout(state["state_dict"])
            if first is None:
                first = (name, i, layout)
            difference = _layout_difference(first[2], layout)
            if difference is not None:
                raise ValueError(
                    f"{args.location}: {name} shadow {i} is not of the same model as "
                    f"{first[0]} shadow {first[1]}: {difference}; a run directory must hold "
                    "one model's checkpoints"
                )
        stored += [(name, i, s["step"], s["gamma"]) for i, s in enumerate(states)]
    if not stored:
        raise ValueError(f"{args.location}: no published checkpoint holds power EMA shadows")
    target_step = max(s[2] for s in stored) if args.step is None else args.step
    if not 0 < target_step <= max(s[2] for s in stored):
        raise ValueError(f"--step must be in 1..{max(s[2] for s in stored)}, got {target_step}")
    x = posthoc_coefficients([(s[2], s[3]) for s in stored], target_step, target_gamma)
    weight = {(s[0], s[1]): float(c) for s, c in zip(stored, x)}

    used = {s[0] for s in stored}

    def weighted() -> Iterable[tuple[float, Mapping[str, torch.Tensor]]]:  # pass 2
        for name, ckpt in _published(args.location):
            if name not in used:  # skipped in pass 1, or published since
                continue
            for i, state in enumerate(power_ema_states(ckpt, name)):
                if (name, i) in weight:
                    yield weight[(name, i)], state["state_dict"]

    result = _combine(weighted())  # checkpoints in step order: the latest one's last
    _check_finite(x, result)
    # Published create-only at the end (a temporary name, then a link): a failure above, or a
    # crash while writing, leaves nothing at --out.
    buffer = io.BytesIO()
    torch.save(result, buffer)
    from koochak.storage.store import LocalStore

    parent, base = os.path.split(os.path.abspath(args.out))
    LocalStore(parent).put(base, buffer.getvalue())
    report = {
        "out": args.out,
        "target_gamma": target_gamma,
        "target_step": target_step,
        "coefficients": [
            {
                "checkpoint": s[0],
                "shadow": s[1],
                "step": s[2],
                "gamma": s[3],
                "weight": weight[s[:2]],
            }
            for s in stored
        ],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"wrote {args.out}: gamma {target_gamma:.4f} at step {target_step} from "
              f"{len(stored)} stored shadow(s)")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    from koochak.loop.cli import run_with_one_line_errors

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    return run_with_one_line_errors("koochak.loop.ema_posthoc", _run, argv)


if __name__ == "__main__":
    sys.exit(main())
