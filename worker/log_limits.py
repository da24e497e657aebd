"""Rate-limited logging, once for the whole worker: no client can fill a disk through the log.

Before, each refused ``accept()`` (162,815 lines, 72 MB in 100 s) and each request that failed
to parse (a traceback of ~68 lines each, 8.6 MB in 10 s) wrote to the log. ``RateLimitFilter``
sits on the root logger's handlers of both processes: each kind of record (its logger and
message template, or the ``rate_key`` a caller gives, e.g. one per client) passes ``burst`` times
per ``interval``; the rest are counted, and the next one that passes says how many were dropped.
All keys together pass at most ``total`` records per interval, and the keys remembered are
bounded, so an attacker with many addresses cannot grow the log or the filter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

BURST = 5
TOTAL = 50
INTERVAL_SECONDS = 10.0
MAX_KEYS = 1024


def rate_key(*parts: str) -> dict[str, Any]:
    """``extra=`` for a log call whose records are limited together (e.g. per client)."""
    return {"rate_key": parts}


class RateLimitFilter(logging.Filter):
    """Lets ``burst`` records of a key and ``total`` of all keys through per ``interval``."""

    def __init__(self, burst: int = BURST, total: int = TOTAL, interval: float = INTERVAL_SECONDS,
                 max_keys: int = MAX_KEYS, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst, self.total, self.interval, self.max_keys, self.clock = burst, total, interval, max_keys, clock
        #: key -> [window start, passed in the window, dropped since the last one passed]
        self._keys: dict[Any, list] = {}
        self._window = [clock(), 0]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "rate_key", None) or (record.name, record.levelno, str(record.msg)[:200])
        with self._lock:
            now = self.clock()
            if now - self._window[0] >= self.interval:
                self._window = [now, 0]
            entry = self._keys.get(key)
            if entry is None:
                if len(self._keys) >= self.max_keys:
                    self._keys.pop(next(iter(self._keys)))  # the oldest key is forgotten
                entry = self._keys[key] = [now, 0, 0]
            elif now - entry[0] >= self.interval:
                entry[0], entry[1] = now, 0
            if entry[1] >= self.burst or self._window[1] >= self.total:
                entry[2] += 1
                return False
            entry[1] += 1
            self._window[1] += 1
            dropped, entry[2] = entry[2], 0
        if dropped:
            record.msg = f"{record.getMessage()} [{dropped} similar record(s) dropped by the rate limit]"
            record.args = None
        return True


def limit_logging(logger: logging.Logger | None = None) -> RateLimitFilter:
    """Puts one ``RateLimitFilter`` on every handler of ``logger`` (the root by default); returns it."""
    logger = logger or logging.getLogger()
    limiter = RateLimitFilter()
    for handler in logger.handlers:
        handler.addFilter(limiter)
    return limiter
