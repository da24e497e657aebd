"""Logits processing on its own: rows that ask for nothing keep their logits bit for bit, the
mask, bias and penalties change exactly the entries they name, a step re-run without a culprit
keeps every other row's processing, and a runner step mixing plain and processed rows samples
the plain rows' tokens exactly as a step without processing does."""

from __future__ import annotations

import numpy as np
import torch

from graphkeeper.worker.engine.logits_state import LogitsState, build_logits_batch
from graphkeeper.worker.executor.logits import pick_logprobs, process, unpack_mask
from graphkeeper.worker.plan import LogitsSpec, SamplingBatch, SamplingSpec, StepPlan


def states(*specs: LogitsSpec | None, outputs=((),), prompt=(1, 2, 3)) -> list[LogitsState | None]:
    out = []
    for i, spec in enumerate(specs):
        if spec is None:
            out.append(None)
            continue
        state = LogitsState(spec, list(prompt))
        for token in outputs[i % len(outputs)]:
            state.accept(token)
        out.append(state)
    return out


def test_plain_rows_keep_their_logits_bit_for_bit():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    batch = build_logits_batch(states(None, LogitsSpec(frequency_penalty=1.0, logit_bias=((3, 2.0),)), None,
                                      LogitsSpec(logprobs=2), outputs=((), (4, 4, 9))))
    out = process(logits, batch, None)
    assert list(batch.rows) == [1]  # log probabilities alone change no logits
    for row in (0, 2, 3):
        assert torch.equal(out[row], logits[row])
    expected = logits[1].clone()
    expected[3] += 2.0
    expected[4] -= 2.0  # twice in the output
    expected[9] -= 1.0
    assert torch.equal(out[1], expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    batch = build_logits_batch(states(LogitsSpec(repetition_penalty=2.0), prompt=(0, 1), outputs=((4,),)))
    out = process(logits, batch, None)
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.5]]


def test_min_p_drops_tokens_below_the_floor_at_the_rows_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    batch = build_logits_batch(states(LogitsSpec(min_p=0.5)))
    sampling = SamplingBatch.build([SamplingSpec(temperature=1.0)], [0], np.zeros(1, np.int64))
    out = process(logits, batch, sampling)
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    # At temperature 2 the distribution is flatter: 0.15 is now within half of the most likely.
    hot = SamplingBatch.build([SamplingSpec(temperature=2.0)], [0], np.zeros(1, np.int64))
    assert torch.isfinite(process(logits, batch, hot)[0, :3]).all()


def test_a_grammar_mask_allows_exactly_its_bits():
    words = torch.tensor([[0b1010, 1 << 31 | 1]], dtype=torch.int64).to(torch.int32)
    assert torch.nonzero(unpack_mask(words, 64)[0]).flatten().tolist() == [1, 3, 32, 63]  # bit 31: the sign
    assert torch.nonzero(unpack_mask(words, 40)[0]).flatten().tolist() == [1, 3, 32]  # past the vocabulary: cut


def test_logprobs_pick_the_chosen_token_and_the_most_likely():
    lp = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0]]), -1)
    chosen, values, ids = pick_logprobs(lp, torch.tensor([2]), 2)
    assert chosen.tolist() == [lp[0, 2].item()] and ids.tolist() == [[1, 2]]
    assert pick_logprobs(lp, torch.tensor([0]), 0)[2].shape == (1, 0)


def test_a_re_run_without_a_culprit_keeps_the_other_rows_processing():
    batch = build_logits_batch(states(LogitsSpec(logit_bias=((1, 1.0),)), None, LogitsSpec(frequency_penalty=1.0),
                                      LogitsSpec(logit_bias=((5, -3.0),), logprobs=1), outputs=((7,),)))
    kept = batch.select([2, 3])  # rows 0 and 1 are gone; 2 and 3 become 0 and 1
    assert kept.rows.tolist() == [0, 1]
    assert kept.counts.tolist() == [[0], [7], [1]] and kept.bias[0].tolist() == [[1], [5]]
    assert kept.bias[1].tolist() == [-3.0] and kept.logprobs.tolist() == [-1, 1]


def test_a_runner_step_mixing_plain_and_processed_rows_keeps_the_plain_tokens(runner):
    """Four decode rows on the dummy slot: greedy, drawn, and the same two with processing."""
    plan = runner.inert_decode(4)
    sampling = SamplingBatch.build([SamplingSpec(), SamplingSpec(temperature=0.9, top_k=20), SamplingSpec(),
                                    SamplingSpec(temperature=0.9, top_k=20)], [1, 2, 1, 2], np.zeros(4, np.int64))
    plain = StepPlan(**{**plan.__dict__, "sampling": sampling})
    hidden = runner.forward_eager(runner.prepare(plain, 4), 4)
    expected = runner.sample_and_send(hidden, plain).tokens().copy()
    processed = StepPlan(**{**plain.__dict__, "logits": build_logits_batch(states(
        None, None, LogitsSpec(logit_bias=((11, 100.0),)), LogitsSpec(min_p=0.5, logprobs=3)))})
    launched = runner.sample_and_send(hidden, processed)
    tokens = launched.tokens()
    assert tokens[:2].tolist() == expected[:2].tolist()
    assert tokens[2] == 11
    logprobs = launched.token_logprobs()
    assert len(logprobs) == 4 and len(logprobs[3].top) == 3 and logprobs[3].token == tokens[3]
    assert logprobs[:3] == [None, None, None]  # computed only for the row that asked
