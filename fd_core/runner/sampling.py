"""Batched next-token sampling: one row of logits per request in, one SampledToken per row out.

Per row, in this order (the order of Hugging Face's logits processors):

1. **Penalties** on the raw logits. Repetition penalty (HF semantics) over prompt + output
   tokens: positive logits are divided by it, negative ones multiplied. Then presence and
   frequency penalties (OpenAI semantics) over output tokens only:
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
2. **Logit bias** (OpenAI ``logit_bias``): each listed token's bias is added to its logit.
3. **min_tokens**: while fewer than ``min_tokens`` tokens were generated, the stop token ids
   and (unless ``ignore_eos``) the eos ids are masked, so the request cannot stop early.
4. **Constraint** (guided decoding, :mod:`fd_core.runner.constraints`): tokens the row's
   constraint forbids are masked (a constraint on the answer of a reasoning reply masks nothing
   while the reply reasons). A row left with no allowed token is not sampled: its
   SampledToken carries ``error`` instead, and the engine ends that request alone.
5. **Greedy** rows (``temperature`` 0, or below ``MIN_TEMPERATURE``: dividing by it would
   overflow float32) take the argmax here; filters never drop the argmax.
6. **Temperature** divides the logits, then **top-k**, **top-p** and **min-p** mask tokens
   (see :func:`apply_filters` for the exact kept sets).
7. **Sampling** by inverse CDF with one uniform draw per row, from the request's own
   ``numpy.random.Generator`` when it has a ``seed`` (so a seeded request yields the same
   tokens alone or batched) and from the sampler's shared generator otherwise.

**Logprobs** are those of the raw model distribution: ``log_softmax`` of the logits as the
model produced them, before penalties, temperature and filters. This is vLLM's default
(``logprobs_mode="raw_logprobs"``) and what OpenAI clients read as "how likely the model
found this token": the sampled token's logprob plus the top-n alternatives, best first.

The work runs in numpy on a zero-copy host view of the logits: on the CPU build Paddle's
``sort`` of [64, 49152] float32 took ~200 ms against numpy's ~10 ms, and ``topk(50)`` ~22 ms
against ``np.partition`` ~7 ms (2-core host). Logits on a device cost one device-to-host copy
(B x V x 4 bytes); the all-greedy fast path stays on the device and copies back B token ids.
Top-k and top-p need only the best few tokens sorted, so rows are partially sorted: width
max(top_k), or for top-p alone 1024 then 8192 candidates, falling back to a full sort only when
those hold less than ``top_p`` of the mass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np

from fd_core.outputs import SampledToken

if TYPE_CHECKING:
    import paddle

    from fd_core.request import Request, SamplingParams
    from fd_core.runner.constraints import Constraints

_NEG_INF: Final = np.float32(-np.inf)


def _top_k_of(params: SamplingParams, vocab_size: int) -> int:
    """The effective top-k of a row; 0 means off (``top_k`` of 0, -1 or >= vocab)."""
    k = params.top_k
    return k if 0 < k < vocab_size else 0


#: Candidate widths tried, in turn, for top-p rows without top-k: most LLM distributions put
#: ``top_p`` of their mass in the first, and a full argsort of 49152 logits costs ~5 ms a row.
_TOP_P_WIDTHS: Final = (1024, 8192)


@dataclass(slots=True)
class _Candidates:
    """Best tokens of one batch row that has top-k or top-p, sorted by logit, best first."""

    row: int            # batch row
    ids: np.ndarray     # int [W]: token ids, best first
    vals: np.ndarray    # float32 [W]: their logits (the kept set is a prefix of them)


def _top_sorted(rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids and values of the ``width`` largest entries of each row, best first."""
    vocab_size = rows.shape[-1]
    if width < vocab_size:
        ids = np.argpartition(rows, vocab_size - width, axis=-1)[:, vocab_size - width:]
        order = np.argsort(-np.take_along_axis(rows, ids, axis=-1), axis=-1, kind="stable")
        ids = np.take_along_axis(ids, order, axis=-1)
    else:
        ids = np.argsort(-rows, axis=-1, kind="stable")
    return ids, np.take_along_axis(rows, ids, axis=-1)


def _top_p_keep(vals: np.ndarray, size: np.ndarray, top_p: np.ndarray,
                norm: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Length of the top-p prefix of sorted ``vals`` [R, W], and whether W covered it.

    Only the first ``size`` [R] entries of a row belong to its set; ``norm`` [R] is the set's
    total of ``exp(logit - max)`` when the set reaches beyond W (default: the sum over size).
    Sums run in float64: near the boundary consecutive masses differ by ~1/V, which a float32
    running sum over the vocabulary cannot resolve.
    """
    v = vals.astype(np.float64)
    in_set = np.arange(v.shape[-1])[None, :] < size[:, None]
    probs = np.where(in_set, np.exp(v - v[:, :1]), 0.0)
    probs /= (probs.sum(axis=-1) if norm is None else norm)[:, None]
    mass = np.cumsum(probs, axis=-1)
    # The kept prefix: positions whose preceding mass is still short of top_p
    # (>= 1 since the first position's preceding mass is 0).
    n_keep = ((mass - probs < top_p[:, None]) & in_set).sum(axis=-1)
    return n_keep, mass[:, -1] >= top_p


def _filter(logits: np.ndarray,
            params: list[SamplingParams]) -> tuple[np.ndarray, list[_Candidates]]:
    """Per-row keep thresholds (see :func:`filter_thresholds`) and the sorted candidates."""
    batch, vocab_size = logits.shape
    thresholds = np.full(batch, _NEG_INF, dtype=np.float32)
    top_ks = np.array([_top_k_of(p, vocab_size) for p in params], dtype=np.int64)
    top_ps = np.array([p.top_p for p in params], dtype=np.float64)
    min_ps = np.array([p.min_p for p in params], dtype=np.float64)
    cands: list[_Candidates] = []

    k_rows = np.flatnonzero(top_ks > 0)
    if k_rows.size:
        # Top-p runs inside the top-k set, so a partial sort of width max(k) is enough.
        ks = top_ks[k_rows]
        ids, vals = _top_sorted(logits[k_rows], int(ks.max()))
        row_thr = vals[np.arange(k_rows.size), ks - 1]
        p_local = np.flatnonzero(top_ps[k_rows] < 1.0)
        if p_local.size:
            n_keep, _ = _top_p_keep(vals[p_local], ks[p_local], top_ps[k_rows[p_local]])
            row_thr[p_local] = np.maximum(row_thr[p_local], vals[p_local, n_keep - 1])
        thresholds[k_rows] = row_thr
        cands += [_Candidates(int(r), ids[j], vals[j]) for j, r in enumerate(k_rows)]

    p_rows = np.flatnonzero((top_ks == 0) & (top_ps < 1.0))
    if p_rows.size:
        sub = logits[p_rows]
        peak = sub.max(axis=-1, keepdims=True)
        norm = np.exp(sub - peak).sum(axis=-1, dtype=np.float64)
        # Widen the candidate set until it holds top_p of the mass (the last width is V).
        todo = np.arange(p_rows.size)
        for width in (*(w for w in _TOP_P_WIDTHS if w < vocab_size), vocab_size):
            ids, vals = _top_sorted(sub[todo], width)
            size = np.full(todo.size, width)
            n_keep, covered = _top_p_keep(vals, size, top_ps[p_rows[todo]], norm[todo])
            done = covered | (width == vocab_size)
            for j in np.flatnonzero(done):
                row = int(p_rows[todo[j]])
                thresholds[row] = vals[j, n_keep[j] - 1]
                cands.append(_Candidates(row, ids[j], vals[j]))
            todo = todo[~done]
            if not todo.size:
                break

    min_p_rows = np.flatnonzero(min_ps > 0.0)
    if min_p_rows.size:
        m_thr = logits[min_p_rows].max(axis=-1) + np.log(min_ps[min_p_rows]).astype(np.float32)
        thresholds[min_p_rows] = np.maximum(thresholds[min_p_rows], m_thr)
    return thresholds, cands


def filter_thresholds(logits: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """Per-row logit threshold (float32 [B]): a token is kept iff its logit >= the threshold.

    ``logits`` are already temperature-scaled. The kept set is the intersection of:
    - top-k: logits >= the k-th largest logit (ties at the boundary are kept);
    - top-p: logits >= the logit of the last token of the shortest prefix of the
      probability-sorted top-k set whose mass (renormalised over that set) reaches ``top_p``;
    - min-p: ``logit >= max_logit + log(min_p)``, i.e. ``p >= min_p * p_max``.
    Rows with no filter get ``-inf``.
    """
    return _filter(logits, params)[0]


def apply_filters(logits: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """Return a copy of temperature-scaled ``logits`` [B, V] with filtered tokens at ``-inf``.

    Kept sets are defined by :func:`filter_thresholds`; the argmax is always kept.
    """
    thresholds = filter_thresholds(logits, params)
    return np.where(logits >= thresholds[:, None], logits, _NEG_INF)


def apply_penalties(logits: np.ndarray, requests: list[Request]) -> None:
    """Apply repetition, presence and frequency penalties to ``logits`` [B, V] in place."""
    for row, request in enumerate(requests):
        sp = request.sampling_params
        if not _has_penalty(sp):
            continue
        out_ids, out_counts = np.unique(np.asarray(request.output_token_ids, dtype=np.int64),
                                        return_counts=True)
        if sp.repetition_penalty != 1.0:
            seen = np.union1d(np.asarray(request.prompt_token_ids, dtype=np.int64), out_ids)
            vals = logits[row, seen]
            logits[row, seen] = np.where(vals > 0, vals / sp.repetition_penalty,
                                         vals * sp.repetition_penalty)
        if out_ids.size and (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0):
            logits[row, out_ids] -= (sp.frequency_penalty * out_counts
                                     + sp.presence_penalty).astype(np.float32)


def _has_penalty(sp: SamplingParams) -> bool:
    return (sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0
            or sp.frequency_penalty != 0.0)


def apply_logit_bias(logits: np.ndarray, params: list[SamplingParams]) -> None:
    """Add each row's ``logit_bias`` to ``logits`` [B, V] in place."""
    for row, sp in enumerate(params):
        if sp.logit_bias:
            ids = np.fromiter(sp.logit_bias.keys(), dtype=np.int64, count=len(sp.logit_bias))
            logits[row, ids] += np.fromiter(sp.logit_bias.values(), dtype=np.float32, count=len(sp.logit_bias))


def _blocked_stop_ids(request: Request) -> list[int]:
    """Token ids masked because ``min_tokens`` is not reached yet (empty when it is)."""
    sp = request.sampling_params
    if len(request.output_token_ids) >= sp.min_tokens:
        return []
    eos = [] if sp.ignore_eos else list(request.eos_token_ids)
    return eos + list(sp.stop_token_ids)


def _greedy_ids(logits: paddle.Tensor, blocked: list[list[int]]) -> np.ndarray:
    """Argmax of each row of ``logits`` [B, V] over the ids not in ``blocked[row]``.

    Only B ids cross to the host: on the CPU numpy's argmax over the logits' own memory (zero-copy)
    is ~6x Paddle's ([64, 49152]: 0.6 ms against 3.9). A row whose best id is not blocked keeps
    it (the ids before the first maximum are all smaller, masked or not); only a row whose best id
    is blocked is masked and searched again, so a step of rows below their min_tokens does not
    copy and mask all its logits ([256, 49152] on the AMX Xeon: 29.0 -> 2.2 ms). ``logits`` are
    float32.
    """
    import paddle

    host = np.from_dlpack(logits) if logits.place.is_cpu_place() else None
    ids = host.argmax(axis=-1) if host is not None else paddle.argmax(logits, axis=-1).numpy()
    for row, stop_ids in enumerate(blocked):
        if stop_ids and ids[row] in stop_ids:
            x = (host[row] if host is not None else logits[row].numpy()).copy()
            x[stop_ids] = _NEG_INF
            ids[row] = x.argmax()
    return ids


class Sampler:
    """Samples one token per request from a batch of logits; holds per-request generators.

    Call :meth:`forget` when a request finishes or is aborted, so its generator (and its
    constraint's matcher) is dropped. ``constraints`` applies guided decoding; without it a
    request carrying a constraint is sampled unconstrained (the engine refuses such requests first).
    """

    def __init__(self, *, seed: int | None = None, constraints: Constraints | None = None) -> None:
        self.constraints = constraints
        #: Shared generator for requests without a seed.
        self._rng = np.random.default_rng(seed)
        #: request id -> generator of a seeded request, created on its first sampled token.
        self._request_rngs: dict[str, np.random.Generator] = {}

    def forget(self, request_id: str) -> None:
        """Drop the state kept for ``request_id`` (no-op if there is none)."""
        self._request_rngs.pop(request_id, None)
        if self.constraints is not None:
            self.constraints.forget(request_id)

    def sample(self, logits: paddle.Tensor, requests: list[Request]) -> list[SampledToken]:
        """Pick the next token for each request; row ``i`` of ``logits`` [B, V] is ``requests[i]``."""
        import paddle

        assert logits.shape[0] == len(requests), (logits.shape, len(requests))
        blocked = [_blocked_stop_ids(r) for r in requests]
        params = [r.sampling_params for r in requests]
        if logits.dtype != paddle.float32:     # numpy has no bfloat16
            logits = logits.astype("float32")
        if all(sp.greedy and sp.logprobs is None and not sp.shapes_logits for sp in params):
            return [SampledToken(int(t)) for t in _greedy_ids(logits, blocked)]

        raw = np.from_dlpack(logits.cpu())     # zero-copy on CPU; read only
        x = raw.copy()
        if any(_has_penalty(sp) for sp in params):
            apply_penalties(x, requests)
        apply_logit_bias(x, params)
        for row, ids in enumerate(blocked):
            if ids:
                x[row, ids] = _NEG_INF
        failed = self.constraints.mask(x, requests) if self.constraints is not None else {}
        for row in failed:
            x[row, 0] = 0.0   # a finite logit, so the row samples something; its result is discarded

        tokens = np.empty(len(requests), dtype=np.int64)
        greedy = np.array([sp.greedy for sp in params])
        if greedy.any():
            tokens[greedy] = x[greedy].argmax(axis=-1)
        sampled_rows = np.flatnonzero(~greedy)
        if sampled_rows.size:
            tokens[sampled_rows] = self._sample_rows(x[sampled_rows],
                                                     [requests[i] for i in sampled_rows])
        out = self._with_logprobs(raw, tokens, params)
        for row, reason in failed.items():
            out[row] = SampledToken(-1, error=reason)
        return out

    def verify(self, raw: np.ndarray, request: Request, proposed: list[int]) -> list[SampledToken]:
        """The accepted prefix of ``proposed`` then the model's next token, from ``raw`` float32
        [len(proposed) + 1, V] (:func:`fd_core.runner.speculative.verify`; the request is speculable).
        Under a constraint each position is masked as after the proposals before it, and only the
        proposals the constraint allows are verified; a row it leaves no token gives one SampledToken
        with ``error``."""
        from fd_core.runner.speculative import verify

        forbidden = None
        if request.sampling_params.guided is not None:
            assert self.constraints is not None, "the engine refuses constrained requests without guided decoding"
            forbidden, error = self.constraints.forbidden_in_run(request, proposed)
            if error is not None:
                return [SampledToken(-1, error=error)]
            proposed, raw = proposed[:len(forbidden) - 1], raw[:len(forbidden)]
        return verify(raw, proposed, request.sampling_params, self._rng, forbidden=forbidden)

    def _sample_rows(self, x: np.ndarray, requests: list[Request]) -> np.ndarray:
        """Temperature, filters and one inverse-CDF draw per row of ``x`` (modified in place).

        Rows with top-k or top-p draw from their kept prefix of the sorted candidates; the
        others (temperature and min-p only) from the whole vocabulary in token order. Which
        way a row goes depends on its own parameters only, so batching never changes it.
        """
        params = [r.sampling_params for r in requests]
        draws = np.array([self._generator(r).random() for r in requests])
        x /= np.array([sp.temperature for sp in params], dtype=np.float32)[:, None]
        thresholds, cands = _filter(x, params)
        tokens = np.empty(len(requests), dtype=np.int64)
        for cand in cands:
            kept = cand.vals[:np.count_nonzero(cand.vals >= thresholds[cand.row])]
            cdf = np.cumsum(np.exp(kept.astype(np.float64) - kept[0]))
            pos = np.searchsorted(cdf, draws[cand.row] * cdf[-1], side="right")
            tokens[cand.row] = cand.ids[min(pos, kept.size - 1)]

        rest = np.setdiff1d(np.arange(len(requests)), [c.row for c in cands])
        if rest.size:
            sub = x[rest]
            keep = sub >= thresholds[rest, None]
            sub -= sub.max(axis=-1, keepdims=True)     # the max is always kept, so mass > 0
            probs = np.exp(sub, out=sub)
            probs[~keep] = 0.0
            cdf = np.cumsum(probs, axis=-1)
            targets = (draws[rest] * cdf[:, -1]).astype(np.float32)
            # First position whose cdf exceeds the target: it always has probability > 0.
            picked = (cdf <= targets[:, None]).sum(axis=-1)
            # Rounding can put the target at the total; fall back to the last kept token.
            for j in np.flatnonzero(picked >= cdf.shape[-1]):
                picked[j] = np.flatnonzero(keep[j])[-1]
            tokens[rest] = picked
        return tokens

    def _generator(self, request: Request) -> np.random.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self._rng
        rng = self._request_rngs.get(request.request_id)
        if rng is None:
            rng = self._request_rngs[request.request_id] = np.random.default_rng(seed)
        return rng

    @staticmethod
    def _with_logprobs(raw: np.ndarray, tokens: np.ndarray,
                       params: list[SamplingParams]) -> list[SampledToken]:
        """Wrap ``tokens`` in SampledTokens, adding raw-distribution logprobs where asked."""
        out = [SampledToken(int(t)) for t in tokens]
        rows = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        if rows:
            with_logprobs = token_logprobs(raw[rows], tokens[rows], [params[i].logprobs or 0 for i in rows])
            for i, token in zip(rows, with_logprobs, strict=True):
                out[i] = token
        return out


def token_logprobs(raw: np.ndarray, tokens: np.ndarray, top_n: list[int]) -> list[SampledToken]:
    """``tokens[i]`` with its logprob under row ``i`` of the raw logits ``raw`` [R, V] (``log_softmax``
    of the logits as the model produced them) and that row's ``top_n[i]`` best tokens, best first.

    The sampler's logprobs and the runner's prompt logprobs (``SamplingParams.prompt_logprobs``) both
    come from here.
    """
    m = raw.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(raw - m).sum(axis=-1, keepdims=True)))[:, 0]
    chosen = raw[np.arange(len(tokens)), tokens] - lse
    out = [SampledToken(int(t), float(lp), []) for t, lp in zip(tokens, chosen, strict=True)]
    n_max = max(top_n, default=0)
    if n_max:
        vocab_size = raw.shape[-1]
        top_ids = np.argpartition(raw, vocab_size - n_max, axis=-1)[:, vocab_size - n_max:]
        top_vals = np.take_along_axis(raw, top_ids, axis=-1)
        order = np.argsort(-top_vals, axis=-1, kind="stable")
        top_ids = np.take_along_axis(top_ids, order, axis=-1)
        top_lp = np.take_along_axis(top_vals, order, axis=-1) - lse[:, None]
        for token, ids, lps, n in zip(out, top_ids, top_lp, top_n, strict=True):
            token.top_logprobs = [(int(t), float(v)) for t, v in zip(ids[:n], lps[:n], strict=True)]
    return out
