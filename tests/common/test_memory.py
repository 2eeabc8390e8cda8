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
    monkeypatch.setattr(memory, "_threads", {})
    assert not memory.trim_every(0.0)  # off
    started = memory.trim_every(3600.0)
    assert started == (memory._glibc() is not None)
    assert not memory.trim_every(3600.0)  # once per process


def test_heap_stats_tell_memory_in_use_from_memory_kept_free(monkeypatch):
    """mallinfo2's in-use figure rises by what is allocated and held, and the log line
    carries RSS, in use, free and mmapped (SPECPLUG_MEMORY_LOG_S)."""
    before = memory.heap_stats()
    if before is None:
        pytest.skip("needs glibc's mallinfo2")
    held = [bytearray(4096) for _ in range(4096)]  # 16 MiB in small blocks: the heap, not mmap
    after = memory.heap_stats()
    assert after.in_use - before.in_use > 12 and after.rss > 0
    del held
    assert memory.period("SPECPLUG_MEMORY_LOG_S", 0.0, {"SPECPLUG_MEMORY_LOG_S": "10"}) == 10.0
    with pytest.raises(ValueError, match="SPECPLUG_MEMORY_LOG_S must be"):
        memory.period("SPECPLUG_MEMORY_LOG_S", 0.0, {"SPECPLUG_MEMORY_LOG_S": "often"})
    lines = []
    monkeypatch.setattr(memory, "_threads", {})
    monkeypatch.setattr(memory.logger, "info", lambda msg, *args: lines.append(msg % args))
    monkeypatch.setattr(memory.time, "sleep", lambda s: (_ for _ in ()).throw(SystemExit))
    with pytest.raises(SystemExit):
        memory._log_loop(memory._glibc(), 10.0)
    assert "heap in use" in lines[0] and "kept by glibc" in lines[0]


def test_onednn_cache_bound_is_a_default_a_user_value_wins():
    environ = {}
    assert memory.bound_onednn_cache(environ)
    assert environ == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(memory.ONEDNN_CACHE_ENTRIES)}
    mine = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}
    assert not memory.bound_onednn_cache(mine) and mine["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
