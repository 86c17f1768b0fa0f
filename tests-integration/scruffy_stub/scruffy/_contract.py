"""Which Scruffy contract this stub plays: SCRUFFY_STUB_CONTRACT=0.1.1 (default) or newer.

* ``0.1.1``: ``scruffy-gpu`` 0.1.1 as released (the contract file's sections 1-10):
  ``publish_event`` has no ``wait``/``timeout``; task dicts take only the nine keys; exit codes
  75/76 are plain ``application_exit`` failures; retries are explicit new attempts.
* ``newer``: the contract the Koochak spec targets: ``publish_event(..., wait=False,
  timeout=None)`` acknowledges, tasks (and ``submit_job``) take a ``recovery`` mapping, and the
  controller retries a task in place on a listed reason (exit 76 = ``checkpoint_ack_timeout``,
  exit 75 = ``evacuated``) up to ``max_attempts``.

Read once at import; the controller takes ``--contract`` and passes it to its jobs.
"""

from __future__ import annotations

import os

CONTRACTS = ("0.1.1", "newer")
CONTRACT = os.environ.get("SCRUFFY_STUB_CONTRACT", "0.1.1") or "0.1.1"
if CONTRACT not in CONTRACTS:
    raise ImportError(f"SCRUFFY_STUB_CONTRACT={CONTRACT!r}: expected one of {', '.join(CONTRACTS)}")
NEWER = CONTRACT == "newer"
VERSION = "0.1.1" if not NEWER else "0.2.0.dev0"
