"""Checkpoints that cannot lie: the public face of koochak.loop's checkpoint helpers.

- format (``checkpoint_format``): ``checkpoint_name``, ``build_checkpoint``, weights-only
  ``serialize_checkpoint``/``deserialize_checkpoint``, ``match_state_dict_to_model``,
  ``restore_training_state``;
- publication (``publish`` module): ``publish``, ``save``, ``checkpoint_store``, through
  ``koochak.storage.artifact``;
- selection (``resume``): ``load``, ``latest``, ``best``, ``highest_valid_published``,
  ``resolve_auto_resume``.

See docs/checkpoints.md for how they fit together.
"""

from koochak.loop._async_publish import CheckpointPublishError
from koochak.loop.checkpoint_format import (
    CHECKPOINT_PATTERN,
    CHECKPOINT_VERSION,
    LATEST_NAME,
    build_checkpoint,
    check_resume_cursor,
    checkpoint_name,
    deserialize_checkpoint,
    match_state_dict_to_model,
    restore_training_state,
    rng_state_for_rank,
    serialize_checkpoint,
    unwrap_model,
)
from koochak.loop.publish import checkpoint_store, publish, save
from koochak.loop.resume import best, highest_valid_published, latest, load, resolve_auto_resume

__all__ = [
    "CHECKPOINT_PATTERN",
    "CHECKPOINT_VERSION",
    "LATEST_NAME",
    "CheckpointPublishError",
    "best",
    "build_checkpoint",
    "check_resume_cursor",
    "checkpoint_name",
    "checkpoint_store",
    "deserialize_checkpoint",
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
