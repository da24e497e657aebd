"""Logits processing on its own: rows that ask for nothing keep their logits bit for bit, the
mask, bias and penalties change exactly the entries they name, penalty counts kept on the device
follow each sampled token and start over on a new slot, a step re-run without a culprit keeps
every other row's processing, and a runner step mixing plain and processed rows samples the plain
rows' tokens exactly as a step without processing does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphkeeper.worker.engine.logits_state import LogitsState, build_logits_batch, mark_counted
from graphkeeper.worker.engine.sequence import Sequence
from graphkeeper.worker.executor.logits import count_sampled, process, sample_processed, unpack_mask
from graphkeeper.worker.executor.penalty_counts import PenaltyCounts
from graphkeeper.worker.executor.sampling import sample
from graphkeeper.worker.kernels import logprob_kernel
from graphkeeper.worker.plan import LogitsSpec, SamplingBatch, SamplingSpec, StepPlan, unpack_logprob


def sampler(logits: LogitsState | None, slot: int, prompt: list[int], output: list[int] | None = None) -> Sequence:
    """A sampling sequence with what the batch builder reads: its logits state, slot, prompt and output."""
    return Sequence(request_id=f"r{slot}", tenant="", prompt=prompt, max_new_tokens=64, sampling=SamplingSpec(),
                    logits=logits, slot=slot, output=list(output or ()))


def states(*specs: LogitsSpec | None, outputs=((),), prompt=(1, 2, 3)) -> list[Sequence]:
    """A sample row per spec, row ``i`` on slot ``i`` with output ``outputs[i % len(outputs)]``."""
    return [sampler(None if spec is None else LogitsState(spec), i, list(prompt), list(outputs[i % len(outputs)]))
            for i, spec in enumerate(specs)]


def counts(vocab: int = 64) -> PenaltyCounts:
    return PenaltyCounts(vocab, torch.device("cpu"))


def test_plain_rows_keep_their_logits_bit_for_bit():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    batch = build_logits_batch(states(None, LogitsSpec(frequency_penalty=1.0, logit_bias=((3, 2.0),)), None,
                                      LogitsSpec(logprobs=2), outputs=((), (4, 4, 9))))
    out = process(logits, batch, None, counts(50))
    assert list(batch.rows) == [1]  # log probabilities alone change no logits
    for row in (0, 2, 3):
        assert torch.equal(out[row], logits[row])
    expected = logits[1].clone()
    expected[3] += 2.0
    expected[4] -= 2.0  # twice in the output
    expected[9] -= 1.0
    assert torch.equal(out[1], expected)


def test_a_batch_lists_each_processed_rows_parameters_in_row_order():
    """The builder's one pass: entries follow the processed rows in order, penalties point at
    their entries and slots, logprobs cover every sample row, and a spec whose flags were read
    still equals a fresh one (the flags are cached on the spec, never compared)."""
    penalised = LogitsSpec(presence_penalty=0.5, repetition_penalty=1.5)
    batch = build_logits_batch(states(None, LogitsSpec(logprobs=2), LogitsSpec(min_p=0.25, logit_bias=((5, -1.0),)),
                                      None, penalised))
    assert batch.rows.tolist() == [2, 4]
    assert batch.min_p.tolist() == [0.25, 0.0] and batch.presence.tolist() == [0.0, 0.5]
    assert batch.repetition.tolist() == [1.0, 1.5] and batch.frequency.tolist() == [0.0, 0.0]
    assert batch.penalised.tolist() == [1] and batch.penalty_slots.tolist() == [4]
    assert batch.bias[0].tolist() == [[0], [5]] and batch.bias[1].tolist() == [-1.0]
    assert batch.logprobs.tolist() == [-1, 2, -1, -1, -1]
    assert penalised == LogitsSpec(presence_penalty=0.5, repetition_penalty=1.5) and penalised.penalised
    assert build_logits_batch(states(None, None)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drawn", [False, True], ids=["greedy", "drawn"])
def test_sampling_processed_rows_alone_gives_the_whole_batchs_tokens(dtype, drawn):
    """A greedy step processes only the rows that ask and takes the others' argmax on the head's
    own logits: the same tokens, bit for bit, as sampling the whole processed batch (a step with a
    drawn row, and one with log probabilities alone, go through the whole batch as before)."""
    torch.manual_seed(1)
    vocab = 50
    specs = (None, LogitsSpec(frequency_penalty=1.0, logit_bias=((7, 9.0),)), None,
             LogitsSpec(repetition_penalty=3.0), LogitsSpec(logprobs=2), None)
    for trial in range(20):
        head = (torch.randn(6, vocab) * 3).to(dtype)
        head[0, 5] = head[0, 6] = head[0].max() + 1  # a tie: the first one wins either way
        batch = build_logits_batch(states(*specs, outputs=((), (7, 7, 8), (), (1, 2))))
        sampling = (SamplingBatch.build([SamplingSpec(temperature=0.7 if r == 2 else 0.0) for r in range(6)],
                                        list(range(6)), np.full(6, trial, np.int64)) if drawn else None)
        want = sample(process(head, batch, sampling, counts(vocab)), sampling)
        got = sample_processed(head, batch, sampling, counts(vocab))
        assert torch.equal(got, want), (trial, got, want)
        assert got[0].item() == 5
    logprobs_only = build_logits_batch(states(None, LogitsSpec(logprobs=3)))
    head = torch.randn(2, vocab).to(dtype)
    assert torch.equal(sample_processed(head, logprobs_only, None, counts(vocab)), head.float().argmax(-1))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    batch = build_logits_batch(states(LogitsSpec(repetition_penalty=2.0), prompt=(0, 1), outputs=((4,),)))
    out = process(logits, batch, None, counts(5))
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.5]]


def test_min_p_drops_tokens_below_the_floor_at_the_rows_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    batch = build_logits_batch(states(LogitsSpec(min_p=0.5)))
    sampling = SamplingBatch.build([SamplingSpec(temperature=1.0)], [0], np.zeros(1, np.int64))
    out = process(logits, batch, sampling, counts())
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    # At temperature 2 the distribution is flatter: 0.15 is now within half of the most likely.
    hot = SamplingBatch.build([SamplingSpec(temperature=2.0)], [0], np.zeros(1, np.int64))
    assert torch.isfinite(process(logits, batch, hot, counts())[0, :3]).all()


def test_a_grammar_mask_allows_exactly_its_bits():
    words = torch.tensor([[0b1010, 1 << 31 | 1]], dtype=torch.int64).to(torch.int32)
    assert torch.nonzero(unpack_mask(words, 64)[0]).flatten().tolist() == [1, 3, 32, 63]  # bit 31: the sign
    assert torch.nonzero(unpack_mask(words, 40)[0]).flatten().tolist() == [1, 3, 32]  # past the vocabulary: cut


def test_logprobs_pick_the_chosen_token_and_the_most_likely():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    lp = torch.log_softmax(logits, -1)
    line = logprob_kernel.reference(logits, torch.tensor([2]), 2)  # [chosen, 2 values, 2 ids]
    chosen, ids = line[:, 0], line[:, 3:].long()
    assert chosen.tolist() == [lp[0, 2].item()] and ids.tolist() == [[1, 2]]
    assert logprob_kernel.reference(logits, torch.tensor([0]), 0)[:, 1:].shape == (1, 0)


def test_a_re_run_without_a_culprit_keeps_the_other_rows_processing():
    batch = build_logits_batch(states(LogitsSpec(logit_bias=((1, 1.0),)), None, LogitsSpec(frequency_penalty=1.0),
                                      LogitsSpec(logit_bias=((5, -3.0),), logprobs=1), outputs=((7,),)))
    kept = batch.select([2, 3])  # rows 0 and 1 are gone; 2 and 3 become 0 and 1
    assert kept.rows.tolist() == [0, 1]
    assert kept.penalised.tolist() == [0] and kept.penalty_slots.tolist() == [2]
    assert kept.bias[0].tolist() == [[1], [5]]
    assert kept.bias[1].tolist() == [-3.0] and kept.logprobs.tolist() == [-1, 1]
    assert kept.reset_slots.tolist() == [2] and kept.reset_output.tolist() == [[2], [7]]


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
    packed = launched.token_logprobs()
    assert len(packed) == 4 and packed[:3] == [None, None, None]  # computed only for the row that asked
    computed, line = packed[3]
    entry = unpack_logprob(int(tokens[3]), (computed, computed, line))
    assert len(entry.top) == 3 and entry.token == tokens[3]
    expected_lp = runner.model.head(hidden[:4]).float().log_softmax(-1)[3]
    assert entry.logprob == pytest.approx(float(expected_lp[tokens[3]]), abs=1e-5)
    assert [t for t, _ in entry.top] == expected_lp.topk(3).indices.tolist()
    assert unpack_logprob(int(tokens[3]), (computed, 1, line)).top == entry.top[:1]  # a request's own count


def test_penalty_counts_follow_each_sampled_token_and_start_over_on_a_new_slot():
    """The device adds each penalised row's sampled token to its slot's counts; the next step's
    batch carries no history, and its penalties still see every token. A sequence moved to a new
    slot (a preemption) starts that row over from the host's output; a slot's next owner does not
    inherit its counts; a step that failed before its sampling leaves the rows to be started over."""
    pen = counts(8)
    flat = torch.zeros(1, 8)
    seq = sampler(LogitsState(LogitsSpec(frequency_penalty=1.0)), slot=3, prompt=[1], output=[5])

    def step(token: int | None) -> torch.Tensor:
        batch = build_logits_batch([seq])
        out = process(flat, batch, None, pen)
        if token is not None:
            count_sampled(pen, batch, torch.tensor([token]))
            mark_counted([seq])
            seq.output.append(token)
        return out[0]

    first = build_logits_batch([seq])
    assert first.reset_slots.tolist() == [3] and first.reset_output.tolist() == [[3], [5]]
    assert step(6).tolist() == [0, 0, 0, 0, 0, -1, 0, 0]  # the output so far: one 5
    assert build_logits_batch([seq]).reset_slots.tolist() == []  # set up: nothing to send again
    assert step(6).tolist() == [0, 0, 0, 0, 0, -1, -1, 0]  # the 6 the device counted
    assert step(None).tolist() == [0, 0, 0, 0, 0, -1, -2, 0]
    seq.logits.counted_slot, seq.slot = None, 0  # preempted, then admitted again on slot 0
    assert build_logits_batch([seq]).reset_output.tolist() == [[0, 0, 0], [5, 6, 6]]
    assert step(None).tolist() == [0, 0, 0, 0, 0, -1, -2, 0]
    newcomer = sampler(LogitsState(LogitsSpec(frequency_penalty=1.0)), slot=3, prompt=[1])
    assert process(flat, build_logits_batch([newcomer]), None, pen)[0].tolist() == [0.0] * 8
    failed = sampler(LogitsState(LogitsSpec(presence_penalty=1.0)), slot=5, prompt=[1], output=[2])
    build_logits_batch([failed])  # the step raised before its sampling: mark_counted never ran
    assert build_logits_batch([failed]).reset_output.tolist() == [[5], [2]]


def test_a_repetition_penalty_row_marks_its_prompt_once_and_its_output_as_sampled():
    pen = counts(6)
    logits = torch.tensor([[2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    seq = sampler(LogitsState(LogitsSpec(repetition_penalty=2.0)), slot=1, prompt=[0, 0, 2])
    batch = build_logits_batch([seq])
    assert batch.reset_prompt.tolist() == [[1, 1], [0, 2]]  # distinct prompt tokens
    assert process(logits, batch, None, pen).tolist() == [[1.0, 2.0, 1.0, 2.0, 2.0, 2.0]]
    count_sampled(pen, batch, torch.tensor([4]))
    mark_counted([seq])
    assert process(logits, build_logits_batch([seq]), None, pen).tolist() == [[1.0, 2.0, 1.0, 2.0, 1.0, 2.0]]


def test_released_counts_grow_again_for_the_next_sequence():
    """Sleep drops every row; the next penalised sequence starts its row over and is counted right."""
    pen = counts(4)
    seq = sampler(LogitsState(LogitsSpec(presence_penalty=1.0)), slot=2, prompt=[1], output=[3])
    process(torch.zeros(1, 4), build_logits_batch([seq]), None, pen)
    pen.release()
    assert pen.counts.shape == (0, 4)
    after = sampler(LogitsState(LogitsSpec(presence_penalty=1.0)), slot=6, prompt=[1], output=[0])
    assert process(torch.zeros(1, 4), build_logits_batch([after]), None, pen)[0].tolist() == [-1.0, 0.0, 0.0, 0.0]
    assert pen.counts.shape[0] >= 7


def test_packed_log_probabilities_cross_the_engine_channel_and_unpack_to_the_asked_alternatives():
    """The engine sends a token's log probabilities as its table line's bytes (``PackedLogprob``);
    through pickle (the engine-core channel) ``Sampled.logprobs`` unpacks them once, with the
    request's own count of alternatives out of the step's."""
    import pickle

    from graphkeeper.worker.plan import Sampled, TokenLogprob

    line = np.array([-0.5, -0.75, -1.5, -2.5, 42, 7, 9], dtype=np.float32).tobytes()  # three computed
    sent = Sampled([42], None, None, packed=[(3, 2, line)])
    got = pickle.loads(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
    assert list(got) == [42] and got.prompt_logprobs is None
    assert got.logprobs == [TokenLogprob(42, -0.5, ((42, -0.75), (7, -1.5)))]
    assert got.logprobs is got.logprobs  # unpacked once
    assert Sampled([5], None).logprobs is None


def test_a_stream_keeps_packed_entries_and_each_front_end_reads_them_as_it_would_the_unpacked_ones():
    """What the hub hands a stream is the packed line itself (``PackedEntry``): gRPC's message
    read straight from it equals the one built from its ``TokenLogprob``, and the HTTP server's
    ``unpacked`` gives the ``TokenLogprob`` itself; entries already unpacked (and an echoed
    prompt's ``(token, None)``) pass through."""
    from graphkeeper.worker.plan import PackedEntry, Sampled, TokenLogprob, unpacked
    from graphkeeper.worker.serving.streams import token_logprobs

    line = np.array([-0.5, -0.75, -1.5, -2.5, 42, 7, 9], dtype=np.float32).tobytes()
    sent = Sampled([42, 9], None, None, packed=[(3, 2, line), (3, 0, line)])
    entries = sent.logprob_entries()
    assert entries == [PackedEntry(42, (3, 2, line)), PackedEntry(9, (3, 0, line))]
    expected = [TokenLogprob(42, -0.5, ((42, -0.75), (7, -1.5))), TokenLogprob(9, -0.5, ())]
    assert unpacked(entries) == expected == sent.logprobs
    assert token_logprobs(entries) == token_logprobs(expected)
    assert [m.top[1].token_id for m in token_logprobs(entries)[:1]] == [7]
    echoed = [(5, None), *entries]
    assert unpacked(echoed) == [(5, None), *expected]
    already = Sampled([42], expected[:1])
    assert already.logprob_entries() == expected[:1] and Sampled([1], None).logprob_entries() is None


def test_grammar_masks_are_written_into_the_buffer_the_engine_installs(monkeypatch):
    """An engine on a GPU installs pinned host memory for the masks (``use_mask_buffer``); the
    masks are written straight into it and the batch carries the installed buffer's tensor, so
    ``to_device`` copies it without staging. Rows a matcher leaves alone allow every token."""
    from types import SimpleNamespace

    import llguidance.numpy

    from graphkeeper.worker.engine import logits_state
    from graphkeeper.worker.executor.transfer import to_device

    def fill(executor, matchers, masks):  # llguidance's threads, as far as this test needs them
        for matcher, row in matchers:
            if matcher == "refuses 0-31":
                masks[row, 0] = 0

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par", fill)
    made = []

    def buffer(shape):
        tensor = torch.empty(shape, dtype=torch.int32)
        made.append(tensor)
        return tensor.numpy(), tensor

    states = [SimpleNamespace(matcher="refuses 0-31", mask_words=3), SimpleNamespace(matcher="allows", mask_words=3)]
    monkeypatch.setattr(logits_state, "_mask_buffer", logits_state._mask_buffer)  # restored after the test
    logits_state.use_mask_buffer(buffer)
    masks = logits_state.grammar_masks(states).result()
    assert masks is made[0] and masks.tolist() == [[0, -1, -1], [-1, -1, -1]]
    assert to_device(masks, torch.device("cpu")) is masks
    logits_state.use_mask_buffer(logits_state._numpy_masks)
    assert isinstance(logits_state.grammar_masks(states).result(), np.ndarray)


def test_grammar_masks_are_computed_while_the_engine_thread_goes_on(monkeypatch):
    """``grammar_masks`` returns before the masks are computed (llguidance works on its own
    threads while the engine launches the step's head, bias and penalties): here the masks wait
    for an event this thread sets only after ``grammar_masks`` returned, which a call that
    computed them itself would never see. ``finished_masks`` then waits for them."""
    import threading
    from types import SimpleNamespace

    import llguidance.numpy

    from graphkeeper.worker.engine import logits_state

    went_on = threading.Event()
    threads = []

    def fill(executor, matchers, masks):
        threads.append(threading.current_thread().name)
        assert went_on.wait(30), "the masks were computed on the caller's thread"
        masks[0, 0] = 7

    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par", fill)
    batch = build_logits_batch(states(LogitsSpec(frequency_penalty=1.0)))
    batch.masks = logits_state.grammar_masks([SimpleNamespace(matcher="m", mask_words=2)])
    went_on.set()
    assert batch.finished_masks().tolist() == [[7, -1]]
    assert batch.finished_masks() is batch.masks and threads[0].startswith("grammar-masks")


def test_masking_after_the_bias_and_penalties_gives_what_masking_first_gives():
    """The mask is applied after the bias and the penalties (so that it is computed meanwhile); a
    masked token is -inf whichever comes first, an allowed one is not touched by the mask: the
    row equals vLLM's order (mask, bias, repetition, frequency and presence), bit for bit."""
    import dataclasses

    torch.manual_seed(3)
    vocab = 64
    logits = torch.randn(2, vocab) * 4
    spec = LogitsSpec(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25,
                      logit_bias=((2, 3.0), (5, -2.0), (40, 1.5)))
    batch = build_logits_batch(states(spec, None, outputs=((5, 5, 9, 40),), prompt=(1, 2, 33)))
    words = np.array([[0xF0000226, 1 << 3 | 1 << 18]], dtype=np.int64).astype(np.int32)  # 1, 2, 5, 9, 28-31, 35, 50
    batch = dataclasses.replace(batch, mask_rows=np.array([0], np.int64), masks=words)
    out = process(logits, batch, None, counts(vocab))
    allowed = unpack_mask(torch.from_numpy(words), vocab)[0]
    expected = logits[0].masked_fill(~allowed, float("-inf"))
    for token, value in spec.logit_bias:
        expected[token] += value
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[[1, 2, 33, 5, 9, 40]] = True
    expected = torch.where(seen, torch.where(expected > 0, expected / 1.3, expected * 1.3), expected)
    count = torch.zeros(vocab)
    count[[5, 9, 40]] = torch.tensor([2.0, 1.0, 1.0])
    expected = expected - (0.5 * count + 0.25 * (count > 0))
    assert allowed[[1, 2, 5, 9]].all() and not allowed[[33, 40]].any()  # masked and allowed penalised tokens
    assert torch.equal(out[0], expected) and torch.equal(out[1], logits[1])
