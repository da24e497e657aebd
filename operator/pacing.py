"""At most one write of a kind per interval: status patches and ConfigMap renders under edit bursts.

A burst of spec edits (a script applying 5 a second, a GitOps sync) would otherwise cost a
status patch and a ConfigMap write per edit and per rollout step. A write that comes sooner
than ``every`` seconds after the last is put off, not dropped: the run says how long to wait,
and the next run writes what is true then (the status and the policy are recomputed whole every
run, so nothing in between is lost). A write after a quiet interval goes out at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The shortest gap between two status patches of one policy.
STATUS_EVERY_SECONDS = 1.0
#: The shortest gap between two ConfigMap writes of one policy.
RENDER_EVERY_SECONDS = 1.0


@dataclass
class Pacer:
    every: float
    last: float = -math.inf

    def wait(self, now: float) -> float:
        """Seconds until a write may go out (0: now)."""
        return max(0.0, self.last + self.every - now)

    def wrote(self, now: float) -> None:
        self.last = now
