"""Handing freed heap memory back to the OS in long-running servers (glibc `malloc_trim`).

glibc keeps what a process frees in its arenas for reuse and returns little of it to the
OS; a server whose steps allocate buffers of ever-changing sizes (speculative steps vary
their token count and tree shapes from step to step) sees its resident memory climb
towards a ceiling while the memory it actually uses stays flat. `trim_every(seconds)`
starts one daemon thread per process that calls `malloc_trim(0)` every `seconds`
(ctypes releases the GIL during the call, so engine threads are not held). The period
comes from SPECPLUG_MALLOC_TRIM_S (seconds, 0 = off). No-op without glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

ENV_TRIM = "SPECPLUG_MALLOC_TRIM_S"
_thread: threading.Thread | None = None  # one per process (module state by design)


def trim_period(default: float, environ=os.environ) -> float:
    """Seconds between trims: SPECPLUG_MALLOC_TRIM_S if set, else `default` (0 = off)."""
    text = environ.get(ENV_TRIM, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{ENV_TRIM} must be a number of seconds (0 = off), got {text!r}") from None
    if value < 0:
        raise ValueError(f"{ENV_TRIM} must be >= 0 seconds (0 = off), got {text!r}")
    return value


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def trim_every(seconds: float) -> bool:
    """Start this process's trim thread (once); False when off, started already, or no glibc."""
    global _thread
    libc = _glibc() if seconds > 0 else None
    if libc is None or _thread is not None:
        return False
    _thread = threading.Thread(target=_loop, args=(libc, seconds), daemon=True, name="specplug-malloc-trim")
    _thread.start()
    logger.info("specplug: returning freed heap memory to the OS every %g s (malloc_trim; %s=0 turns it off)",
                seconds, ENV_TRIM)
    return True


def _loop(libc, seconds: float) -> None:
    while True:
        time.sleep(seconds)
        libc.malloc_trim(0)
