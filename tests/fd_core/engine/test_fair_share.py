"""Fair sharing of the max_num_seqs slots between client calls (issue 41 item 20), counted in engine steps."""

from __future__ import annotations

import pytest

from fd_core.config import load_config
from fd_core.engine.builder import build_engine
from fd_core.engine.fair_share import FairShare
from fd_core.registry import Registry
from fd_core.request import FinishReason, Request, RequestStatus, SamplingParams

LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
BIG_PROMPT = [5, 6, 7, 8, 9]
#: The documented bound (docs/architecture.md, "Fair sharing"): a request of a call holding no slot,
#: handed out while every slot is taken, is planned within this many steps.
BOUND_STEPS = 2


#: A pool the 4 slots' choices outgrow (12 blocks of 16 tokens; 4 choices of 5 + 60 tokens need 20).
TIGHT_CACHE = {"num_blocks": 12, "block_size": 16}
PRESSING = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


def _engine(tiny_model_dir, *, fair_share=True, resource_manager="v1", cache=None):
    config = load_config(model={"source": tiny_model_dir}, cache=cache or {"num_blocks": 64},
                         resource_manager={"name": resource_manager},
                         platform={"name": "cpu", "options": {"kernels": "portable"}},   # no C++ kernel build
                         engine={"max_num_seqs": 4, "max_num_batched_tokens": 64, "fair_share": fair_share})
    return build_engine(config, Registry.discover())


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """Engines with 4 slots by (resource manager, fair_share), built once; each test drains what it adds."""
    built = {}

    def get(resource_manager="v1", fair_share=True, tight=False):
        key = (resource_manager, fair_share, tight)
        if key not in built:
            built[key] = _engine(tiny_model_dir, fair_share=fair_share, resource_manager=resource_manager,
                                 cache=TIGHT_CACHE if tight else None)
        return built[key]

    return get


class Run:
    """Steps an engine, recording each request's tokens, final output and the step of its first token."""

    def __init__(self, engine):
        self.engine = engine
        self.steps = 0
        self.tokens: dict[str, list[int]] = {}
        self.first_token_step: dict[str, int] = {}
        self.finished: dict[str, FinishReason] = {}   # in order of finishing

    def step(self):
        self.engine.step()
        self.steps += 1
        for output in self.engine.get_results(timeout=0):
            if output.new_token_ids:
                self.first_token_step.setdefault(output.request_id, self.steps)
                self.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                self.finished[output.request_id] = output.finish_reason

    def drain(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.engine.has_unfinished():
                return self
            self.step()
        raise AssertionError("the engine did not drain")


def _add_big_call(engine, n, params=LONG):
    for i in range(n):
        engine.add_request(Request(f"big-{i}", list(BIG_PROMPT), params, group_id="big"))


def _all_blocks_free(engine):
    stats = engine.resource_manager.stats()
    return stats.num_free_blocks == stats.num_blocks and stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.parametrize("resource_manager", ["v1", "v0"])
def test_a_bystander_is_planned_within_the_bound_while_a_large_n_call_holds_every_slot(engines, resource_manager):
    engine = engines(resource_manager)
    undisturbed = Run(engine)
    _add_big_call(engine, 8)
    undisturbed.drain()

    run = Run(engine)
    _add_big_call(engine, 8)               # n=8 on 4 slots, 30 tokens each
    for _ in range(5):
        run.step()
    assert run.engine.resource_manager.stats().num_running == 4
    run.engine.add_request(Request("bystander", [11, 12, 13], SHORT))
    arrived = run.steps
    run.drain()

    assert run.first_token_step["bystander"] - arrived <= BOUND_STEPS
    order = list(run.finished)
    assert order.index("bystander") < min(order.index(f"big-{i}") for i in range(8))
    assert set(run.finished.values()) == {FinishReason.LENGTH}
    assert {k: v for k, v in run.tokens.items() if k != "bystander"} == undisturbed.tokens   # resumed exactly
    assert len(run.tokens["bystander"]) == SHORT.max_tokens
    assert _all_blocks_free(run.engine)


def test_the_bound_holds_while_a_large_n_call_outgrows_the_kv_pool(engines):
    """v1 preempts the call's choices for one another; the bystander neither waits behind them nor is their victim."""
    engine = engines(tight=True)
    undisturbed = Run(engine)
    _add_big_call(engine, 8, PRESSING)
    undisturbed.drain()
    preemptions = engine.resource_manager.stats().num_preemptions
    assert preemptions > 0                  # the pool really runs dry

    run = Run(engine)
    _add_big_call(engine, 8, PRESSING)
    while engine.resource_manager.stats().num_preemptions == preemptions:
        run.step()                          # until a choice was preempted: it waits in the manager
    engine.add_request(Request("bystander", [11, 12, 13], SHORT))
    arrived = run.steps
    run.drain()

    assert run.first_token_step["bystander"] - arrived <= BOUND_STEPS
    assert {k: v for k, v in run.tokens.items() if k != "bystander"} == undisturbed.tokens
    assert set(run.finished.values()) == {FinishReason.LENGTH}
    assert _all_blocks_free(engine)


def test_a_call_giving_up_a_slot_resumes_with_the_same_tokens(engines):
    engine = engines()
    run = Run(engine)
    _add_big_call(engine, 4)               # exactly the 4 slots: every sibling has started
    for _ in range(10):
        run.step()
    requests = {r.request_id: r for r in engine._shares.holding.values()}
    engine.add_request(Request("bystander", [11, 12, 13], SHORT))
    run.step()
    taken_back = [r for r in requests.values() if r.num_preemptions > 0]
    assert len(taken_back) == 1 and taken_back[0].status is RequestStatus.PREEMPTED
    assert taken_back[0].output_token_ids            # it had decoded: its outputs are recomputed later
    run.drain()
    assert len({tuple(run.tokens[f"big-{i}"]) for i in range(4)}) == 1   # same prompt, greedy: same tokens
    assert _all_blocks_free(engine)


def _singles(engine):
    for i in range(10):
        engine.add_request(Request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=4 + i, temperature=0.0,
                                                                          ignore_eos=True)))


def _big_call_alone(engine):
    _add_big_call(engine, 8, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("workload", [_singles, _big_call_alone])
def test_without_a_call_over_its_share_beside_others_the_plan_is_the_same_as_without_the_rule(engines, workload):
    """Many requests of one sequence each, or one large-n call alone: no slot changes hands."""
    runs = []
    for fair_share in (True, False):
        run = Run(engines(fair_share=fair_share))
        workload(run.engine)
        runs.append(run.drain())
    with_rule, without = runs
    assert (with_rule.steps, with_rule.tokens, list(with_rule.finished)) == (
        without.steps, without.tokens, list(without.finished))


def test_an_aborted_parked_request_ends_once_and_frees_everything(engines):
    engine = engines()
    run = Run(engine)
    _add_big_call(engine, 8)
    for _ in range(3):
        run.step()
    engine.add_request(Request("bystander", [11, 12, 13], SHORT))
    run.step()
    parked = list(engine._shares.parked)
    assert parked
    for request_id in parked:
        engine.abort(request_id)
    run.drain()
    assert all((reason is FinishReason.ABORT) == (request_id in parked) for request_id, reason in run.finished.items())
    assert set(run.finished) == {f"big-{i}" for i in range(8)} | {"bystander"}
    assert not engine._shares.parked and not engine._shares.holding
    assert _all_blocks_free(engine)


# --- the rule itself, without a model ------------------------------------------------------------


def _holding(shares, *calls):
    for index, call in enumerate(calls):
        request = Request(f"{call}-{index}", [1], group_id=call)
        request.num_computed_tokens = 10 + index
        shares.hold(request)


def test_the_richest_call_gives_its_least_computed_sequence_to_a_call_under_its_share():
    shares = FairShare(4)
    _holding(shares, "a", "a", "a", "a")
    donor = shares.donor_for(Request("b-0", [1], group_id="b"))
    assert donor is not None and donor.request_id == "a-0"
    shares.park(donor)
    shares.hold(Request("b-0", [1], group_id="b"))
    shares.hold(Request("b-1", [1], group_id="b"))   # b now holds its share (2 of 4)
    assert shares.donor_for(Request("b-2", [1], group_id="b")) is None   # a holds 2 = its share: no ping-pong
    assert shares.donor_for(Request("a-9", [1], group_id="a")) is None


def test_calls_of_one_sequence_each_never_give_up_a_slot():
    shares = FairShare(4)
    _holding(shares, "a", "b", "c", "d")
    assert not shares.over_share()
    assert shares.donor_for(Request("e", [1])) is None


def test_parked_requests_of_the_call_holding_fewest_resume_first_started_ones_first():
    shares = FairShare(4)
    _holding(shares, "a", "a", "a", "b")
    fresh = Request("a-fresh", [1], group_id="a")
    started = Request("a-started", [1], group_id="a", status=RequestStatus.PREEMPTED)
    other = Request("b-fresh", [1], group_id="b")
    for request in (fresh, started, other):
        shares.park(request)
    assert shares.next_to_resume(under_share_only=False) is other     # b holds 1, a holds 3
    shares.hold(other)
    assert shares.next_to_resume(under_share_only=True) is None        # both hold at least their share (2)
    assert shares.next_to_resume(under_share_only=False) is started
