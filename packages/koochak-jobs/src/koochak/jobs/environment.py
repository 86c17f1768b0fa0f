"""The workload's clean environment, rebuilt on the node from the launch manifest.

Start from the profile's resolved ``set``; add the runtime-owned identity the node provides
(``inherit`` patterns: SLURM_*, SCRUFFY_*, GPU identity, ranks, HOME ...) and the named secrets;
drop everything else (the ambient PATH, PYTHONPATH, CC, NCCL_* ...). Secret values live only in
the returned mapping and are handed to child processes; they are never written anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from koochak.jobs.preflight import PreflightError
from koochak.jobs.profile import canonical_sha256, is_runtime_owned

__all__ = ["build_environment", "environment_sha256"]


def build_environment(section: Mapping[str, Any], ambient: Mapping[str, str]) -> dict[str, str]:
    """The clean environment for the manifest's ``environment`` ``section``.

    Raises PreflightError (check ``secrets``) naming every secret missing from ``ambient``,
    never a value.
    """
    clean = dict(section["set"])
    patterns: Sequence[str] = section["inherit"]
    for name, value in ambient.items():
        if is_runtime_owned(name, patterns):
            clean[name] = value
    missing = [name for name in section["secrets"] if name not in ambient]
    if missing:
        raise PreflightError(
            "secrets",
            f"missing secret environment names: {missing}; export them where the runner starts",
        )
    for name in section["secrets"]:
        clean[name] = ambient[name]
    return clean


def environment_sha256(
    clean: Mapping[str, str], secrets: Sequence[str], inherit: Sequence[str] = ()
) -> str:
    """Digest of the environment the run declares: the clean environment without the secrets
    (names and values both left out) and without the runtime-owned names matching ``inherit``
    (``SLURM_*``, ``SCRUFFY_*``, ``RANK``, ...), which differ by backend, node and attempt, so the
    same prepared run has the same digest under Scruffy and under Slurm."""
    hidden = set(secrets)
    return canonical_sha256(
        {k: v for k, v in clean.items() if k not in hidden and not is_runtime_owned(k, inherit)}
    )
