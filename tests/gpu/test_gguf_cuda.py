"""The default model (SmolLM2-135M-Instruct, GGUF) on the GPU in every graph mode against
`transformers` loading the same file: float32, greedy, the same tokens for every prompt alone and
in one batch; the steps really replayed graphs where the mode has them."""

from __future__ import annotations

import threading

import pytest
import torch

from graphkeeper.proto import worker_pb2 as pb
from graphkeeper.worker.engine import Engine, EngineSettings
from graphkeeper.worker.model.catalog import DEFAULT_BUILTIN, BuiltinModelError, resolve_builtin
from graphkeeper.worker.model.tokenizer import load_tokenizer


def _model_missing() -> str:
    """Why the default model cannot be loaded here ('' when it can): the GPU machine's image lacks the
    model's package (94 MB, more than a call may carry), and an error there would read as a failure."""
    try:
        resolve_builtin(DEFAULT_BUILTIN)
    except BuiltinModelError as err:
        return str(err)
    return ""


MODEL_MISSING = _model_missing()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run pytest -m cuda on one)"),
    pytest.mark.skipif(bool(MODEL_MISSING), reason=f"the default model is not installed: {MODEL_MISSING}"),
]

PROMPTS = [
    "The three primary colors are", "def fibonacci(n):", "Kubernetes is", "Once upon a time, in a small village,",
    "The capital of Japan is", "1, 2, 3, 4,", "Water boils at", "Translate to French: good morning ->",
]
NEW_TOKENS = 12
MODES = {
    "none": (pb.GRAPH_MODE_NONE, 1), "full": (pb.GRAPH_MODE_FULL, 1), "piecewise": (pb.GRAPH_MODE_PIECEWISE, 1),
    "full_decode_only": (pb.GRAPH_MODE_FULL_DECODE_ONLY, 1),
    "full_and_piecewise": (pb.GRAPH_MODE_FULL_AND_PIECEWISE, 1),
    "full_and_piecewise-O2": (pb.GRAPH_MODE_FULL_AND_PIECEWISE, 2),
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = load_tokenizer(DEFAULT_BUILTIN)
    return [tok.encode_ids(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(prompts) -> list[list[int]]:
    """transformers' greedy tokens, float32 on the GPU, weights dequantized from the same GGUF."""
    transformers = pytest.importorskip("transformers")
    path = resolve_builtin(DEFAULT_BUILTIN)
    directory, name = path.rsplit("/", 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).cuda()
    out = []
    with torch.no_grad():
        for ids in prompts:
            generated = model.generate(torch.tensor([ids]).cuda(), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       min_new_tokens=NEW_TOKENS, pad_token_id=0)
            out.append(generated[0][len(ids):].tolist())
    del model
    torch.cuda.empty_cache()
    return out


def run(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], pb.Completion]]:
    """Submits every prompt at once and waits for all of them."""
    results: list = [None] * len(prompts)
    done = threading.Semaphore(0)

    def emitter(i: int):
        tokens: list[int] = []

        def emit(new, end):
            tokens.extend(new)
            if end is not None:
                results[i] = (tokens, end)
                done.release()
        return emit

    for i, ids in enumerate(prompts):
        req = pb.GenerateRequest(prompt_token_ids=ids,
                                 stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        engine.submit(req, emitter(i))
    for _ in prompts:
        assert done.acquire(timeout=120)
    return results


@pytest.mark.parametrize("name", list(MODES))
def test_every_graph_mode_gives_transformers_tokens_alone_and_batched(name, prompts, expected, tmp_path):
    mode, level = MODES[name]
    policy = pb.GraphPolicy(mode=mode)
    engine = Engine(EngineSettings(model=DEFAULT_BUILTIN, device="cuda", dtype="float32", max_num_seqs=8,
                                   max_seq_len=256, max_num_batched_tokens=256, policy=policy,
                                   optimization_level=level, compile_cache_dir=str(tmp_path / "compile")))
    engine.start()
    try:
        assert engine.ready.wait(600) and engine.failed is None, engine.failed
        alone = [run(engine, [ids])[0] for ids in prompts]
        batched = run(engine, prompts)
        assert [tokens for tokens, _ in alone] == expected
        assert [tokens for tokens, _ in batched] == expected
        replayed = sum(g.steps for _, c in alone + batched for g in c.execution.graph_steps)
        if mode == pb.GRAPH_MODE_NONE:
            assert replayed == 0
        else:
            assert replayed > 0, "no step replayed a graph"
    finally:
        engine.drain_and_stop(5)
