"""Deprecated alias of the checkpoint dict's old module; kept for one minor version.

Import from ``koochak.loop.checkpoint`` (the names below; the modules behind them are
``koochak.loop.checkpoint.format``, ``.serialization`` and ``.restore``).
"""

import warnings

from koochak.loop.checkpoint.format import (
    CHECKPOINT_PATTERN,
    CHECKPOINT_VERSION,
    LATEST_NAME,
    REASONS,
    build_checkpoint,
    check_checkpoint_format,
    check_resume_cursor,
    check_rng_fields,
    checkpoint_name,
    step_of_name,
)
from koochak.loop.checkpoint.restore import restore_training_state, rng_state_for_rank
from koochak.loop.checkpoint.serialization import (
    deserialize_checkpoint,
    serialize_checkpoint,
    serialize_checkpoint_buffer,
    serialize_checkpoint_chunks,
)
from koochak.loop.state_dicts import match_state_dict_to_model, unwrap_model

__all__ = [
    "CHECKPOINT_PATTERN",
    "CHECKPOINT_VERSION",
    "LATEST_NAME",
    "REASONS",
    "build_checkpoint",
    "check_checkpoint_format",
    "check_resume_cursor",
    "check_rng_fields",
    "checkpoint_name",
    "deserialize_checkpoint",
    "match_state_dict_to_model",
    "restore_training_state",
    "rng_state_for_rank",
    "serialize_checkpoint",
    "serialize_checkpoint_buffer",
    "serialize_checkpoint_chunks",
    "step_of_name",
    "unwrap_model",
]

warnings.warn(
    "koochak.loop.checkpoint_format is deprecated and will be removed in the next minor version; "
    "import from koochak.loop.checkpoint (or its format, serialization and restore modules)",
    DeprecationWarning,
    stacklevel=2,
)
