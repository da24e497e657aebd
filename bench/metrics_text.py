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


def series_key(name: str, process: str = "", le: str = "") -> str:
    """How ``summed`` names a series: ``name``, with the ``process`` label it keeps apart and a
    bucket's ``le`` bound, in that order (``name_bucket{process="api",le="0.005"}``; pure)."""
    labels = [f'{key}="{v}"' for key, v in (("process", process), ("le", le)) if v]
    return f"{name}{{{','.join(labels)}}}" if labels else name


def summed(text: str) -> dict[str, float]:
    """Prometheus text, each series summed by name (``series_key``): eager steps by reason, histogram
    buckets by bound, everything else over all its labels; a series with a ``process`` label (the
    collector's pauses, one set per worker process) is kept apart by process (pure)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name_labels, sample = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if name == "graphkeeper_eager_steps_total":
            key = name_labels
        else:
            le = label(name_labels, "le") if name.endswith("_bucket") else ""
            key = series_key(name, label(name_labels, "process"), le)
        out[key] = out.get(key, 0.0) + float(sample)
    return out


def label(name_labels: str, name: str) -> str:
    """The value of label ``name`` in a sample's ``metric{labels}``; "" when it has none (matched
    whole: ``le`` is not the end of ``file``; pure)."""
    for before in ("{", ","):
        head = f'{before}{name}="'
        if head in name_labels:
            return name_labels.split(head, 1)[1].split('"', 1)[0]
    return ""


def value(text: str, name: str, **labels: str) -> float:
    """The sample ``name`` whose labels are exactly ``labels``; 0.0 when there is none (pure)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0
