"""Tests for fd_core.runner.sampling against straightforward numpy references."""

from __future__ import annotations

import itertools

import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fd_core.request import Request, SamplingParams
from fd_core.runner.sampling import Sampler, apply_filters, apply_penalties


def _request(rid: str = "r", *, prompt: list[int] | None = None, output: list[int] | None = None,
             eos: tuple[int, ...] = (), **params: object) -> Request:
    return Request(rid, prompt if prompt is not None else [1, 2, 3],
                   SamplingParams(**params), eos_token_ids=eos,
                   output_token_ids=list(output or []))


def _reference_keep(row: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """Kept-token mask for one temperature-scaled row, the slow obvious way."""
    x = row.astype(np.float64)
    keep = np.ones(x.size, dtype=bool)
    if 0 < sp.top_k < x.size:
        keep &= x >= np.sort(x)[::-1][sp.top_k - 1]
    if sp.top_p < 1.0:
        order = [t for t in np.argsort(-x, kind="stable") if keep[t]]
        probs = np.exp(x[order] - x[order[0]])
        probs /= probs.sum()
        n = int(np.searchsorted(np.cumsum(probs), sp.top_p)) + 1   # first prefix reaching p
        top_p_set = np.zeros_like(keep)
        top_p_set[order[:n]] = True
        keep &= top_p_set
    if sp.min_p > 0.0:
        probs = np.exp(x - x.max())
        keep &= probs >= sp.min_p * probs.max()
    return keep


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


FILTER_CASES = [SamplingParams(top_k=k, top_p=p, min_p=m) for k, p, m in itertools.product(
    (0, 1, 7, 60), (1.0, 0.3, 0.9, 0.99), (0.0, 0.02, 0.3))]


@pytest.mark.parametrize("vocab", [500, 20_000])
def test_filters_keep_exactly_the_reference_sets(vocab: int) -> None:
    # One batch mixes every combination, so rows with different widths share the work.
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((len(FILTER_CASES), vocab)) * 2.5).astype(np.float32)
    kept = np.isfinite(apply_filters(logits, FILTER_CASES))
    for row, sp in enumerate(FILTER_CASES):
        np.testing.assert_array_equal(kept[row], _reference_keep(logits[row], sp), err_msg=str(sp))


def test_top_p_widens_past_the_first_candidate_width() -> None:
    # Flat logits: top_p = 0.95 of 49152 near-uniform tokens needs ~46k candidates.
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((2, 49152)) * 0.1).astype(np.float32)
    params = [SamplingParams(top_p=0.95), SamplingParams(top_p=0.01)]
    kept = np.isfinite(apply_filters(logits, params))
    for row, sp in enumerate(params):
        np.testing.assert_array_equal(kept[row], _reference_keep(logits[row], sp))


@pytest.mark.parametrize("sp", [SamplingParams(top_k=5), SamplingParams(top_p=0.5),
                                SamplingParams(min_p=0.2, temperature=0.7),
                                SamplingParams(top_k=20, top_p=0.8, min_p=0.05, temperature=1.3)])
def test_samples_stay_inside_the_kept_set(sp: SamplingParams) -> None:
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((1, 300)) * 2).astype(np.float32)
    allowed = set(np.flatnonzero(_reference_keep(logits[0] / sp.temperature, sp)))
    sampler = Sampler(seed=0)
    req = Request("r", [0], sp)
    seen = {sampler.sample(paddle.to_tensor(logits), [req])[0].token_id for _ in range(400)}
    assert seen <= allowed
    assert len(seen) > 1 or len(allowed) == 1


def test_temperature_sampling_follows_softmax() -> None:
    logits = np.array([[2.0, 1.0, 0.0, -1.0, -30.0]], dtype=np.float32)
    sampler = Sampler(seed=3)
    reqs = [_request(str(i), temperature=1.0) for i in range(64)]
    batch = paddle.to_tensor(np.repeat(logits, 64, axis=0))
    counts = np.zeros(5)
    for _ in range(100):
        for tok in sampler.sample(batch, reqs):
            counts[tok.token_id] += 1
    expected = np.exp(_log_softmax(logits[0]))
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.015)
    assert counts[4] == 0


def test_penalties_match_the_definitions() -> None:
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((3, 50)) * 3).astype(np.float32)
    reqs = [
        _request("a", prompt=[1, 2, 3, 3], output=[3, 4, 4, 4, 9], repetition_penalty=1.3,
                 presence_penalty=0.5, frequency_penalty=0.25),
        _request("b", prompt=[7], output=[], repetition_penalty=0.8),
        _request("c", prompt=[5, 6], output=[6, 6, 8], presence_penalty=-1.0),
    ]
    expected = logits.astype(np.float64)
    for row, req in enumerate(reqs):
        sp = req.sampling_params
        for tok in set(req.prompt_token_ids) | set(req.output_token_ids):
            v = expected[row, tok]
            expected[row, tok] = v / sp.repetition_penalty if v > 0 else v * sp.repetition_penalty
        for tok in set(req.output_token_ids):
            count = req.output_token_ids.count(tok)
            expected[row, tok] -= sp.frequency_penalty * count + sp.presence_penalty
    got = logits.copy()
    apply_penalties(got, reqs)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_greedy_is_argmax_on_fast_and_mixed_paths() -> None:
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 1000)).astype(np.float32)
    sampler = Sampler()
    greedy = [_request(str(i), temperature=0.0) for i in range(6)]
    fast = [t.token_id for t in sampler.sample(paddle.to_tensor(logits), greedy)]
    assert fast == list(logits.argmax(axis=-1))
    mixed = greedy[:3] + [_request(str(i), temperature=0.9, top_k=3) for i in range(3, 6)]
    got = [t.token_id for t in sampler.sample(paddle.to_tensor(logits), mixed)]
    assert got[:3] == list(logits[:3].argmax(axis=-1))


def test_greedy_argmax_sees_penalties() -> None:
    logits = np.array([[5.0, 4.9, 0.0]], dtype=np.float32)
    req = _request(prompt=[0], temperature=0.0, repetition_penalty=2.0)
    assert Sampler().sample(paddle.to_tensor(logits), [req])[0].token_id == 1


def _run(sampler: Sampler, rows: np.ndarray, reqs: list[Request], steps: int) -> list[list[int]]:
    for step in range(steps):
        for req, tok in zip(reqs, sampler.sample(paddle.to_tensor(rows[step]), reqs), strict=True):
            req.output_token_ids.append(tok.token_id)
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(top_k=40, top_p=0.9),
                                    dict(top_p=0.8, min_p=0.01, frequency_penalty=0.5)])
def test_seeded_request_is_reproducible_alone_or_batched(params: dict[str, object]) -> None:
    steps, vocab = 8, 2000
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((steps, 5, vocab)) * 2).astype(np.float32)
    alone = _run(Sampler(seed=1), logits[:, 2:3], [_request("s", seed=1234, **params)], steps)
    batch = [_request(f"o{i}", **params) for i in range(5)]
    batch[2] = _request("s", seed=1234, **params)
    batched = _run(Sampler(seed=99), logits, batch, steps)
    assert batched[2] == alone[0]
    assert len(set(alone[0])) > 1


def test_forget_restarts_a_seeded_sequence() -> None:
    logits = paddle.to_tensor(np.zeros((1, 1000), dtype=np.float32))
    sampler = Sampler()
    req = _request("s", seed=7)
    first = [sampler.sample(logits, [req])[0].token_id for _ in range(5)]
    sampler.forget("s")
    assert [sampler.sample(logits, [req])[0].token_id for _ in range(5)] == first


def test_logprobs_are_raw_log_softmax() -> None:
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((3, 400)) * 3).astype(np.float32)
    reqs = [_request("g", temperature=0.0, logprobs=5),
            _request("t", temperature=0.5, top_k=10, logprobs=3, repetition_penalty=1.5),
            _request("z", temperature=1.0, logprobs=0)]
    out = Sampler(seed=0).sample(paddle.to_tensor(logits), reqs)
    for row, (tok, req) in enumerate(zip(out, reqs, strict=True)):
        ref = _log_softmax(logits[row])
        assert tok.logprob == pytest.approx(ref[tok.token_id], abs=1e-5)
        n = req.sampling_params.logprobs
        assert tok.top_logprobs is not None and len(tok.top_logprobs) == n
        ids = [t for t, _ in tok.top_logprobs]
        assert ids == list(np.argsort(-ref)[:n])
        for t, lp in tok.top_logprobs:
            assert lp == pytest.approx(ref[t], abs=1e-5)
    assert out[0].top_logprobs[0] == (out[0].token_id, pytest.approx(_log_softmax(logits[0]).max(),
                                                                      abs=1e-5))


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = paddle.to_tensor(np.array([[9.0, 8.0, 1.0, 0.0]], dtype=np.float32))
    req = _request(eos=(0,), temperature=0.0, min_tokens=2, stop_token_ids=[1])
    sampler = Sampler()
    assert sampler.sample(logits, [req])[0].token_id == 2
    req.output_token_ids = [2, 2]
    assert sampler.sample(logits, [req])[0].token_id == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_rows_below_min_tokens_skip_only_their_blocked_ids(dtype: str) -> None:
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((8, 300)).astype(np.float32)
    logits[0, 5] = 50.0                        # best is the eos: the best allowed id wins
    logits[1, [7, 9]] = 50.0                   # a tie: the blocked stop id first, an allowed one after
    logits[2, 3] = 50.0                        # best is allowed
    logits[3, 5] = 50.0                        # min_tokens reached: the eos may win
    requests = [_request(str(i), eos=(5,), stop_token_ids=[7], temperature=0.0, min_tokens=3) for i in range(8)]
    requests[3].output_token_ids = [1, 1, 1]
    tensor = paddle.to_tensor(logits).astype(dtype)
    seen = tensor.astype("float32").numpy()
    expected = []
    for row in range(len(requests)):
        x = seen[row].copy()
        if row != 3:
            x[[5, 7]] = -np.inf
        expected.append(int(x.argmax()))
    got = [t.token_id for t in Sampler().sample(tensor, requests)]
    assert got == expected
    assert got[:4] == [expected[0], 9, 3, 5] and expected[0] not in (5, 7)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 64), top_k=st.integers(-1, 70),
       top_p=st.floats(0.01, 1.0), min_p=st.floats(0.0, 1.0),
       temperature=st.floats(0.05, 3.0), seed=st.integers(0, 2**32 - 1))
def test_sampled_token_is_always_kept(data: st.DataObject, vocab: int, top_k: int, top_p: float,
                                      min_p: float, temperature: float, seed: int) -> None:
    # Hypothesis finds ties and all-equal rows; the argmax must survive and be sampleable.
    row = data.draw(st.lists(st.floats(-20, 20, width=32), min_size=vocab, max_size=vocab))
    logits = np.array([row], dtype=np.float32)
    sp = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature,
                        seed=seed)
    kept = np.isfinite(apply_filters(logits / np.float32(temperature), [sp]))[0]
    assert kept[int(np.argmax(logits[0]))]
    tok = Sampler().sample(paddle.to_tensor(logits), [Request("h", [0], sp)])[0].token_id
    assert kept[tok]


def test_bfloat16_logits_are_accepted() -> None:
    logits = paddle.to_tensor(np.array([[0.0, 3.0, 1.0]], dtype=np.float32)).astype("bfloat16")
    out = Sampler().sample(logits, [_request(temperature=0.0, logprobs=1)])
    assert out[0].token_id == 1 and out[0].top_logprobs[0][0] == 1
