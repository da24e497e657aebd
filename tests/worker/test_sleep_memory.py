"""Sleep's decisions and what sleep mode changes on a CPU worker (the memory side runs on CUDA:
tests/gpu/test_graphs_cuda.py checks graphs replay the same tokens after sleep and wake)."""

from __future__ import annotations

import pytest
import torch

from graphkeeper.worker.engine.ledger import Ledger
from graphkeeper.worker.engine.model_slot import ModelSlot
from graphkeeper.worker.engine.sleep import sleep_model, sleep_refusal, wake_model
from graphkeeper.worker.metrics import WorkerMetrics
from graphkeeper.worker.settings import EngineSettings


@pytest.mark.parametrize(("device", "mode", "level", "reason"), [
    ("cpu", True, 1, "sleep needs a CUDA device: this worker runs on cpu"),
    ("cuda", False, 1, "started without --enable-sleep-mode"),
    ("cuda", True, 0, "level must be 1"),
    ("cuda", True, 3, "level must be 1"),
    ("cpu", False, 7, "level must be 1"),
])
def test_a_sleep_that_cannot_keep_the_graphs_is_refused_with_the_reason(device, mode, level, reason):
    assert reason in sleep_refusal(device, mode, level)


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleep_is_allowed_only_on_cuda_in_sleep_mode(level):
    assert sleep_refusal("cuda", True, level) is None


def test_on_cpu_sleep_mode_changes_nothing_and_sleep_model_refuses():
    """A CPU worker started with --enable-sleep-mode keeps ordinary memory, and a sleep reaching
    the memory side anyway raises with the reason instead of touching it."""
    settings = EngineSettings(model="random:tiny", device="cpu", dtype="float32", max_num_seqs=2,
                              max_seq_len=64, max_num_batched_tokens=32, sleep_mode=True)
    slot = ModelSlot(settings, torch.device("cpu"), Ledger(), WorkerMetrics())
    slot.install(slot.load(settings.model, ""))
    assert not slot.sleepable
    assert slot.runner.loaded.weights_region is None and slot.runner.cache.region is None
    with pytest.raises(ValueError, match="sleep needs a CUDA device"):
        sleep_model(slot, 1)
    assert slot.sleep_level == 0
    assert wake_model(slot).level == 0  # awake: nothing to do
