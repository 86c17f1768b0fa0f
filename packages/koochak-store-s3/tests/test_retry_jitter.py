"""Retry jitter draws from a stream of its own, never from the user's ``random``."""

from __future__ import annotations

import random

from koochak.s3.retry import RetryPolicy


def test_the_jitter_leaves_the_global_random_stream_alone():
    random.seed(11)
    untouched = [random.random() for _ in range(3)]
    random.seed(11)
    delays = [RetryPolicy().delay(retry) for retry in range(3)]
    assert [random.random() for _ in range(3)] == untouched
    assert all(0.0 <= d < 5.0 for d in delays)
