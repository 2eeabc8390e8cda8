"""Heap memory in long-running servers (glibc): handing freed memory back to the OS
(`malloc_trim`), and a log that tells memory in use from memory glibc keeps.

glibc keeps what a process frees in its arenas for reuse and returns little of it to the
OS; a server whose steps allocate buffers of ever-changing sizes (speculative steps vary
their token count and tree shapes from step to step) sees its resident memory climb
towards a ceiling while the memory it actually uses stays flat. `trim_every(seconds)`
starts one daemon thread per process that calls `malloc_trim(0)` every `seconds`
(ctypes releases the GIL during the call, so engine threads are not held); the period
comes from SPECPLUG_MALLOC_TRIM_S (seconds, 0 = off). `log_every(seconds)` logs the
process's RSS and glibc's heap in use / kept free (`mallinfo2`) every `seconds`, from
SPECPLUG_MEMORY_LOG_S: a climb in "in use" is memory something holds, a climb in "free"
is what trimming returns (docs/reliability.md). Both are no-ops without glibc.

`bound_onednn_cache()` caps oneDNN's process-wide primitive cache (1,024 entries unless
ONEDNN_PRIMITIVE_CACHE_CAPACITY says otherwise): on a CPU engine every linear layer's
matmul primitive is cached per (shape, row count), speculative steps vary the row count
from step to step, and the cache filled with ~0.27 MiB primitives for minutes under load
(the warm-up growth of docs/reliability.md, found with heaptrack). The engines' own
per-layer caches keep the primitives they reuse, so the shared cache needs few entries.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import NamedTuple

logger = logging.getLogger(__name__)

ENV_TRIM = "SPECPLUG_MALLOC_TRIM_S"
ENV_LOG = "SPECPLUG_MEMORY_LOG_S"
ENV_ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_ENTRIES = 64  # measured: flat heap under 64-client load, same requests completed
_threads: dict[str, threading.Thread] = {}  # "trim" / "log": one each per process (module state by design)
MIB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class HeapStats(NamedTuple):
    """One process's memory, MiB."""

    rss: float  # resident set
    in_use: float  # glibc heap allocated and not freed (mallinfo2 uordblks)
    free: float  # freed but kept in glibc's arenas (fordblks): what malloc_trim can return
    mmapped: float  # blocks glibc mapped on their own (hblkhd)


def period(env: str, default: float, environ=os.environ) -> float:
    """Seconds from the variable `env` if set, else `default` (0 = off)."""
    text = environ.get(env, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{env} must be a number of seconds (0 = off), got {text!r}") from None
    if value < 0:
        raise ValueError(f"{env} must be >= 0 seconds (0 = off), got {text!r}")
    return value


def trim_period(default: float, environ=os.environ) -> float:
    """Seconds between trims: SPECPLUG_MALLOC_TRIM_S if set, else `default` (0 = off)."""
    return period(ENV_TRIM, default, environ)


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def heap_stats(libc=None) -> HeapStats | None:
    """This process's RSS and glibc heap figures, or None without glibc's mallinfo2."""
    libc = libc or _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return HeapStats(rss / MIB, info.uordblks / MIB, info.fordblks / MIB, info.hblkhd / MIB)


def trim_every(seconds: float) -> bool:
    """Start this process's trim thread (once); False when off, started already, or no glibc."""
    libc = _glibc() if seconds > 0 else None
    if libc is None or not _start("trim", _trim_loop, libc, seconds):
        return False
    logger.info("specplug: returning freed heap memory to the OS every %g s (malloc_trim; %s=0 turns it off)",
                seconds, ENV_TRIM)
    return True


def log_every(seconds: float) -> bool:
    """Start this process's memory log (once); False when off, started already, or no glibc."""
    libc = _glibc() if seconds > 0 else None
    if libc is None or heap_stats(libc) is None:
        return False
    return _start("log", _log_loop, libc, seconds)


def from_environment() -> None:
    """The trim thread and the memory log, as SPECPLUG_MALLOC_TRIM_S / SPECPLUG_MEMORY_LOG_S ask (off by default)."""
    trim_every(trim_period(0.0))
    log_every(period(ENV_LOG, 0.0))


def bound_onednn_cache(environ=os.environ) -> bool:
    """Set ONEDNN_PRIMITIVE_CACHE_CAPACITY to ONEDNN_CACHE_ENTRIES unless it is set (a
    user's value wins); True when set here. oneDNN reads it when it creates its first
    primitive, so call this before the engine loads its model (a child process inherits it)."""
    if ENV_ONEDNN_CACHE in environ:
        return False
    environ[ENV_ONEDNN_CACHE] = str(ONEDNN_CACHE_ENTRIES)
    logger.info("specplug: oneDNN's primitive cache capped at %d entries (%s; set it to keep another value)",
                ONEDNN_CACHE_ENTRIES, ENV_ONEDNN_CACHE)
    return True


def _start(kind: str, loop, *args) -> bool:
    if kind in _threads:
        return False
    _threads[kind] = threading.Thread(target=loop, args=args, daemon=True, name=f"specplug-memory-{kind}")
    _threads[kind].start()
    return True


def _trim_loop(libc, seconds: float) -> None:
    while True:
        time.sleep(seconds)
        libc.malloc_trim(0)


def _log_loop(libc, seconds: float) -> None:
    while True:
        stats = heap_stats(libc)
        logger.info("specplug memory (pid %d): rss %.0f MiB, heap in use %.0f MiB, heap free (kept by glibc) "
                    "%.0f MiB, mmapped %.0f MiB", os.getpid(), *stats)
        time.sleep(seconds)
