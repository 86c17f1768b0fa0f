"""Checkpoints that cannot lie: koochak.loop's checkpoint helpers, one module per concern.

- ``format``: the checkpoint dict (``build_checkpoint``, ``checkpoint_name``, version and field
  checks, the resume cursor);
- ``serialization``: the dict as stored bytes and back (weights-only ``serialize_checkpoint`` /
  ``deserialize_checkpoint``, streamed for synchronous saves);
- ``restore``: putting it back (``restore_training_state``, RNG last);
- ``publication``: ``publish``, ``save`` (``parts=`` for checkpoints in parallel parts),
  ``checkpoint_store``, ``checkpoint_objects``, through ``koochak.storage.artifact``;
- ``resume``: selection (``load``, ``latest``, ``best``, ``highest_valid_published``,
  ``resolve_auto_resume``);
- ``run_checkpoints``: the component ``training_loop`` talks to (``open_checkpoints``: claim,
  select, check; then restore, periodic and terminal saves, release);
- ``saver``: what ``training_loop`` does to save (periodic and terminal, sync or async);
- ``export``: one consolidated weights file for inference (``export_weights``);
- ``tiers`` and ``replication``: a first tier backed by durable replica tiers
  (``train.checkpoint_replicas``), copies in the background, resume from any tier;
  ``tier_marker``: whose tier (the run id, ``koochak-tier.json``);
- ``layouts`` (one module per layout: ``one_file``, ``parts``, ``sharded``; the contract and the
  one place that tells them apart), ``commit`` (claim, commit, undo) and ``selection`` (the one
  walk over tiers); ``retention``: what a tier drops;
  ``settings``: the component's typed ``CheckpointConfig``.

Import the names below from ``koochak.loop.checkpoint``; see docs/checkpoints.md for how they fit
together.
"""

from koochak.loop.checkpoint.format import (
    CHECKPOINT_PATTERN,
    CHECKPOINT_VERSION,
    LATEST_NAME,
    build_checkpoint,
    check_resume_cursor,
    checkpoint_name,
)
from koochak.loop.checkpoint.publication import (
    checkpoint_objects,
    checkpoint_store,
    publish,
    save,
)
from koochak.loop.checkpoint.replication import CheckpointReplicationError
from koochak.loop.checkpoint.restore import restore_training_state, rng_state_for_rank
from koochak.loop.checkpoint.resume import (
    ResumePoint,
    best,
    highest_valid_published,
    latest,
    load,
    resolve_auto_resume,
)
from koochak.loop.checkpoint.saver import CheckpointPublishError
from koochak.loop.checkpoint.serialization import deserialize_checkpoint, serialize_checkpoint
from koochak.loop.checkpoint.tiers import checkpoint_locations
from koochak.loop.state_dicts import match_state_dict_to_model, unwrap_model

__all__ = [
    "CHECKPOINT_PATTERN",
    "CHECKPOINT_VERSION",
    "LATEST_NAME",
    "CheckpointPublishError",
    "CheckpointReplicationError",
    "ResumePoint",
    "best",
    "build_checkpoint",
    "check_resume_cursor",
    "checkpoint_locations",
    "checkpoint_name",
    "checkpoint_objects",
    "checkpoint_store",
    "deserialize_checkpoint",
    "export_weights",
    "highest_valid_published",
    "latest",
    "load",
    "match_state_dict_to_model",
    "publish",
    "resolve_auto_resume",
    "restore_training_state",
    "rng_state_for_rank",
    "save",
    "serialize_checkpoint",
    "unwrap_model",
]


def __getattr__(name: str):
    # export is imported on first use, not with the package: ``python -m
    # koochak.loop.checkpoint.export`` would otherwise find it imported already (runpy warns).
    if name == "export_weights":
        from koochak.loop.checkpoint.export import export_weights

        return export_weights
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
