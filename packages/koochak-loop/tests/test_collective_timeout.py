"""KOOCHAK_COLLECTIVE_TIMEOUT_S is the timeout of the process group the loop creates."""

from __future__ import annotations

from datetime import timedelta

import pytest


@pytest.mark.parametrize("value,expected", [("20", {"timeout": timedelta(seconds=20)}), (None, {})])
def test_the_loop_creates_its_group_with_the_configured_timeout(monkeypatch, value, expected):
    from koochak.loop import dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.torch_dist, "init_process_group", lambda **kw: calls.append(kw))
    for name, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, v)
    if value is None:
        monkeypatch.delenv("KOOCHAK_COLLECTIVE_TIMEOUT_S", raising=False)
    else:
        monkeypatch.setenv("KOOCHAK_COLLECTIVE_TIMEOUT_S", value)
    assert dist.init_process_group(backend="gloo") is True
    assert calls == [{"backend": "gloo", **expected}]
