"""One log line per Kubernetes API outage, instead of a line (or a traceback) per request.

While the API server is away, kopf retries every request of every watch stream and logs each
failed attempt, and each policy loop fails its status write. ``OUTAGE`` collapses all of that:
the first failure logs one warning, later ones are counted silently, and the first sign of life
(a watch event, a status write) logs one line with the outage's length and what was suppressed.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("graphkeeper.operator")

#: kopf's loggers whose "request failed, will retry" lines are folded into the outage line.
KOPF_API_LOGGERS = ("kopf._cogs.clients.api", "kopf._cogs.clients.watching",
                    "kopf._core.reactor.queueing")


class Outage(logging.Filter):
    """The state of the current outage, if any; also a filter for kopf's retry lines."""

    def __init__(self) -> None:
        super().__init__()
        self.since: float | None = None
        self.suppressed = 0

    @property
    def active(self) -> bool:
        return self.since is not None

    def failed(self, err: object) -> None:
        """A request to the API failed for want of a server (not a 4xx answer)."""
        if self.since is None:
            self.since = time.monotonic()
            self.suppressed = 0
            logger.warning("Kubernetes API unreachable (%s); retrying every second, quietly "
                           "until it answers", _short(err))
        else:
            self.suppressed += 1

    def ok(self) -> None:
        """The API answered."""
        if self.since is None:
            return
        took = time.monotonic() - self.since
        logger.warning("Kubernetes API answers again after %.1fs (%d failed requests not logged)",
                       took, self.suppressed)
        self.since = None

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Request attempt" in message and "failed" in message:
            self.failed(message.split(" -> ", 1)[-1])
            return False
        if self.since is not None and record.levelno >= logging.WARNING and (
                "ClientConnectorError" in message or "Cannot connect" in message
                or "ServerDisconnectedError" in message):
            self.suppressed += 1
            return False
        return True

    def install(self) -> None:
        for name in KOPF_API_LOGGERS:
            log = logging.getLogger(name)
            if self not in log.filters:
                log.addFilter(self)


def _short(err: object) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:300]


OUTAGE = Outage()
