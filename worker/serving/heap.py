"""Memory a large request freed goes back to the system: the API process's RSS stays flat.

Tokenizing a long prompt takes hundreds of MB of transient allocations in the tokenizer's
threads; freed, glibc keeps them in its arenas: four threads tokenizing 1 MiB prompts over and
over held a process at 1,051 MB where it started at 619, and at 676 MB when each tokenization
was followed by ``malloc_trim``. ``trim`` asks glibc to return what is free, at most once per
``MIN_INTERVAL_SECONDS`` (it walks every arena); the tokenizer pool calls it after each long
prompt (``streams``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

MIN_INTERVAL_SECONDS = 1.0
_lock = threading.Lock()
_last = [0.0]


def _libc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: the allocator returns memory its own way
        return None


_MALLOC_TRIM = _libc_trim()


def trim() -> bool:
    """Returns freed heap memory to the system unless done within the last interval."""
    if _MALLOC_TRIM is None:
        return False
    with _lock:
        now = time.monotonic()
        if now - _last[0] < MIN_INTERVAL_SECONDS:
            return False
        _last[0] = now
    _MALLOC_TRIM(0)
    return True
