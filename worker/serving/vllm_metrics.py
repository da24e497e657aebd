"""graphkeeper's scheduler and KV-cache gauges also under vLLM's names (``--vllm-metric-names``,
on by default: a gateway pointed at a default worker finds them; ``--no-vllm-metric-names`` leaves
them out).

Inference gateways and autoscalers read a model server's load from vLLM's series: the Gateway API
Inference Extension's endpoint picker reads ``vllm:num_requests_waiting``,
``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc`` by default, and the vLLM
production-stack router still reads ``vllm:gpu_cache_usage_perc``. Rather than a second set of
gauges that could drift, the aliases are made at scrape time from graphkeeper's own samples
(one source of truth), with vLLM's ``model_name`` label added. A source series that this worker
does not export (yet) is simply left out.

- graphkeeper_queue_depth -> vllm:num_requests_waiting
- graphkeeper_running_sequences -> vllm:num_requests_running
- graphkeeper_kv_cache_usage_ratio -> vllm:kv_cache_usage_perc and vllm:gpu_cache_usage_perc
- graphkeeper_kv_cache_block_size_tokens and graphkeeper_kv_cache_blocks -> the labels of
  vllm:cache_config_info{block_size, num_gpu_blocks} (value 1)

vLLM's ``*_perc`` gauges are fractions in [0, 1], like graphkeeper's ratio: no scaling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from graphkeeper.worker.engine import EngineFace
from graphkeeper.worker.serving.streams import public_model_info

#: graphkeeper gauge -> the vLLM gauges that repeat its value.
ALIASES: dict[str, tuple[str, ...]] = {
    "graphkeeper_queue_depth": ("vllm:num_requests_waiting",),
    "graphkeeper_running_sequences": ("vllm:num_requests_running",),
    "graphkeeper_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
HELP = {
    "vllm:num_requests_waiting": "Requests waiting to be scheduled (graphkeeper_queue_depth).",
    "vllm:num_requests_running": "Requests running on the model (graphkeeper_running_sequences).",
    "vllm:kv_cache_usage_perc": "KV-cache usage, 0 to 1 (graphkeeper_kv_cache_usage_ratio).",
    "vllm:gpu_cache_usage_perc": "KV-cache usage, 0 to 1 (graphkeeper_kv_cache_usage_ratio; vLLM's older name).",
}
BLOCK_SIZE = "graphkeeper_kv_cache_block_size_tokens"
BLOCKS = "graphkeeper_kv_cache_blocks"
MODEL_LABEL = "model_name"


def vllm_aliases(families: Iterable[Metric], model_name: str) -> list[Metric]:
    """The vLLM-named gauges for graphkeeper's ``families`` (pure): each source sample's value,
    its labels kept and ``model_name`` added; nothing for a source that is absent."""
    by_name = {f.name: f for f in families}
    out: list[Metric] = []
    for source, targets in ALIASES.items():
        family = by_name.get(source)
        if family is None or not family.samples:
            continue
        for target in targets:
            samples = [s for s in family.samples if s.name == source]
            label_names = sorted({k for s in samples for k in s.labels})
            alias = GaugeMetricFamily(target, HELP[target], labels=[*label_names, MODEL_LABEL])
            for sample in samples:
                alias.add_metric([*(sample.labels.get(k, "") for k in label_names), model_name], sample.value)
            out.append(alias)
    size, blocks = _value(by_name.get(BLOCK_SIZE)), _value(by_name.get(BLOCKS))
    if size is not None and blocks is not None:
        info = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration (graphkeeper_kv_cache_*).",
                                 labels=["block_size", "num_gpu_blocks", MODEL_LABEL])
        info.add_metric([str(int(size)), str(int(blocks)), model_name], 1.0)
        out.append(info)
    return out


def _value(family: Metric | None) -> float | None:
    if family is None:
        return None
    values = [s.value for s in family.samples if s.name == family.name]
    return values[0] if len(values) == 1 else None


class WithVllmNames:
    """A registry view: ``inner``'s families, then their vLLM aliases, from one ``collect``."""

    def __init__(self, inner: Any, model_name: Callable[[], str]) -> None:
        self.inner = inner
        self.model_name = model_name

    def collect(self) -> list[Metric]:
        families = list(self.inner.collect())
        return families + vllm_aliases(families, self.model_name())


def served_model_name(engine: EngineFace, served_name: str = "") -> str:
    """What clients call the model: --served-model-name, else the model's public name ('' before it loads)."""
    if served_name:
        return served_name
    info = engine.model_info()
    return public_model_info(info).source if info is not None else ""


def exported_registry(engine: EngineFace, served_name: str = "", vllm_names: bool = True) -> Any:
    """What ``/metrics`` exports: the engine's registry, with the vLLM aliases when asked for."""
    if not vllm_names:
        return engine.metrics.registry
    return WithVllmNames(engine.metrics.registry, lambda: served_model_name(engine, served_name))
