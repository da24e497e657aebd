"""The worker's ``/metrics`` as the benchmarks read it: fetched, then either summed by name (counter
deltas over a load, a histogram's buckets by bound) or one series picked by its exact labels.

One reader for every benchmark, on ``prometheus_client``'s own parser where labels matter.
"""

from __future__ import annotations

import urllib.request


def fetch(url: str) -> str:
    """The text at a ``/metrics`` URL."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def summed(text: str) -> dict[str, float]:
    """Prometheus text, each series summed by name: eager steps by reason, histogram buckets by
    bound, everything else over all its labels; a series with a ``process`` label (the collector's
    pauses, one set per worker process) is kept apart by process: ``name{process="api"}`` and
    ``name_bucket{process="api",le="0.005"}`` (pure)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        process = name_labels.split('process="', 1)[1].split('"', 1)[0] if 'process="' in name_labels else ""
        apart = f'process="{process}",' if process else ""
        key = f"{name}{{{apart[:-1]}}}" if process else name
        if name == "graphkeeper_eager_steps_total":
            key = name_labels
        elif name.endswith("_bucket"):  # summed over every other label, per bucket
            bound = name_labels.split('le="', 1)[1].split('"', 1)[0]
            key = f'{name}{{{apart}le="{bound}"}}'
        out[key] = out.get(key, 0.0) + float(value)
    return out


def value(text: str, name: str, **labels: str) -> float:
    """The sample ``name`` whose labels are exactly ``labels``; 0.0 when there is none (pure)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0
