"""Capture sizes from the fleet's traffic: the spec, the apply decision and the status, all pure.

A GraphPolicy with ``spec.captureSizes.fromTraffic`` asks the operator to merge the step-shape
histograms its workers report (``GraphStatus.traffic``), choose sizes with
``graphkeeper.proto.traffic_sizes.choose_sizes`` within ``maxGraphs`` and/or ``memoryBudget``,
and write the recommendation into ``status.recommendation``. In ``Apply`` mode the operator also
makes the chosen sizes the effective explicit sizes pushed to workers, through the ordinary
rollout (``maxUnavailable``), without editing the user's spec: the effective set lives in
``status.effectiveCaptureSizes``.

Workers adopt a policy once per (uid, generation), so a new set at the same ``metadata.generation``
needs a new wire generation: once a set was applied the wire generation is
``metadata.generation * GENERATION_STRIDE + sequence`` (the sequence counts applied sets), which
only ever grows, across spec edits too.

No flapping (``decide_apply``): a new set is applied only ``minIntervalSeconds`` after the last
one, and only when it lowers the expected step time by ``minImprovementPercent``, unless the sizes
in effect break the policy's own limits (the first apply from a 62-graph default ladder under
``maxGraphs: 8`` costs more step time and saves the memory: that is what was asked for).

``recommend`` is one look at the traffic, from the histograms to the set applied; the reconciler
only gathers the owned workers' statuses, asks ``recommend_due`` whether to look, and carries out
what the look decided (status, Event, metrics).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import (
    DEFAULT_MAX_CAPTURE_CEILING,
    MAX_GRAPHS_LIMIT,
    MODE_BY_NAME,
    PolicyError,
    default_ladder,
    interactivity_ladder,
    parse_quantity,
)
from graphkeeper.proto.traffic_sizes import (
    CostModel,
    SizeChoice,
    Traffic,
    choose_sizes,
    evaluate_sizes,
    measurements_from,
    merge_histograms,
)

FIELD = "spec.captureSizes.fromTraffic"
RECOMMEND, APPLY = "Recommend", "Apply"
DEFAULT_MIN_INTERVAL_SECONDS = 600
DEFAULT_MIN_IMPROVEMENT_PERCENT = 5
DEFAULT_MIN_STEPS = 1000
#: Applied sets per spec generation the wire generation can tell apart (about a million).
GENERATION_STRIDE = 2**20
MAX_REASONS = 64
#: The CRD's name of each wire graph mode: an applied set remembers the spec's mode by this name.
MODE_NAMES: dict[int, str] = {v: k for k, v in MODE_BY_NAME.items()}


@dataclass(frozen=True)
class CanarySettings:
    """``spec.captureSizes.fromTraffic.canary``, validated: who gets a new set first, for how long,
    and how much worse than the rest it may serve (``canary.compare``)."""

    workers: int = 1
    window_seconds: int = 300
    max_slowdown: float = 0.02
    max_itl_p99_increase: float = 0.10


@dataclass(frozen=True)
class FromTraffic:
    """``spec.captureSizes.fromTraffic``, validated."""

    mode: str
    max_graphs: int = 0
    memory_budget_bytes: int = 0
    min_interval_seconds: int = DEFAULT_MIN_INTERVAL_SECONDS
    min_improvement: float = DEFAULT_MIN_IMPROVEMENT_PERCENT / 100
    min_steps: int = DEFAULT_MIN_STEPS
    #: None: an applied set goes to every worker through the rollout at once (no canary).
    canary: CanarySettings | None = None


def _int(spec: Mapping[str, Any], key: str, default: int, low: int, high: int, field: str = FIELD) -> int:
    value = spec.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PolicyError(f"{field}.{key}", f"must be an integer from {low} to {high}, got {value!r}")
    return value


def canary_settings(raw: Any, mode: str) -> CanarySettings | None:
    """``fromTraffic.canary``, or None; only Apply mode applies sets, so only it takes a canary."""
    if raw is None:
        return None
    field = f"{FIELD}.canary"
    if not isinstance(raw, Mapping):
        raise PolicyError(field, "must be an object")
    if mode != APPLY:
        raise PolicyError(field, "only mode Apply applies sets; a canary needs mode Apply")
    return CanarySettings(
        workers=_int(raw, "workers", 1, 1, 10_000, field),
        window_seconds=_int(raw, "windowSeconds", 300, 10, 86400, field),
        max_slowdown=_int(raw, "maxSlowdownPercent", 2, 0, 100, field) / 100,
        max_itl_p99_increase=_int(raw, "maxItlP99IncreasePercent", 10, 0, 1000, field) / 100)


def from_traffic_settings(spec: Mapping[str, Any]) -> FromTraffic | None:
    """The policy's ``fromTraffic`` settings, or None; raises PolicyError naming the field (the
    CRD refuses the same specs at admission)."""
    raw = (spec.get("captureSizes") or {}).get("fromTraffic")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise PolicyError(FIELD, "must be an object")
    mode = raw.get("mode")
    if mode not in (RECOMMEND, APPLY):
        raise PolicyError(f"{FIELD}.mode", f"must be Recommend or Apply, got {mode!r}")
    if spec.get("mode") == "None":
        raise PolicyError(FIELD, "mode None captures no graphs; leave fromTraffic out")
    max_graphs = _int(raw, "maxGraphs", 0, 1, MAX_GRAPHS_LIMIT) if "maxGraphs" in raw else 0
    budget = 0
    if raw.get("memoryBudget") not in (None, ""):
        try:
            budget = parse_quantity(raw["memoryBudget"], f"{FIELD}.memoryBudget")
        except PolicyError as err:
            raise PolicyError(err.field, err.message) from None
    if not max_graphs and not budget:
        raise PolicyError(FIELD, "needs maxGraphs or memoryBudget: a bound on what the chosen sizes may cost")
    return FromTraffic(
        mode=mode, max_graphs=max_graphs, memory_budget_bytes=budget,
        min_interval_seconds=_int(raw, "minIntervalSeconds", DEFAULT_MIN_INTERVAL_SECONDS, 0, 7 * 86400),
        min_improvement=_int(raw, "minImprovementPercent", DEFAULT_MIN_IMPROVEMENT_PERCENT, 0, 100) / 100,
        min_steps=_int(raw, "minSteps", DEFAULT_MIN_STEPS, 1, 2**62),
        canary=canary_settings(raw.get("canary"), mode))


# --- the applied set -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Applied:
    """The set the operator applied last (``status.effectiveCaptureSizes``); sequence 0: none yet."""

    sizes: tuple[int, ...] = ()
    sequence: int = 0
    applied_at: float = 0.0
    #: The spec's graph mode the set was chosen for: a set chosen for one mode is not kept for another.
    mode: str = ""


def applied_from_status(status: Mapping[str, Any] | None) -> Applied:
    """What a previous run (or a previous operator) applied, read back from the policy's status."""
    raw = (status or {}).get("effectiveCaptureSizes") or {}
    try:
        stamp = raw.get("appliedTime")
        applied_at = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp() if stamp else 0.0
        return Applied(tuple(int(s) for s in raw.get("sizes") or ()), int(raw.get("sequence") or 0), applied_at,
                       str(raw.get("mode") or ""))
    except (TypeError, ValueError):
        return Applied()


def applied_status(applied: Applied) -> dict[str, Any] | None:
    if applied.sequence == 0:
        return None
    return {"sizes": list(applied.sizes), "sequence": applied.sequence, "mode": applied.mode,
            "appliedTime": _stamp(applied.applied_at)}


def mode_of(spec_wire: pb.GraphPolicy) -> str:
    """The spec's graph mode by its CRD name, read from the parsed policy: the default for a spec
    that names none is ``policy_from_spec``'s alone."""
    return MODE_NAMES[spec_wire.mode]


def wire_generation(generation: int, applied: Applied) -> int:
    """The generation pushed to workers: the spec's until a set is applied, then one that grows
    with every applied set and every spec edit."""
    return generation if applied.sequence == 0 else generation * GENERATION_STRIDE + applied.sequence


def spec_generation(wire: int) -> int:
    """The ``metadata.generation`` a wire generation was built from (what status shows people)."""
    return wire // GENERATION_STRIDE if wire >= GENERATION_STRIDE else wire


def in_effect(settings: FromTraffic | None, applied: Applied, spec_mode: str) -> bool:
    """Whether the applied sizes replace the spec's in what workers are told."""
    return (settings is not None and settings.mode == APPLY and bool(applied.sizes)
            and applied.mode == spec_mode)


def effective_policy(wire: pb.GraphPolicy, settings: FromTraffic | None, applied: Applied,
                     spec_mode: str) -> pb.GraphPolicy:
    """``wire`` (from the spec) with the applied sizes and wire generation (a new message)."""
    out = pb.GraphPolicy()
    out.CopyFrom(wire)
    out.generation = wire_generation(wire.generation, applied)
    if in_effect(settings, applied, spec_mode):
        out.capture_sizes.Clear()  # no maxCaptureSize: it would be captured on top of the chosen sizes
        out.capture_sizes.explicit.sizes.extend(applied.sizes)
    return out


def max_capture_size(spec_wire: pb.GraphPolicy) -> int:
    """The largest size a chosen set may hold: the spec's maxCaptureSize, else the default ceiling
    (a worker's own token budget per step bounds the traffic it reports anyway)."""
    return spec_wire.capture_sizes.max_capture_size or DEFAULT_MAX_CAPTURE_CEILING


def sizes_in_effect(wire: pb.GraphPolicy) -> list[int]:
    """The sizes ``wire`` asks for, as far as the operator can resolve them without a worker's
    limits (a ladder runs to maxCaptureSize or the default ceiling)."""
    sizes = wire.capture_sizes
    if sizes.WhichOneof("sizes") == "explicit":
        extra = [sizes.max_capture_size] if sizes.max_capture_size else []
        return sorted(set(sizes.explicit.sizes) | set(extra))
    top = max_capture_size(wire)
    if sizes.WhichOneof("sizes") == "ladder" and sizes.ladder == pb.CAPTURE_LADDER_INTERACTIVITY:
        return interactivity_ladder(top)
    return default_ladder(top)


# --- the decision --------------------------------------------------------------------------------


def improvement(current: SizeChoice, new: SizeChoice) -> float:
    """How much lower ``new``'s expected step time is than ``current``'s (a fraction; negative: higher)."""
    return (current.cost - new.cost) / current.cost if current.cost > 0 else 0.0


def over_limits(choice: SizeChoice, settings: FromTraffic) -> str:
    """Why a set breaks the policy's own limits ("" when it does not)."""
    if settings.max_graphs and choice.graphs > settings.max_graphs:
        return f"{choice.graphs} graphs, over maxGraphs {settings.max_graphs}"
    if settings.memory_budget_bytes and choice.memory_bytes > settings.memory_budget_bytes:
        return (f"an estimated {choice.memory_bytes} bytes of graph memory, over memoryBudget "
                f"{settings.memory_budget_bytes}")
    return ""


def decide_apply(settings: FromTraffic, applied: Applied, now: float, current: SizeChoice,
                 new: SizeChoice) -> tuple[bool, str]:
    """Whether to apply ``new`` in place of ``current`` now, and why (pure)."""
    if settings.mode != APPLY:
        return False, "mode Recommend: not applied"
    if not new.sizes:
        return False, "nothing to apply: " + (new.note or "no size was chosen")
    if new.sizes == current.sizes:
        return False, "the recommended sizes are in effect"
    if applied.sequence and now - applied.applied_at < settings.min_interval_seconds:
        left = settings.min_interval_seconds - (now - applied.applied_at)
        return False, (f"not applied: the last set was applied {now - applied.applied_at:.0f}s ago, "
                       f"minIntervalSeconds is {settings.min_interval_seconds} ({left:.0f}s left)")
    broken = over_limits(current, settings)
    if broken:
        return True, f"applied: the sizes in effect take {broken}"
    gain = improvement(current, new)
    if gain < settings.min_improvement:
        return False, (f"not applied: expected step time {gain:.1%} lower, minImprovementPercent is "
                       f"{settings.min_improvement:.0%}")
    return True, f"applied: expected step time {gain:.1%} lower"


# --- one look at the traffic ----------------------------------------------------------------------


def traffic_key(generation: int, traffic: Traffic, applied: Applied) -> tuple:
    """What a look at the traffic depends on: the spec's generation, the merged histogram's size,
    and the applied set."""
    return (generation, traffic.steps, traffic.workers, traffic.since, applied)


def recommend_due(key: tuple, last: tuple | None, since_last: float, min_gap: float) -> bool:
    """Whether to look at the traffic again (pure): at once when the spec or the applied set
    changed (``key``'s first and last items), at most every ``min_gap`` seconds while only the
    traffic does (each look is a status write), never while nothing did."""
    if key == last:
        return False
    same_spec = last is not None and (key[0], key[-1]) == (last[0], last[-1])
    return not (same_spec and since_last < min_gap)


@dataclass(frozen=True)
class Recommendation:
    """What one look at the traffic decided (``recommend``)."""

    #: ``status.recommendation``.
    status: dict[str, Any]
    #: The set in effect afterwards: the one given, or the new set when this look applied it.
    applied: Applied
    #: The recommended and the current set; None while fewer than ``minSteps`` steps were seen.
    new: SizeChoice | None = None
    current: SizeChoice | None = None
    #: The CaptureSizesApplied Event's message when this look applied the new set, else "".
    applied_message: str = ""


def recommend(settings: FromTraffic, spec_wire: pb.GraphPolicy, applied: Applied,
              statuses: Sequence[pb.GraphStatus], traffic: Traffic, previous: Mapping[str, Any] | None,
              now: float) -> Recommendation:
    """Sizes for ``traffic`` (the owned workers' merged histograms) within the policy's limits,
    and in Apply mode the new set applied when ``decide_apply`` allows (pure).

    ``spec_wire``: the policy as the spec says it (its mode, its maxCaptureSize); ``applied``: the
    set applied last; ``statuses``: the owned workers' statuses, whose measured replay and eager
    times price the steps; ``previous``: the last recommendation, kept while too few steps were
    seen; ``now``: Unix seconds.
    """
    if traffic.steps < settings.min_steps:
        return Recommendation(waiting_status(previous, traffic, settings), applied)
    mode, mode_name = spec_wire.mode, mode_of(spec_wire)
    model = CostModel(mode, measurements_from(c for s in statuses for c in s.captured))
    new = choose_sizes(traffic, mode=mode, max_capture_size=max_capture_size(spec_wire),
                       max_graphs=settings.max_graphs, memory_budget_bytes=settings.memory_budget_bytes,
                       model=model)
    in_effect_now = effective_policy(spec_wire, settings, applied, mode_name)
    current = evaluate_sizes(traffic, sizes_in_effect(in_effect_now), mode, model)
    apply, why = decide_apply(settings, applied, now, current, new)
    message = ""
    if apply:
        applied = Applied(new.sizes, applied.sequence + 1, now, mode_name)
        message = (f"sizes {list(new.sizes)} from {traffic.steps} steps of {traffic.workers} worker(s), "
                   f"expected coverage {new.coverage:.1%}: {why}")
    return Recommendation(recommendation_status(new, current, traffic, now, why), applied, new, current, message)


# --- the status ----------------------------------------------------------------------------------


def sizes_status(settings: FromTraffic | None, spec_mode: str, applied: Applied,
                 recommendation: Mapping[str, Any] | None) -> dict[str, Any]:
    """``status.recommendation`` (while the spec asks for sizes from traffic) and
    ``status.effectiveCaptureSizes`` (once a set was applied), to add to the policy's status."""
    out: dict[str, Any] = {}
    if recommendation and settings is not None:
        out["recommendation"] = recommendation
    effective = applied_status(applied)
    if effective is not None:
        effective["inEffect"] = in_effect(settings, applied, spec_mode)
        out["effectiveCaptureSizes"] = effective
    return out



def _stamp(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def recommendation_status(new: SizeChoice, current: SizeChoice, traffic: Traffic, now: float,
                          message: str) -> dict[str, Any]:
    """``status.recommendation``: the chosen sizes, what they are expected to buy, and why."""
    out: dict[str, Any] = {
        "sizes": list(new.sizes),
        "expectedCoverage": round(new.coverage, 4),
        "currentCoverage": round(current.coverage, 4),
        "paddedTokens": new.padded_tokens,
        "paddingWaste": round(new.padding_waste, 4),
        "graphs": new.graphs,
        "throughputVsDefault": round(new.throughput_vs_default, 4),
        "defaultGraphs": new.default_graphs,
        "memoryBytes": new.memory_bytes,
        "captureSeconds": round(new.capture_seconds, 3),
        "improvement": round(improvement(current, new), 4),
        "costUnits": new.cost_units,
        "steps": traffic.steps,
        "eligibleSteps": new.eligible_steps,
        "workers": traffic.workers,
        "time": _stamp(now),
        "reasons": [{"size": r.size, "fromTokens": r.low, "steps": r.steps, "share": round(r.share, 4),
                     "paddedTokens": r.padded_tokens, "memoryBytes": r.memory_bytes}
                    for r in new.reasons[:MAX_REASONS]],
        "message": (message + (f" ({new.note})" if new.note else ""))[:1024],
    }
    if traffic.since > 0:
        out["since"] = _stamp(traffic.since)
    return out


def waiting_status(previous: Mapping[str, Any] | None, traffic: Traffic, settings: FromTraffic) -> dict[str, Any]:
    """Too little traffic yet: the last recommendation stays, with how far counting has come."""
    out = dict(previous or {})
    out.update(steps=traffic.steps, workers=traffic.workers,
               message=f"waiting for traffic: {traffic.steps} of minSteps {settings.min_steps} steps observed")
    if traffic.since > 0:
        out["since"] = _stamp(traffic.since)
    return out


def histograms(statuses: Iterable[pb.GraphStatus]) -> list[pb.StepHistogram]:
    return [s.traffic for s in statuses if s.HasField("traffic")]


def merged_traffic(statuses: Iterable[pb.GraphStatus]) -> Traffic:
    """The workers' step histograms added up (those that report one)."""
    return merge_histograms(histograms(statuses))
