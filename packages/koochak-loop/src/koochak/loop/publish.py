"""Deprecated alias of checkpoint publication's old module; kept for one minor version.

Import from ``koochak.loop.checkpoint`` (``publish``, ``save``, ``checkpoint_store``); the module
behind them is ``koochak.loop.checkpoint.publication``.
"""

import warnings

from koochak.loop.checkpoint.publication import (
    checkpoint_store,
    publication_path,
    publish,
    save,
    split_checkpoint_path,
)

__all__ = ["checkpoint_store", "publication_path", "publish", "save", "split_checkpoint_path"]

warnings.warn(
    "koochak.loop.publish is deprecated and will be removed in the next minor version; "
    "import publish, save and checkpoint_store from koochak.loop.checkpoint",
    DeprecationWarning,
    stacklevel=2,
)
