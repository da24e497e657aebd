"""Tensor parallelism: which shapes a rank holds and the one collective the sharded decoder runs.

Megatron-style sharding of the Llama decoder across ``size`` ranks (one process per GPU of a
node, or per CPU process under Gloo in tests):

- **Column-parallel** fused QKV and fused gate/up: a rank holds the rows of its own query heads,
  its own key/value heads and its own slice of the MLP's intermediate channels, so attention, the
  KV cache and SwiGLU run on the rank's heads and channels with no communication at all.
- **Row-parallel** output projection ``wo`` and down projection ``w2``: a rank holds the columns
  that match its heads/channels and produces a partial sum of the full ``[T, dim]`` result; ONE
  all-reduce (sum) per projection completes it, before the residual add. Two all-reduces per layer.
- **Replicated** embedding, norms and LM head (see ``loader.load_model``'s docstring for why).

This module owns the rank's identity (``TensorParallel``), the pure decisions (``tp_config_error``,
``shard_config``, ``shard_range``), the process group (``init_tensor_parallel``,
``end_rank``), the step's collective (``all_reduce``) and the one way ranks agree on
a decision (``first_ranks``: rank 0's). With ``size == 1`` nothing here adds an operation.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
from torch import Tensor

from graphkeeper.worker.model.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks that together hold one model."""

    rank: int = 0
    size: int = 1
    #: The torch.distributed process group of the ranks (None when size == 1).
    group: Any = None

    @property
    def enabled(self) -> bool:
        """Whether the model is split at all (size > 1); when not, no collective ever runs."""
        return self.size > 1


#: One rank holding the whole model: what every worker is without ``--tensor-parallel-size``.
SINGLE = TensorParallel()


def tp_config_error(config: ModelConfig, size: int) -> str | None:
    """Why ``size`` ranks cannot split ``config``, or None if they can (pure).

    Query heads, key/value heads and the MLP's intermediate channels must each divide evenly:
    a rank's key/value heads must be whole and its own (replicating key/value heads across ranks
    when there are fewer than ranks is what vLLM does, and not done here).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return f"tensor parallel size {size!r} is not a positive integer"
    if size == 1:
        return None
    parts = (("attention heads", config.n_heads), ("key/value heads", config.n_kv_heads),
             ("MLP intermediate channels", config.intermediate_size))
    for what, count in parts:
        if count % size:
            return f"the model's {count} {what} do not split evenly over tensor parallel size {size}"
    return None


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank of ``size`` holds: heads, key/value heads and intermediate channels
    divided; ``dim``, ``head_dim``, vocabulary and everything else unchanged (pure). ``config``
    itself when ``size == 1``. Raises ValueError with ``tp_config_error``'s reason otherwise."""
    error = tp_config_error(config, size)
    if error:
        raise ValueError(error)
    if size == 1:
        return config
    return dataclasses.replace(config, n_heads=config.n_heads // size, n_kv_heads=config.n_kv_heads // size,
                               intermediate_size=config.intermediate_size // size, head_dim=config.head_dim)


def shard_range(length: int, tp: TensorParallel) -> slice:
    """The indices of a dimension of ``length`` that rank ``tp.rank`` holds: its equal, contiguous
    part (``length`` divides by ``tp.size``; ``tp_config_error`` made sure of it)."""
    part = length // tp.size
    return slice(tp.rank * part, (tp.rank + 1) * part)


def init_tensor_parallel(rank: int, size: int, init_method: str, device_type: str,
                         timeout_s: float = 60) -> TensorParallel:
    """Joins the ``size`` ranks' process group as ``rank`` (``SINGLE`` when ``size == 1``, with no
    torch.distributed at all): Gloo on the CPU, NCCL on CUDA (rank ``r`` on GPU ``r``, made the
    current device here so a plain ``"cuda"`` means it afterwards).

    ``init_method`` is a torch.distributed URL every rank shares (``tcp://HOST:PORT``, or
    ``file://PATH`` on one machine). ``timeout_s`` bounds the rendezvous and every collective:
    under Gloo a peer that died makes the next collective raise at once (connection reset) and one
    that stalls makes it raise after ``timeout_s``; under NCCL the watchdog aborts the
    communicator after ``timeout_s`` and ends the process. A collective replayed from a CUDA
    graph is not watched by NCCL's watchdog: the engine's own stall detection must cover it.
    One all-reduce runs before returning: it proves every peer is there and creates the NCCL
    communicator now, since one cannot be created while a CUDA graph is being captured.
    """
    if size == 1:
        return SINGLE
    import torch.distributed as dist

    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s), device_id=device if cuda else None)
    tp = TensorParallel(rank, size, dist.group.WORLD)
    probe = torch.ones(1, device=device)
    all_reduce(probe, tp)
    if int(probe.item()) != size:
        raise RuntimeError(f"tensor parallel rank {rank}: the first all-reduce summed {probe.item()}, not {size}")
    return tp


def first_ranks(value: Any, tp: TensorParallel) -> Any:
    """Rank 0's ``value`` on every rank (``value`` itself when ``tp`` is not enabled).

    What a rank decides by timing (kernel tiles, the one-token step) may differ between ranks by
    noise; the ranks must run the same kernels in their replicated parts (the final norm, the
    LM head) to compute the same bits, and the same collectives in the same order, so such a
    decision is rank 0's, sent to all. ``value`` must pickle."""
    if not tp.enabled:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(tp.group, 0), group=tp.group)
    return box[0]


def end_rank(tp: TensorParallel) -> NoReturn:
    """Ends a rank's process once its work is done: a barrier (when ``tp`` is enabled), so no rank
    exits while a peer may still be using its connections, then ``os._exit(0)`` with stdout and
    stderr flushed. The group is not torn down, as a worker's ranks leave theirs: Gloo's teardown
    can abort a process whose peer closed its connections first ("terminate called without an
    active exception": a two-rank CPU test's rank 0 ended so once in a whole-suite run, and not in
    9 runs alone), and so could the interpreter's own finalisation, which destroys the group's
    objects. A failing rank (a peer died, a collective failed) does not come here: no barrier can
    complete, so it ends with its own exit code."""
    if tp.enabled:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier(group=tp.group)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def all_reduce(x: Tensor, tp: TensorParallel) -> Tensor:
    """The sum of ``x`` over the ranks; ``x`` itself, untouched, when ``tp`` is not enabled.

    Eagerly, and while a CUDA graph records the eager step, it is torch.distributed's in-place
    ``all_reduce`` on ``x`` (NCCL's kernels are recorded into the graph and run at each replay;
    ``x`` is always a fresh projection output, so summing in place overwrites nothing anyone else
    reads). Inside ``torch.compile`` it is the functional collective, which Dynamo traces as an
    op of the graph (``fullgraph=True`` holds) and Inductor schedules with its wait.
    """
    if not tp.enabled:
        return x
    if torch.compiler.is_compiling():
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x, "sum", tp.group)
    import torch.distributed as dist

    dist.all_reduce(x, group=tp.group)
    return x
