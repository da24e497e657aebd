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

#: Loggers whose "request failed, will retry" lines are folded into the outage line: kopf's, and
#: urllib3's (the kubernetes client under our status writes retries each one three times).
KOPF_API_LOGGERS = ("kopf._cogs.clients.api", "kopf._cogs.clients.watching",
                    "kopf._core.reactor.queueing", "urllib3.connectionpool")


class Outage(logging.Filter):
    """The state of the current outage, if any; also a filter for kopf's retry lines.

    A server that is coming back answers some requests and refuses others ("storage is
    initializing") for a few seconds; failures within ``GRACE_SECONDS`` of its return belong to
    the same outage and log nothing new.
    """

    GRACE_SECONDS = 15.0

    def __init__(self) -> None:
        super().__init__()
        self.since: float | None = None
        self.recovered_at: float | None = None
        self.suppressed = 0

    @property
    def active(self) -> bool:
        return self.since is not None

    def failed(self, err: object) -> None:
        """A request to the API failed for want of a server (not a 4xx answer)."""
        now = time.monotonic()
        if self.since is not None:
            self.suppressed += 1
            return
        if self.recovered_at is not None and now - self.recovered_at < self.GRACE_SECONDS:
            self.since = now  # the same outage, flapping while the server starts
            self.suppressed += 1
            return
        self.since, self.recovered_at, self.suppressed = now, None, 0
        self._first = now
        logger.warning("Kubernetes API unreachable (%s); retrying every second, quietly "
                       "until it answers", _short(err))

    def ok(self) -> None:
        """The API answered."""
        if self.since is None:
            return
        self.since = None
        if self.recovered_at is not None:
            return  # already reported back once for this outage
        self.recovered_at = time.monotonic()
        logger.warning("Kubernetes API answers again after %.1fs (%d failed requests not logged)",
                       self.recovered_at - self._first, self.suppressed)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Request attempt" in message and "failed" in message:
            self.failed(message.split(" -> ", 1)[-1])
            return False
        if record.name.startswith("urllib3") and message.startswith("Retrying ("):
            self.failed(message.split(" after ", 1)[-1])
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
    return text[:200]


OUTAGE = Outage()
