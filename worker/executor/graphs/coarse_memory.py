"""What coarse graphs bought at an earlier start, remembered beside the compile cache, so that a
restart does not capture again the graphs it measured not to pay.

A coarse PIECEWISE size (1,024 to 8,192 tokens, ``large_steps.py``) is captured, validated and
timed like every graph, then given back at the end of the phase when its replay does not beat the
eager steps it serves. Where none pays (``llama-8b`` on an H100: all four), every start spent about
seven passes of the largest steps on each before giving it back: the eager reference and its
timing, the recording, the validation and its timed replays, seconds of the capture stage.

What was measured depends on the step, which the compile cache key already hashes (the model,
dtype, quantization, kernels, GPU, driver, library versions and the step's source), and on how the
probe is built and judged, which this module's facts add: the source of the capture modules,
whether PIECEWISE keys record the attention, the tensor-parallel size and the KV block size. So the
verdicts live in ``coarse-verdicts.json`` inside that key's compile cache directory, with their
facts; a file whose facts differ, or that does not parse, is ignored with a warning (every coarse
size is measured again) and rewritten after the phase.

A size remembered as not paying, judged with the same ladder size below it (the same steps to
serve), is left out of the plan: it is skipped with ``compute_bound`` and its earlier verdict's
message, and its eager timing goes back into the graph set's (what the step-time model prices
its steps with and status reports). A size remembered as paying is captured and judged again, as
is one not remembered. Removing the file, or the cache directory, measures every size again (a
restart on another node with its own cache measures them on its own GPU).
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.executor.graphs.graph_set import Skipped
from graphkeeper.worker.executor.graphs.large_steps import Verdict, size_below
from graphkeeper.worker.executor.graphs.modes import PIECEWISE, Key
from graphkeeper.worker.model.cache_key import differences, source_digest, write_json_atomically

log = logging.getLogger(__name__)

#: The file's name inside a compile cache directory.
VERDICTS_FILE = "coarse-verdicts.json"


@dataclass(frozen=True)
class Remembered:
    """A coarse size's verdict from an earlier start: the replay, the mean eager time of the steps
    it serves, the eager time at the size itself (GPU seconds), whether it was kept, and the ladder
    size below it then (where the steps it serves start: another ladder judges other steps)."""

    size: int
    replay_seconds: float
    served_seconds: float
    eager_seconds: float
    kept: bool
    below: int

    def message(self) -> str:
        verdict = Verdict(self.size, self.replay_seconds, self.served_seconds, self.kept)
        return f"{verdict.message()}, as measured at an earlier start of the same step (not captured again)"


def memory_facts(whole_mixed: bool, tp_size: int, block_size: int) -> dict:
    """What the verdicts depend on beyond the compile cache key."""
    return {"whole_mixed": whole_mixed, "tp_size": tp_size, "block_size": block_size, "source": _capture_source()}


@functools.cache
def _capture_source() -> str:
    """The capture modules' source (the probe, the timing and the judging), hashed once a process:
    every capture phase, recaptures between steps included, asks."""
    from graphkeeper.worker.executor.graphs import capture, economics, large_steps

    return source_digest([capture, economics, large_steps, sys.modules[__name__]])


def remembered_skips(plan: list[Key], remembered: Mapping[int, Remembered]) -> tuple[list[Key], dict[Key, Skipped]]:
    """The plan without the PIECEWISE keys of sizes remembered as not paying, and their skips
    (pure)."""
    unpaid = {size: r for size, r in remembered.items() if not r.kept}
    skips = {(mode, size): Skipped(pb.FALLBACK_REASON_COMPUTE_BOUND, unpaid[size].message())
             for mode, size in plan if mode == PIECEWISE and size in unpaid}
    return [key for key in plan if key not in skips], skips


class CoarseMemory:
    """The verdicts file of one compile cache directory, for one set of facts."""

    def __init__(self, path: Path, facts: dict) -> None:
        self.path = path
        self.facts = facts

    @classmethod
    def beside(cls, cache_dir: str, facts: dict) -> CoarseMemory | None:
        """The memory in ``cache_dir`` (None without one: no compile cache, nothing remembered)."""
        return cls(Path(cache_dir) / VERDICTS_FILE, facts) if cache_dir else None

    def recall(self, sizes: Iterable[int], ladder: list[int]) -> dict[int, Remembered]:
        """The remembered verdicts of ``sizes`` judged with the same ladder size below them as
        ``ladder`` has (none when the file is missing, unreadable or was written for other facts)."""
        wanted = {size: size_below(size, ladder) for size in sizes}
        return {size: r for size, r in self._read().items() if wanted.get(size, -1) == r.below}

    def save(self, verdicts: Iterable[Verdict], eager: Mapping[int, float],
             remembered: Mapping[int, Remembered], ladder: list[int]) -> None:
        """Writes this phase's ``verdicts`` (with each size's own eager time, on ``ladder``) over
        what was ``remembered`` and left out of it; nothing when the phase judged nothing."""
        fresh = {v.size: Remembered(v.size, v.replay_seconds, v.eager_seconds, eager.get(v.size, 0.0), v.kept,
                                    size_below(v.size, ladder))
                 for v in verdicts}
        if not fresh:
            return
        entries = {**remembered, **fresh}
        data = {"facts": self.facts, "sizes": {str(s): asdict(r) for s, r in sorted(entries.items())}}
        try:
            write_json_atomically(self.path, data)
        except OSError as err:  # a read-only cache costs the next start these seconds, nothing else
            log.warning("coarse verdicts not written to %s: %s", self.path, err)

    def _read(self) -> dict[int, Remembered]:
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            diff = differences(self.facts, data.get("facts"))
            if diff:
                log.warning("coarse verdicts %s were measured for other facts (they differ in %s): ignored, "
                            "every coarse size is measured again", self.path, ", ".join(diff))
                return {}
            entries = {int(s): Remembered(**r) for s, r in data["sizes"].items()}
        except (OSError, ValueError, TypeError, KeyError) as err:
            log.warning("coarse verdicts %s unreadable, every coarse size is measured again: %s", self.path, err)
            return {}
        return {s: r for s, r in entries.items() if r.size == s}
