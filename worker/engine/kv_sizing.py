"""Track B: the KV cache sized after measured graph memory (``--gpu-memory-utilization``, CUDA).

The engine starts with a provisional cache of one whole context and captures the policy's graphs
beside it; ``UtilizationSizing.size`` then measures what the weights, the graphs and the largest
eager step take, gives the cache what is left of ``utilization`` x device memory (the pure
decision is ``sizing.plan_kv_by_utilization``), and captures the graphs again against the new
cache (a new KV allocation moves the addresses every graph recorded: they are released first).

The cache then holds what the graphs left, so a later policy whose graphs would need more than
the graphs hold now plus what is still free is refused (``check_graphs_fit``) rather than captured
into an out-of-memory. Under track A (``utilization`` 0) every method here does nothing.
"""

from __future__ import annotations

import logging

import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.proto.policy import PolicyError
from graphkeeper.worker.engine.blocks import BlockManager, blocks_for
from graphkeeper.worker.engine.model_slot import ModelSlot
from graphkeeper.worker.engine.sizing import UtilizationPlan, aligned, estimate_graph_bytes, plan_kv_by_utilization
from graphkeeper.worker.engine.traffic import TrafficHistogram
from graphkeeper.worker.executor.graphs.controller import CaptureController
from graphkeeper.worker.model.step import default_stance
from graphkeeper.worker.settings import EngineSettings

log = logging.getLogger(__name__)


class UtilizationSizing:
    """Track B's plan, and what it measured once the final graphs were captured."""

    def __init__(self, utilization: float) -> None:
        #: The fraction of device memory the worker may use (0: track A, the cache is sized up front).
        self.utilization = utilization
        self.plan: UtilizationPlan | None = None
        #: What was free for the cache once the final graphs were captured (the plan's truth).
        self.free_after_capture = 0
        #: Device memory graphs may take beside the cache.
        self.graph_room = 0

    @property
    def label(self) -> str:
        """``KVCacheStatus.sizing``: how the cache was sized."""
        return "utilization" if self.utilization else "explicit"

    def provisional_blocks(self, settings: EngineSettings, sized_blocks: int) -> int:
        """The cache to start with: one whole context under track B, until the graphs are measured."""
        if not self.utilization:
            return sized_blocks
        return blocks_for(aligned(settings.max_seq_len), settings.kv_block_size)

    def size(self, slot: ModelSlot, blocks: BlockManager, capture: CaptureController, policy: pb.GraphPolicy,
             step_tokens: int) -> None:
        """Measures what the step and the graphs take beside the provisional KV cache, gives the
        cache what is left of ``utilization`` x device memory, and captures the graphs again
        against it (a new KV allocation invalidates every graph: they are released first).

        The activation peak is measured on an eager step of the whole token budget
        (``step_tokens``), the largest a fallback step can be: serving must keep that much free
        outside the graphs' pools.
        """
        if not self.utilization:
            return
        utilization, device, runner = self.utilization, slot.device, slot.runner
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with default_stance():
            runner.warm_up(step_tokens)
        peak = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        cache = runner.cache
        plan = plan_kv_by_utilization(
            total_bytes=total, utilization=utilization, used_bytes=total - free,
            provisional_kv_bytes=cache.num_blocks * cache.block_bytes, activation_peak_bytes=peak,
            block_bytes=cache.block_bytes, min_blocks=cache.max_blocks_per_seq)
        log.info("--gpu-memory-utilization: %s", plan.explanation)
        capture.release()
        runner = cache = None
        slot.resize_kv(plan.kv_blocks)
        blocks.resize(plan.kv_blocks)
        capture.begin(policy, slot.runner)
        capture.run_all()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        # What the cache could have taken, knowing the final capture: the prediction's truth.
        self.free_after_capture = plan.kv_bytes + int(total * utilization) - (total - free) - peak
        graphs = capture.graph_set
        self.graph_room = (graphs.memory_bytes if graphs else 0) + max(0, self.free_after_capture - plan.kv_bytes)
        self.plan = plan
        log.info("KV cache planned %d B; %d B was free for it after the final capture (%.2f%% apart)",
                 plan.kv_bytes, self.free_after_capture,
                 100 * abs(plan.kv_bytes - self.free_after_capture) / max(1, self.free_after_capture))

    def check_graphs_fit(self, capture: CaptureController, policy: pb.GraphPolicy, traffic: TrafficHistogram) -> None:
        """Raises PolicyError when ``policy``'s graphs would need more device memory than there is
        room for beside the cache (any thread). The keys are the ones ``begin`` would capture:
        ``capture.plan``, with ``max_graphs`` kept by the traffic served so far."""
        graphs = capture.graph_set
        if self.plan is None or graphs is None or not graphs.captured:
            return
        keys = capture.plan(policy, traffic.tokens()).keys  # none for a policy of mode NONE
        # A coarse size released as compute bound will be again: it holds nothing once the phase
        # ends (its transient pool is an eager step's activations, which the plan keeps free).
        keys = [k for k in keys if getattr(graphs.skipped.get(k), "reason", 0) != pb.FALLBACK_REASON_COMPUTE_BOUND]
        # Device memory a key took to capture: its pool's growth and what its capture stream
        # allocated beside the pool (library workspaces), as the allocator reserved them; graph
        # memory (device_bytes) counts the pool alone, and the room is device memory.
        measured = {k: max(0, e.device_bytes, e.reserved_bytes) for k, e in graphs.captured.items()}
        need = estimate_graph_bytes(keys, measured)
        if need > self.graph_room:
            raise PolicyError("capture_sizes", f"its graphs would take about {need} B of device memory; beside the KV "
                              f"cache sized by --gpu-memory-utilization there is room for {self.graph_room} B "
                              "(fewer or smaller sizes, or restart the worker to size the cache for them)")

    def report(self, status: pb.KVCacheStatus) -> pb.KVCacheStatus:
        """``status`` with the plan's bytes and what was free after the final capture (track B only)."""
        if self.plan is not None:
            status.planned_bytes, status.free_after_capture_bytes = self.plan.kv_bytes, self.free_after_capture
        return status
