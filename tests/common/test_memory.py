"""specplug.common.memory: the opt-in malloc_trim thread and its setting."""

import pytest

from specplug.common import memory


def test_period_comes_from_the_environment():
    assert memory.trim_period(0.0, {}) == 0.0
    assert memory.trim_period(0.0, {"SPECPLUG_MALLOC_TRIM_S": "30"}) == 30.0
    assert memory.trim_period(20.0, {"SPECPLUG_MALLOC_TRIM_S": "0"}) == 0.0
    for bad in ("soon", "-1"):
        with pytest.raises(ValueError, match="SPECPLUG_MALLOC_TRIM_S must be"):
            memory.trim_period(0.0, {"SPECPLUG_MALLOC_TRIM_S": bad})


def test_one_thread_per_process(monkeypatch):
    monkeypatch.setattr(memory, "_thread", None)
    assert not memory.trim_every(0.0)  # off
    started = memory.trim_every(3600.0)
    assert started == (memory._glibc() is not None)
    assert not memory.trim_every(3600.0)  # once per process
