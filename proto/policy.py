"""The graph policy model that the operator and the worker share.

One place turns a GraphPolicy custom resource's spec into the wire message, validates it with
messages that name the field, and resolves its capture sizes into a ladder. The CRD's schema
and CEL rules check the same things at admission; the operator checks again before it pushes
and the worker before it captures, so a policy that slips past one layer is still refused with
a clear reason.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.field_checks import FieldError, check_string, clipped_repr

#: The largest capture size any policy may ask for.
MAX_CAPTURE_SIZE_LIMIT = 8192
#: Upper bound of the default maximum capture size (vLLM's choice).
DEFAULT_MAX_CAPTURE_CEILING = 512
MAX_EXPLICIT_SIZES = 256
MAX_TENANTS = 256
#: The most graphs a policy may cap a worker at (every size of the largest explicit list, both modes).
MAX_GRAPHS_LIMIT = 2 * MAX_EXPLICIT_SIZES
#: The longest idle-release time: 30 days (longer is never, which is 0).
MAX_IDLE_RELEASE_SECONDS = 30 * 24 * 3600
#: The longest idle time before a worker sleeps: 30 days, as for idle release (0: never).
MAX_SLEEP_AFTER_IDLE_SECONDS = 30 * 24 * 3600
#: The Sleep levels a policy may ask for (0 on the wire is the default, 1).
SLEEP_LEVELS = (1, 2)
DEFAULT_SLEEP_LEVEL = 1
#: Kubernetes object UIDs are 36-character UUIDs; 128 bytes leaves room and nothing more.
MAX_POLICY_UID_BYTES = 128
#: ``namespace/name``: a namespace label (63) + ``/`` + an object name (253).
MAX_POLICY_NAME_BYTES = 63 + 1 + 253

TENANT_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

# CRD spelling (Kubernetes API conventions: CamelCase enum values) <-> wire enums.
MODE_BY_NAME: dict[str, int] = {
    "None": pb.GRAPH_MODE_NONE,
    "Piecewise": pb.GRAPH_MODE_PIECEWISE,
    "Full": pb.GRAPH_MODE_FULL,
    "FullDecodeOnly": pb.GRAPH_MODE_FULL_DECODE_ONLY,
    "FullAndPiecewise": pb.GRAPH_MODE_FULL_AND_PIECEWISE,
}
LADDER_BY_NAME: dict[str, int] = {
    "Default": pb.CAPTURE_LADDER_DEFAULT,
    "Interactivity": pb.CAPTURE_LADDER_INTERACTIVITY,
}
TENANT_GRAPHS_BY_NAME: dict[str, int] = {
    "Enabled": pb.TENANT_GRAPHS_ENABLED,
    "Disabled": pb.TENANT_GRAPHS_DISABLED,
}
DEFAULT_MODE = pb.GRAPH_MODE_FULL_AND_PIECEWISE

#: A byte quantity as the CRD admits it: digits, an optional fraction, a decimal or binary suffix
#: (no sign, no exponent, no ``m``: a budget in thousandths of a byte is a typo).
_QUANTITY_RE = re.compile(r"^([0-9]+)(?:\.([0-9]+))?(k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei|)$")
_QUANTITY_FACTORS = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
#: Digits after the point a binary suffix may carry (the CRD's rule checks divisibility by 5^d
#: in 64-bit integers; 1.5Gi needs one).
MAX_BINARY_FRACTION_DIGITS = 10
#: A budget is an int64 on the wire.
MAX_QUANTITY_BYTES = 2**63 - 1


class PolicyError(FieldError):
    """A policy that cannot be applied."""


# --- capture-size ladders ---------------------------------------------------------------------


def default_max_capture_size(max_num_batched_tokens: int) -> int:
    """The token budget per step, at most 512: PIECEWISE graphs then cover every mixed or prefill
    step the scheduler can make (vLLM stops at twice the sequence limit, so its larger prefill
    steps run eager). Beyond 512 each extra size costs capture time for steps that are
    compute-bound anyway."""
    return max(1, min(max_num_batched_tokens, DEFAULT_MAX_CAPTURE_CEILING))


def default_ladder(max_size: int) -> list[int]:
    """1, 2, 4, then every 8 up to 256, then every 16 up to ``max_size``; ``max_size`` included."""
    steps = [1, 2, 4, *range(8, 257, 8), *range(272, max_size + 1, 16)]
    return _with_max([s for s in steps if s <= max_size], max_size)


def interactivity_ladder(max_size: int) -> list[int]:
    """Every size 1..32 (small batches never pad), then the default steps."""
    steps = set(range(1, 33)) | set(default_ladder(max_size))
    return _with_max(sorted(s for s in steps if s <= max_size), max_size)


def _with_max(sizes: list[int], max_size: int) -> list[int]:
    # The maximum is always captured: vLLM truncated off-stride maxima and lost the top bucket.
    return sizes if sizes and sizes[-1] == max_size else [*sizes, max_size]


def resolve_capture_sizes(
    sizes: pb.CaptureSizes, max_num_seqs: int, max_num_batched_tokens: int
) -> list[int]:
    """The ascending capture sizes a worker with these limits captures for ``sizes``."""
    limit = max_num_batched_tokens
    max_size = sizes.max_capture_size or default_max_capture_size(max_num_batched_tokens)
    which = sizes.WhichOneof("sizes")
    if which == "explicit":
        chosen = sorted(set(sizes.explicit.sizes))
        if sizes.max_capture_size:
            chosen = sorted(set(chosen) | {sizes.max_capture_size})
        return chosen
    max_size = min(max_size, limit)
    if which == "ladder" and sizes.ladder == pb.CAPTURE_LADDER_INTERACTIVITY:
        return interactivity_ladder(max_size)
    return default_ladder(max_size)


@dataclass(frozen=True)
class RecaptureKey:
    """What decides a worker's captured set: two policies with equal keys capture the same graphs,
    so moving from one to the other recaptures nothing (tenant toggles are not part of it)."""

    mode: int
    sizes: tuple
    budget_bytes: int
    max_graphs: int = 0


def recapture_key(policy: pb.GraphPolicy | None, limits: tuple[int, int] | None = None) -> RecaptureKey | None:
    """The one rule for "does this policy change recapture?" (pure).

    The mode is read as the worker reads it (UNSPECIFIED is FULL_AND_PIECEWISE). With ``limits``
    (``max_num_seqs``, ``max_num_batched_tokens``: a worker's) the sizes are the resolved ladder;
    without them (the operator, which does not know a worker's limits) they are the spec with
    equivalent spellings made equal: no ladder is the default ladder, explicit sizes are a sorted
    set holding the maximum. Equal spec keys always mean equal resolved keys.
    """
    if policy is None:
        return None
    spec = policy.capture_sizes
    if limits is not None:
        sizes: tuple = tuple(resolve_capture_sizes(spec, *limits))
    elif spec.WhichOneof("sizes") == "explicit":
        chosen = set(spec.explicit.sizes) | ({spec.max_capture_size} if spec.max_capture_size else set())
        sizes = ("explicit", *sorted(chosen))
    else:
        ladder = spec.ladder if spec.WhichOneof("sizes") == "ladder" else pb.CAPTURE_LADDER_DEFAULT
        sizes = ("ladder", ladder or pb.CAPTURE_LADDER_DEFAULT, spec.max_capture_size)
    return RecaptureKey(effective_requested_mode(policy), sizes, policy.memory_budget_bytes, policy.max_graphs)


def padding_table(capture_sizes: list[int]) -> list[int]:
    """``table[n]`` is the smallest capture size >= n, for n in 0..max; index 0 maps to 0.

    Precomputed once so that the dispatcher pads any token count in O(1).
    """
    if not capture_sizes:
        return [0]
    ordered = sorted(capture_sizes)
    table = [0] * (ordered[-1] + 1)
    bucket = 0
    for n in range(1, ordered[-1] + 1):
        while ordered[bucket] < n:
            bucket += 1
        table[n] = ordered[bucket]
    return table


# --- validation -------------------------------------------------------------------------------


def validate_policy(
    policy: pb.GraphPolicy, max_num_batched_tokens: int | None = None
) -> None:
    """Raises PolicyError naming the first invalid field; silent when the policy is valid.

    ``max_num_batched_tokens`` is given by a worker, which also refuses sizes it can never use.
    """
    if not policy.policy_uid:
        raise PolicyError("policy_uid", "must not be empty")
    check_string("policy_uid", policy.policy_uid, MAX_POLICY_UID_BYTES, PolicyError)
    check_string("policy_name", policy.policy_name, MAX_POLICY_NAME_BYTES, PolicyError)
    if policy.generation < 1:
        raise PolicyError("generation", f"must be at least 1, got {policy.generation}")
    if policy.mode not in MODE_BY_NAME.values() and policy.mode != pb.GRAPH_MODE_UNSPECIFIED:
        raise PolicyError("mode", f"unknown graph mode {policy.mode}")
    _validate_sizes(policy.capture_sizes, max_num_batched_tokens)
    if policy.memory_budget_bytes < 0:
        raise PolicyError("memory_budget_bytes", f"must not be negative, got {policy.memory_budget_bytes}")
    if not 0 <= policy.max_graphs <= MAX_GRAPHS_LIMIT:
        raise PolicyError("max_graphs", f"must be in [0, {MAX_GRAPHS_LIMIT}] (0: no limit), got {policy.max_graphs}")
    if not 0 <= policy.idle_release_seconds <= MAX_IDLE_RELEASE_SECONDS:
        raise PolicyError("idle_release_seconds", f"must be in [0, {MAX_IDLE_RELEASE_SECONDS}] (0: never), "
                                                  f"got {policy.idle_release_seconds}")
    _validate_sleep(policy)
    _validate_tenants(policy)
    if policy.default_tenant_graphs not in (pb.TENANT_GRAPHS_UNSPECIFIED, *TENANT_GRAPHS_BY_NAME.values()):
        raise PolicyError("default_tenant_graphs",
                          f"must be ENABLED, DISABLED or unset (ENABLED), got {policy.default_tenant_graphs}")


def _validate_sizes(sizes: pb.CaptureSizes, max_num_batched_tokens: int | None) -> None:
    max_size = sizes.max_capture_size
    if max_size < 0 or max_size > MAX_CAPTURE_SIZE_LIMIT:
        raise PolicyError(
            "capture_sizes.max_capture_size",
            f"must be in [1, {MAX_CAPTURE_SIZE_LIMIT}] (0 for the default), got {max_size}",
        )
    if sizes.WhichOneof("sizes") == "ladder" and sizes.ladder not in LADDER_BY_NAME.values():
        raise PolicyError("capture_sizes.ladder", f"unknown ladder {sizes.ladder}")
    if sizes.WhichOneof("sizes") != "explicit":
        return
    if max_num_batched_tokens is not None and max_size > max_num_batched_tokens:
        raise PolicyError(  # explicit sizes are exact: a ceiling past what a step can hold means nothing
            "capture_sizes.max_capture_size",
            f"{max_size} exceeds this worker's token budget per step ({max_num_batched_tokens})",
        )
    values = sizes.explicit.sizes
    if len(values) > MAX_EXPLICIT_SIZES:
        raise PolicyError("capture_sizes.explicit.sizes", f"at most {MAX_EXPLICIT_SIZES} sizes")
    values = list(values)
    if not values:
        raise PolicyError("capture_sizes.explicit.sizes", "must list at least one size")
    seen: set[int] = set()
    for i, size in enumerate(values):
        field = f"capture_sizes.explicit.sizes[{i}]"
        if size < 1:
            raise PolicyError(field, f"must be positive, got {size}")
        if size in seen:
            raise PolicyError(field, f"duplicate size {size}")
        seen.add(size)
        ceiling = max_size or MAX_CAPTURE_SIZE_LIMIT
        if size > ceiling:
            raise PolicyError(field, f"{size} exceeds the maximum capture size {ceiling}")
        if max_num_batched_tokens is not None and size > max_num_batched_tokens:
            raise PolicyError(
                field,
                f"{size} exceeds this worker's token budget per step ({max_num_batched_tokens})",
            )


def _validate_sleep(policy: pb.GraphPolicy) -> None:
    if not 0 <= policy.sleep_after_idle_seconds <= MAX_SLEEP_AFTER_IDLE_SECONDS:
        raise PolicyError("sleep_after_idle_seconds", f"must be in [0, {MAX_SLEEP_AFTER_IDLE_SECONDS}] (0: never), "
                                                      f"got {policy.sleep_after_idle_seconds}")
    if policy.sleep_level not in (0, *SLEEP_LEVELS):
        raise PolicyError("sleep_level",
                          f"must be 1 or 2 (0 or unset: {DEFAULT_SLEEP_LEVEL}), got {policy.sleep_level}")


def sleep_level(policy: pb.GraphPolicy) -> int:
    """The Sleep level the policy's idle sleep uses (unset on the wire is the default, 1)."""
    return policy.sleep_level or DEFAULT_SLEEP_LEVEL


def _validate_tenants(policy: pb.GraphPolicy) -> None:
    if len(policy.tenants) > MAX_TENANTS:
        raise PolicyError("tenants", f"at most {MAX_TENANTS} entries")
    seen: set[str] = set()
    for i, toggle in enumerate(policy.tenants):
        if not valid_tenant(toggle.tenant) or not toggle.tenant:
            raise PolicyError(
                f"tenants[{i}].tenant",
                f"{clipped_repr(toggle.tenant)} is not a DNS-1123 label ([a-z0-9-], at most 63 characters)",
            )
        if toggle.tenant in seen:
            raise PolicyError(f"tenants[{i}].tenant", f"duplicate tenant {clipped_repr(toggle.tenant)}")
        seen.add(toggle.tenant)
        if toggle.graphs not in TENANT_GRAPHS_BY_NAME.values():
            raise PolicyError(f"tenants[{i}].graphs", "must be ENABLED or DISABLED")


def valid_tenant(name: str) -> bool:
    """Empty is the default tenant; anything else must be a DNS-1123 label.

    The length is checked before the regular expression, so a huge string costs nothing.
    """
    return name == "" or (len(name) <= 63 and bool(TENANT_RE.fullmatch(name)))


# --- tenants ----------------------------------------------------------------------------------


def tenant_allows_graphs(policy: pb.GraphPolicy, tenant: str) -> bool:
    """Whether a step holding a sequence of ``tenant`` may replay a graph under ``policy``."""
    for toggle in policy.tenants:
        if toggle.tenant == tenant:
            return toggle.graphs != pb.TENANT_GRAPHS_DISABLED
    return policy.default_tenant_graphs != pb.TENANT_GRAPHS_DISABLED


def disabled_tenants(policy: pb.GraphPolicy) -> frozenset[str]:
    """Tenants listed as Disabled (all others follow the default)."""
    return frozenset(t.tenant for t in policy.tenants if t.graphs == pb.TENANT_GRAPHS_DISABLED)


def effective_requested_mode(policy: pb.GraphPolicy) -> int:
    """The policy's mode, with UNSPECIFIED read as the default FULL_AND_PIECEWISE."""
    return policy.mode or DEFAULT_MODE


# --- the custom resource's spec ---------------------------------------------------------------


def parse_quantity(value: str | int, field: str = "memoryBudget") -> int:
    """A Kubernetes quantity (``256Mi``, ``1.5Gi``, ``1G``, ``1024``) as a whole number of bytes.

    The same rule as the CRD's (``deploy/crds``; both are held to one table of examples in
    ``tests/memory_budget_cases.py``): exact integer arithmetic, never a float, so 1.5Gi is
    1,610,612,736 bytes and 1.1Gi, 0.5 or 0.0001k (not whole bytes) are refused, not rounded;
    at most 2^63-1 (the wire's int64). ``field`` names the input in errors (the worker's
    ``--kv-cache-memory`` takes the same rule).
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PolicyError(field, f"{value!r} must be an integer or a quantity string")
    if isinstance(value, int):
        if value < 0:
            raise PolicyError(field, f"must not be negative, got {value}")
        return _bounded(value, value, field)
    match = _QUANTITY_RE.match(value)
    if not match:
        raise PolicyError(field, f"{clipped_repr(value)} is not a byte quantity such as "
                                          "256Mi, 1.5Gi or 1G (no m suffix, sign or exponent)")
    whole, frac, suffix = match.group(1), match.group(2) or "", match.group(3)
    if suffix.endswith("i") and len(frac) > MAX_BINARY_FRACTION_DIGITS:
        raise PolicyError(field, f"{clipped_repr(value)}: at most "
                                          f"{MAX_BINARY_FRACTION_DIGITS} digits after the point "
                                          "before a binary suffix")
    bytes_, rest = divmod(int(whole + frac) * _QUANTITY_FACTORS[suffix], 10 ** len(frac))
    if rest:
        raise PolicyError(field, f"{clipped_repr(value)} is not a whole number of bytes")
    return _bounded(bytes_, value, field)


def _bounded(bytes_: int, value: str | int, field: str) -> int:
    if bytes_ > MAX_QUANTITY_BYTES:
        raise PolicyError(field, f"{clipped_repr(str(value))} is more than "
                                          f"{MAX_QUANTITY_BYTES} bytes (2^63-1)")
    return bytes_


def policy_from_spec(
    spec: Mapping[str, Any], *, uid: str, name: str, generation: int
) -> pb.GraphPolicy:
    """Turns a GraphPolicy custom resource's spec into the wire message, validating it."""
    policy = pb.GraphPolicy(policy_uid=uid, policy_name=name, generation=generation)
    mode = spec.get("mode", "FullAndPiecewise")
    if mode not in MODE_BY_NAME:
        raise PolicyError("spec.mode", f"{mode!r} is not one of {sorted(MODE_BY_NAME)}")
    policy.mode = MODE_BY_NAME[mode]
    _sizes_from_spec(spec.get("captureSizes") or {}, policy.capture_sizes)
    if spec.get("memoryBudget") not in (None, ""):
        try:
            policy.memory_budget_bytes = parse_quantity(spec["memoryBudget"])
        except PolicyError as err:
            raise PolicyError("spec.memoryBudget", err.message) from None
    policy.max_graphs = _spec_int(spec, "maxGraphs", MAX_GRAPHS_LIMIT)
    policy.idle_release_seconds = _spec_int(spec, "idleReleaseSeconds", MAX_IDLE_RELEASE_SECONDS)
    policy.sleep_after_idle_seconds = _spec_int(spec, "sleepAfterIdleSeconds", MAX_SLEEP_AFTER_IDLE_SECONDS)
    policy.sleep_level = _spec_sleep_level(spec)
    default = spec.get("defaultTenantGraphs", "Enabled")
    if default not in TENANT_GRAPHS_BY_NAME:
        raise PolicyError("spec.defaultTenantGraphs", f"{default!r} is not Enabled or Disabled")
    policy.default_tenant_graphs = TENANT_GRAPHS_BY_NAME[default]
    for i, entry in enumerate(spec.get("tenants") or []):
        graphs = entry.get("graphs", "Enabled")
        if graphs not in TENANT_GRAPHS_BY_NAME:
            raise PolicyError(f"spec.tenants[{i}].graphs", f"{graphs!r} is not Enabled or Disabled")
        policy.tenants.add(tenant=str(entry.get("name", "")), graphs=TENANT_GRAPHS_BY_NAME[graphs])
    try:
        validate_policy(policy)
    except PolicyError as err:
        raise PolicyError(_spec_field(err.field), err.message) from None
    return policy


def _spec_int(spec: Mapping[str, Any], key: str, high: int) -> int:
    """An optional non-negative integer field of the spec (0 when omitted)."""
    value = spec.get(key, 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise PolicyError(f"spec.{key}", f"must be an integer from 0 to {high}, got {clipped_repr(str(value))}")
    return value


def _spec_sleep_level(spec: Mapping[str, Any]) -> int:
    """``spec.sleepLevel`` as the wire carries it: 2, or 0 for the default 1 (omitted or 1).

    The default stays unset on the wire so that a policy which leaves sleep alone is byte for
    byte what an operator without the field pushed: a worker refuses a generation it holds sent
    again with other content.
    """
    value = spec.get("sleepLevel", DEFAULT_SLEEP_LEVEL)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value not in SLEEP_LEVELS:
        raise PolicyError("spec.sleepLevel", f"must be 1 or 2, got {clipped_repr(str(value))}")
    return 0 if value == DEFAULT_SLEEP_LEVEL else value


def _sizes_from_spec(spec: Mapping[str, Any], out: pb.CaptureSizes) -> None:
    if "sizes" in spec and "ladder" in spec:
        raise PolicyError("spec.captureSizes", "set either sizes or ladder, not both")
    out.max_capture_size = int(spec.get("maxCaptureSize", 0))
    if "sizes" in spec:
        out.explicit.sizes.extend(int(s) for s in spec["sizes"])
        return
    ladder = spec.get("ladder", "Default")
    if ladder not in LADDER_BY_NAME:
        raise PolicyError("spec.captureSizes.ladder", f"{ladder!r} is not one of {sorted(LADDER_BY_NAME)}")
    out.ladder = LADDER_BY_NAME[ladder]


def _spec_field(field: str) -> str:
    """Maps a wire field path to the custom resource's spelling, for messages people read."""
    renames = {
        "capture_sizes.explicit.sizes": "spec.captureSizes.sizes",
        "capture_sizes.max_capture_size": "spec.captureSizes.maxCaptureSize",
        "capture_sizes.ladder": "spec.captureSizes.ladder",
        "memory_budget_bytes": "spec.memoryBudget",
        "max_graphs": "spec.maxGraphs",
        "idle_release_seconds": "spec.idleReleaseSeconds",
        "sleep_after_idle_seconds": "spec.sleepAfterIdleSeconds",
        "sleep_level": "spec.sleepLevel",
        "tenants": "spec.tenants",
        "mode": "spec.mode",
    }
    for wire, crd in renames.items():
        if field.startswith(wire):
            return crd + field[len(wire):].replace(".tenant", ".name")
    return field


# --- the policy file a worker reads at boot ---------------------------------------------------


def policy_to_json(policy: pb.GraphPolicy) -> str:
    """The policy as the JSON the operator writes into the ConfigMap that worker pods mount."""
    return json_format.MessageToJson(policy, preserving_proto_field_name=True, indent=2)


def policy_from_json(text: str) -> pb.GraphPolicy:
    """Parses a policy file; raises PolicyError on malformed JSON or an invalid policy."""
    try:
        policy = json_format.Parse(text, pb.GraphPolicy())
    except json_format.ParseError as err:
        raise PolicyError("policy_file", f"not a GraphPolicy JSON document: {err}") from None
    validate_policy(policy)
    return policy
