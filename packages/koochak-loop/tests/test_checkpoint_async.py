"""AsyncPublisher: one publication in flight, results and failures delivered on the caller's thread."""

from __future__ import annotations

import threading

import pytest
from koochak.loop.checkpoint.saver import AsyncPublisher, CheckpointPublishError


def test_second_submit_waits_for_the_first_and_callbacks_run_on_the_caller():
    gate = threading.Event()
    started: list[str] = []
    calls: list[tuple[str, str]] = []
    main = threading.get_ident()

    def publish(name: str, data: bytes) -> str:
        started.append(name)
        if name == "a":
            assert gate.wait(10)
        return f"pub-{name}"

    def on_commit(result: str) -> None:
        assert threading.get_ident() == main
        calls.append(("commit", result))

    pub = AsyncPublisher(publish)
    pub.submit("a", b"1", on_commit)
    pub.poll()  # still in flight: nothing delivered, nothing blocks
    assert calls == [] and pub.in_flight
    threading.Timer(0.05, gate.set).start()
    pub.submit("b", b"2", on_commit)  # drains "a" first
    assert calls[0] == ("commit", "pub-a")
    pub.drain()
    assert calls == [("commit", "pub-a"), ("commit", "pub-b")]
    assert started == ["a", "b"] and not pub.in_flight


def test_a_failed_publication_is_raised_at_the_next_poll():
    def publish(name: str, data: bytes) -> str:
        raise OSError(28, "No space left on device")

    pub = AsyncPublisher(publish)
    pub.submit("step000000004.pt", b"x", lambda r: None)
    pub._thread.join()
    with pytest.raises(CheckpointPublishError, match="step000000004.pt failed: OSError"):
        pub.poll()
    pub.poll()  # delivered once; the publisher is usable again


def test_close_does_not_mask_the_callers_error():
    pub = AsyncPublisher(lambda name, data: (_ for _ in ()).throw(OSError("boom")))
    pub.submit("n", b"x", lambda r: None)
    pub.close()
    assert not pub.in_flight
