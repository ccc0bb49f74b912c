"""Speculative decoding in the engine: greedy outputs equal those without it, token for token, for
every proposer and batch size, through preemption, stop strings and ``max_tokens`` inside an
accepted run; sampled outputs keep their distribution; every KV block is free after a drain.

Besides the built-in ``ngram`` proposer, an ``oracle`` proposer (a real installed plugin, the
``install_plugin`` fixture) proposes the reference continuation with every third token wrong, so
that runs are accepted, cut and rejected at known places.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections import Counter

import numpy as np
import pytest

from fd_core.config import load_config
from fd_core.engine.builder import build_engine
from fd_core.engine.llm import LLM
from fd_core.request import FinishReason, GuidedDecoding, Request, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
#: The chi-square statistic's value that a true fit exceeds with probability 0.001, by degrees of freedom.
CHI_SQUARE_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
                             9: 27.88, 10: 29.59, 11: 31.26, 12: 32.91}

ORACLE = """
from fd_core.contracts.proposer import Proposer


class Oracle(Proposer):
    \"\"\"Proposes ``answers[prompt]`` from the request's next output on, every third token wrong.\"\"\"

    name = "oracle"
    fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION
    answers = {}
    calls = 0

    def propose(self, requests, budgets):
        type(self).calls += 1
        out = []
        for request, budget in zip(requests, budgets):
            done = len(request.output_token_ids)
            guess = list(self.answers.get(tuple(request.prompt_token_ids), ())[done:done + budget])
            out.append([(t + 1) % self.vocab_size if (done + j) % 3 == 2 else t for j, t in enumerate(guess)])
        return out


@fd_core.hookimpl
def fd_register_proposers():
    return [Oracle]
"""

FIXED_GUESS = """
from fd_core.contracts.proposer import Proposer


class Fixed(Proposer):
    \"\"\"Guesses tokens 5 and 6, whatever the request.\"\"\"

    name = "fixed"
    fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION

    def propose(self, requests, budgets):
        return [[5, 6][:budget] for budget in budgets]


@fd_core.hookimpl
def fd_register_proposers():
    return [Fixed]
"""

#: A constraint that lasts a few steps (8 to 12 digits).
REGEX = GuidedDecoding("regex", "[0-9]{8,12}")

BREAKS_LATER = """
from fd_plugins.guided_decoding.xgrammar_backend import XGrammarBackend, XGrammarMatcher


class _Breaking(XGrammarMatcher):
    fills = 0

    def fill_mask(self, bitmask, row):
        self.fills += 1
        if self.fills == 3:
            raise RuntimeError("failed on its third mask")
        super().fill_mask(bitmask, row)


class BreaksLater(XGrammarBackend):
    name = "breaks-later"

    def matcher(self, compiled, stop_token_ids):
        return _Breaking(super().matcher(compiled, stop_token_ids)._matcher)


@fd_core.hookimpl
def fd_register_guided_decoding():
    return [BreaksLater]
"""

BROKEN = """
from fd_core.contracts.proposer import Proposer


class Broken(Proposer):
    name = "broken"
    fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION

    def propose(self, requests, budgets):
        raise RuntimeError("proposer bug")


@fd_core.hookimpl
def fd_register_proposers():
    return [Broken]
"""


def _prompts(n: int, *, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, int(rng.integers(5, 60))).tolist() for _ in range(n)]


def _llm(model: str, *, proposer: str | None, hooks: list[str] = (), num_blocks: int = 256, k: int = 4,
         per_step: int = 1024, **sections) -> LLM:
    speculation = ({"name": proposer, "num_speculative_tokens": k, "max_proposed_tokens_per_step": per_step}
                   if proposer else {"name": "none"})
    return LLM(model={"source": model}, cache={"num_blocks": num_blocks, "enable_prefix_caching": False},
               proposer=speculation, plugins={"hooks": list(hooks)}, **sections)


def _all_free(llm: LLM) -> bool:
    stats = llm.engine.resource_manager.stats()
    return stats.num_free_blocks == stats.num_blocks and stats.num_running == 0 and stats.num_waiting == 0


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Greedy outputs without speculation, by prompt (the baseline)."""
    llm = _llm(tiny_model_dir, proposer=None)
    cache: dict[tuple[int, ...], list[int]] = {}

    def of(prompts, params=GREEDY):
        todo = [p for p in prompts if (tuple(p), params.max_tokens) not in cache]
        for p, result in zip(todo, llm.generate(todo, params) if todo else [], strict=True):
            cache[tuple(p), params.max_tokens] = result.token_ids
        return [cache[tuple(p), params.max_tokens] for p in prompts]

    yield of
    llm.close()


@pytest.fixture(scope="module")
def default_model_llm_factory():
    """LLMs over the default model, one per proposer name (None: no speculation), closed after the module."""
    built: dict[str | None, LLM] = {}

    def of(proposer: str | None) -> LLM:
        if proposer not in built:
            options = {"options": {"model": "smollm2-135m-instruct", "num_blocks": 16}} if proposer == "draft" else {}
            built[proposer] = LLM(cache={"num_blocks": 64, "enable_prefix_caching": False},
                                  proposer={"name": proposer or "none", **options})
        return built[proposer]

    yield of
    for llm in built.values():
        llm.close()


def test_draft_on_the_default_model_as_its_own_draft_is_nearly_always_accepted(default_model_llm_factory):
    """The default model drafting for itself (its own kernels, its own paged KV): each guess is the
    model's own greedy choice (one token at a time, where the target scores five at once: a near tie
    may part them), so nearly all are accepted, and the reply is the one without speculation."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = {"role": "user", "content": "Write one sentence about the sea."}
    expected = default_model_llm_factory(None).chat([[prompt]], params)[0]
    llm = default_model_llm_factory("draft")
    got = llm.chat([[prompt]], params)[0]
    stats = llm.engine.stats()
    assert got.token_ids == expected.token_ids
    assert stats.num_accepted_tokens >= 0.9 * stats.num_proposed_tokens > 0
    assert stats.num_steps < 24 / 2


def _oracle(install_plugin, name: str, answers: dict) -> type:
    install_plugin(name, ORACLE)
    oracle = importlib.import_module(name).Oracle
    oracle.answers = answers
    return oracle


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_ngram_greedy_equals_no_speculation(tiny_model_dir, reference, batch):
    prompts = _prompts(batch, seed=batch)
    with _llm(tiny_model_dir, proposer="ngram", k=3) as llm:
        results = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
        assert _all_free(llm)
    assert [r.token_ids for r in results] == reference(prompts)
    assert stats.num_generated_tokens == batch * GREEDY.max_tokens
    if batch == 64:   # the random model's outputs repeat bigrams of their prompts here and there
        assert stats.num_proposed_tokens > 0


def test_ngram_on_the_default_model_copies_a_given_text_in_fewer_steps(default_model_llm_factory):
    """The default model asked to repeat a text: prompt lookup proposes it, most proposals are
    accepted, and the reply is the one without speculation."""
    text = ("The river town woke slowly. Fishermen carried their nets down the stone steps, and the baker "
            "opened the shutters of the corner shop.")
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain, spec = default_model_llm_factory(None), default_model_llm_factory("ngram")
    prompt = {"role": "user", "content": f"Repeat the following text exactly:\n\n{text}"}
    expected = plain.chat([[prompt]], params)[0]
    got = spec.chat([[prompt]], params)[0]
    stats = spec.engine.stats()
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert stats.num_accepted_tokens > stats.num_proposed_tokens / 2
    assert stats.num_steps < plain.engine.stats().num_steps


@pytest.mark.parametrize("manager", ["v0", "v1"])
def test_oracle_runs_are_accepted_cut_and_rejected_exactly(install_plugin, tiny_model_dir, reference, manager):
    prompts = _prompts(12, seed=3)
    answers = dict(zip(map(tuple, prompts), reference(prompts), strict=True))
    oracle = _oracle(install_plugin, f"oracle_{manager}", answers)
    with _llm(tiny_model_dir, proposer="oracle", hooks=[f"oracle_{manager}"],
              resource_manager={"name": manager}) as llm:
        results = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
        assert _all_free(llm)
    assert [r.token_ids for r in results] == reference(prompts)
    assert oracle.calls > 0
    # every third proposed token is wrong: runs of two are accepted, so a step yields up to three tokens
    assert 0 < stats.num_accepted_tokens < stats.num_proposed_tokens
    assert stats.num_steps < 24 / 2


@pytest.mark.parametrize("per_step, batch, share", [(16, 2, 4), (16, 8, 2), (16, 17, 0), (64, 17, 3)])
def test_a_step_proposes_at_most_max_proposed_tokens_per_step_shared_equally(
        install_plugin, tiny_model_dir, reference, per_step, batch, share):
    prompts = _prompts(batch, seed=8)
    oracle = _oracle(install_plugin, f"oracle_share_{per_step}_{batch}", dict(zip(map(tuple, prompts),
                                                                                  reference(prompts), strict=True)))
    seen: list[list[int]] = []
    plain_propose = oracle.propose

    def propose(self, requests, budgets):
        seen.append(list(budgets))
        return plain_propose(self, requests, budgets)

    oracle.propose = propose
    with _llm(tiny_model_dir, proposer="oracle", hooks=[f"oracle_share_{per_step}_{batch}"], per_step=per_step,
              engine={"max_num_seqs": 32}) as llm:
        results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == reference(prompts)
    full = [b for b in seen if len(b) == batch]   # steps where every request decoded
    if share:
        assert full and all(set(b) <= set(range(1, share + 1)) and max(b) == share for b in full[:1])
        assert sum(map(sum, seen)) > 0
    else:
        assert not full, "no proposals while every request decodes"


def test_preemption_in_the_middle_keeps_the_output(install_plugin, tiny_model_dir, reference):
    """A pool too small for every request at once: requests are preempted with proposals planned,
    recompute, and their outputs still equal the reference."""
    prompts = _prompts(16, seed=4)
    _oracle(install_plugin, "oracle_preempt", dict(zip(map(tuple, prompts), reference(prompts), strict=True)))
    with _llm(tiny_model_dir, proposer="oracle", hooks=["oracle_preempt"], num_blocks=10) as llm:
        results = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
        assert _all_free(llm)
    assert stats.kv.num_preemptions > 0 and stats.num_accepted_tokens > 0
    assert [r.token_ids for r in results] == reference(prompts)


def _stopping_at(stop: str) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])


def test_a_stop_string_or_max_tokens_inside_an_accepted_run_ends_the_request_there(
        install_plugin, tiny_model_dir, reference):
    prompts = _prompts(6, seed=5)
    full = reference(prompts)
    oracle = _oracle(install_plugin, "oracle_stops", {})
    oracle.answers = {tuple(p): [t for t in answer] for p, answer in zip(prompts, full, strict=True)}
    # never wrong: every proposal is accepted, so runs of four plus one go out each step
    oracle.propose = lambda self, requests, budgets: [
        list(self.answers[tuple(r.prompt_token_ids)][len(r.output_token_ids):len(r.output_token_ids) + b])
        for r, b in zip(requests, budgets, strict=True)]
    with _llm(tiny_model_dir, proposer=None) as plain:
        texts = [r.text for r in plain.generate(prompts, GREEDY)]
        # a stop string from the middle of each reply (its characters 7-9), and a max_tokens of 7 (not a
        # multiple of a full run's five tokens)
        stopped = [plain.generate([p], _stopping_at(t[7:9]))[0] for p, t in zip(prompts, texts, strict=True)]
        short = plain.generate(prompts, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    with _llm(tiny_model_dir, proposer="oracle", hooks=["oracle_stops"]) as llm:
        spec_stopped = [llm.generate([p], _stopping_at(t[7:9]))[0] for p, t in zip(prompts, texts, strict=True)]
        spec_short = llm.generate(prompts, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
        stats = llm.engine.stats()
        assert _all_free(llm)
    assert stats.num_accepted_tokens == stats.num_proposed_tokens > 0
    assert [(r.text, r.token_ids, r.finish_reason) for r in spec_stopped] == \
        [(r.text, r.token_ids, r.finish_reason) for r in stopped]
    assert all(r.finish_reason is FinishReason.STOP for r in spec_stopped)
    assert [r.token_ids for r in spec_short] == [r.token_ids for r in short]
    assert all(len(r.token_ids) == 7 for r in spec_short)


def test_sampled_tokens_keep_their_distribution(install_plugin, tiny_model_dir):
    """The second output token (the first one verified) of many sampled requests of one prompt has the
    same distribution with speculation as without (two-sample chi-square), while the proposer always
    guesses the token most likely without it."""
    prompt = [17, 42, 99, 7]
    # one proposal, after the first token; top-k keeps the second token's marginal on a few values
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    draws = 1500
    with _llm(tiny_model_dir, proposer=None) as plain:
        without = Counter(r.token_ids[1] for r in plain.generate([prompt] * draws, params))
    likely = without.most_common(1)[0][0]
    oracle = _oracle(install_plugin, "oracle_sampled", {})
    oracle.propose = lambda self, requests, budgets: [[likely] for _ in requests]
    with _llm(tiny_model_dir, proposer="oracle", hooks=["oracle_sampled"], k=1) as llm:
        with_spec = Counter(r.token_ids[1] for r in llm.generate([prompt] * draws, params))
        stats = llm.engine.stats()
    assert stats.num_proposed_tokens == draws and 0 < stats.num_accepted_tokens < draws
    bins = [t for t, _ in without.most_common() if without[t] >= 25]
    counts = np.array([[c[t] for t in bins] + [draws - sum(c[t] for t in bins)] for c in (without, with_spec)], float)
    counts = counts[:, counts.sum(axis=0) > 0]   # the "other tokens" cell only when it has any
    expected = counts.sum(axis=0) / 2
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert counts.shape[1] >= 4, "a spread distribution: the test must be able to fail"
    assert statistic < CHI_SQUARE_CRITICAL_0_001[counts.shape[1] - 1]


def test_a_constrained_request_accepts_only_what_its_constraint_allows(install_plugin, tiny_model_dir):
    """JSON-schema requests with an oracle whose every third token is wrong (often one the schema
    forbids): each position is masked as after the proposals before it, the replies equal those
    without speculation, and the matchers are left where the outputs put them."""
    from tests.fd_core.server import constrained

    prompts = _prompts(6, seed=9)
    params = SamplingParams(max_tokens=constrained.MAX_TOKENS, temperature=0.0,
                            guided=GuidedDecoding("json", json.dumps(constrained.SCHEMA)))
    with _llm(tiny_model_dir, proposer=None) as plain:
        expected = plain.generate(prompts, params)
    _oracle(install_plugin, "oracle_guided", {tuple(p): r.token_ids for p, r in zip(prompts, expected, strict=True)})
    with _llm(tiny_model_dir, proposer="oracle", hooks=["oracle_guided"]) as llm:
        replies = llm.generate(prompts, params)
        stats = llm.engine.stats()
        assert _all_free(llm)
    assert [(r.token_ids, r.finish_reason) for r in replies] == [(r.token_ids, r.finish_reason) for r in expected]
    for reply in replies:
        constrained.Reading.model_validate_json(reply.text)
    assert 0 < stats.num_accepted_tokens < stats.num_proposed_tokens


def test_a_constrained_row_that_fails_while_speculating_ends_that_request_alone(install_plugin, tiny_model_dir):
    """A guided-decoding backend whose matchers fail on their third mask: the step that verifies
    guesses under it ends that request with the backend's error (no token goes out for it), and
    another request speculating beside it goes on."""
    install_plugin("fixed_guess", FIXED_GUESS)
    install_plugin("breaks_later", BREAKS_LATER)
    engine = build_engine(load_config(model={"source": tiny_model_dir}, cache={"num_blocks": 64},
                                      proposer={"name": "fixed", "max_proposed_tokens_per_step": 1024},
                                      guided_decoding={"name": "breaks-later"},
                                      plugins={"hooks": ["fixed_guess", "breaks_later"]}))
    eos = engine.tokenizer.eos_token_ids
    broken = Request("broken", [5, 17, 42], SamplingParams(max_tokens=20, temperature=0.0, guided=REGEX),
                     eos_token_ids=eos)
    free = Request("free", [5, 17, 42], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                   eos_token_ids=eos)
    for request in (broken, free):
        engine.add_request(request)
    done = {}
    for _ in range(100):
        engine.step()
        done.update({o.request_id: o for o in engine.get_results(timeout=0) if o.finished})
        if len(done) == 2:
            break
    assert done["broken"].finish_reason is FinishReason.ERROR and "third mask" in done["broken"].error
    assert -1 not in broken.output_token_ids and len(broken.output_token_ids) == 2   # the mask failed on its third
    assert done["free"].finish_reason is FinishReason.LENGTH and len(free.output_token_ids) == 12
    assert engine.stats().num_proposed_tokens > 0
    assert engine.resource_manager.num_free_blocks() == 64


def test_per_request_opt_out_and_unsupported_sampling_are_not_speculated(tiny_model_dir, reference):
    prompts = _prompts(4, seed=6)
    with _llm(tiny_model_dir, proposer="ngram") as llm:
        opted_out = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                         speculate=False))
        llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.2))
        llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True, seed=3))
        stats = llm.engine.stats()
    assert stats.num_proposed_tokens == 0
    assert [r.token_ids for r in opted_out] == reference(prompts)


def test_a_failing_proposer_is_reported_once_and_loses_nothing(install_plugin, tiny_model_dir, reference, caplog):
    install_plugin("broken_proposer", BROKEN)
    prompts = _prompts(6, seed=7)
    with _llm(tiny_model_dir, proposer="broken", hooks=["broken_proposer"]) as llm, caplog.at_level(logging.ERROR):
        results = llm.generate(prompts, GREEDY)
        assert _all_free(llm)
    assert [r.token_ids for r in results] == reference(prompts)
    reports = [r.getMessage() for r in caplog.records if "proposer bug" in r.getMessage()]
    assert len(reports) == 1 and "broken" in reports[0] and "propose" in reports[0]
