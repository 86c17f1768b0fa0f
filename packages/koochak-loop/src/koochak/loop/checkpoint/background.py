"""Background work that yields the CPU to the training thread.

An async checkpoint's writers hash and write for seconds while training runs. They hold the
interpreter lock only between chunks (hashing and file writes release it), but on a machine with
few cores they still compete with the training thread for the cores themselves. So a background
save's thread lowers its own scheduling priority first; Linux gives priority per thread, and
threads it starts (part writers, the store's hashing helpers) inherit it, while the training
thread keeps its own.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("koochak.loop.checkpoint")

# Niceness added to a background save's threads: at 10 a contended core gives the training
# thread about nine tenths of its time; with idle cores the writers still run at full speed.
BACKGROUND_NICENESS = 10


def lower_this_threads_priority(niceness: int = BACKGROUND_NICENESS) -> bool:
    """Make the calling thread (and threads it starts later) yield the CPU; False if unsupported.

    Only ever lowers the priority; an already lower one is kept.
    """
    if not sys.platform.startswith("linux"):
        return False  # elsewhere priority is per process: it would slow training down too
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if current < niceness:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except OSError as exc:  # a sandbox may refuse; the save still works, just less politely
        log.debug("could not lower the background save's priority: %s", exc)
        return False
    return True
