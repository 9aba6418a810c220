"""The router's radix tree and routing policies, without any server (issue 17, point 2).

Properties (hypothesis): the tree's match equals a brute-force longest common prefix over what was
inserted, a tenant's size equals its distinct prefixes, and after eviction every tenant is within
the bound with its most recent text kept. Policies: each rule of cache_aware (affinity above the
threshold, smallest tree below it, least load when imbalanced beyond BOTH thresholds) on cases
where a wrong rule picks another worker.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.router.policies import CacheAware, CacheAwareConfig, LeastLoad, RoundRobin, make_policy
from minillm.router.radix import RadixTree

TENANTS = ["a", "b", "c"]
texts = st.text(alphabet="xyz", min_size=0, max_size=12)
inserts = st.lists(st.tuples(texts, st.sampled_from(TENANTS)), max_size=25)


def _lcp(x: str, y: str) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def _brute_match(history, query: str, allowed) -> tuple[int, list[str]]:
    best = {t: max([_lcp(x, query) for x, u in history if u == t], default=0) for t in allowed}
    top = max(best.values(), default=0)
    return (top, sorted(t for t, v in best.items() if v == top)) if top else (0, [])


@settings(max_examples=200, deadline=None)
@given(inserts, texts, st.sets(st.sampled_from(TENANTS), min_size=1))
def test_match_equals_brute_force_longest_common_prefix(history, query, allowed):
    tree = RadixTree()
    for text, tenant in history:
        tree.insert(text, tenant)
    assert tree.prefix_match(query, allowed) == _brute_match(history, query, allowed)
    for t in TENANTS:  # a tenant owns exactly the distinct non-empty prefixes of its texts
        prefixes = {x[:k] for x, u in history if u == t for k in range(1, len(x) + 1)}
        assert tree.size(t) == tree.recount(t) == len(prefixes)


@settings(max_examples=200, deadline=None)
@given(inserts, st.integers(min_value=0, max_value=15))
def test_eviction_bounds_each_tenant_and_keeps_the_most_recent_text(history, max_chars):
    tree = RadixTree()
    for text, tenant in history:
        tree.insert(text, tenant)
    tree.evict(max_chars)
    for t in TENANTS:
        assert tree.size(t) == tree.recount(t) <= max_chars
        mine = [x for x, u in history if u == t]
        if mine and len(mine[-1]) <= max_chars:  # LRU: the last text sent to t is the last to go
            assert tree.prefix_match(mine[-1], [t]) == ((len(mine[-1]), [t]) if mine[-1] else (0, []))
    for text, tenant in history:  # what survived still matches correctly: never more than was inserted
        matched, owners = tree.prefix_match(text, [tenant])
        assert matched <= len(text) and owners in ([], [tenant])


def test_eviction_drops_the_least_recently_used_branch_first():
    tree = RadixTree()
    tree.insert("system: be brief. user: old question", "w")
    tree.insert("system: be brief. user: new question", "w")
    tree.insert("system: be brief. user: old question", "w")  # touched again: now the recent one
    before = tree.size("w")
    tree.evict(before - 1)
    assert tree.prefix_match("system: be brief. user: old question", ["w"])[0] == 36
    assert tree.prefix_match("system: be brief. user: new question", ["w"])[0] == len("system: be brief. user: ")
    tree.remove_tenant("w")
    assert tree.size("w") == 0 and tree.prefix_match("system", ["w"]) == (0, [])


WORKERS = ["http://w0", "http://w1"]


def test_round_robin_and_least_load():
    rr = RoundRobin()
    assert [rr.choose("p", WORKERS, {}) for _ in range(4)] == WORKERS * 2
    ll = LeastLoad()
    assert ll.choose("p", WORKERS, {"http://w0": 3, "http://w1": 1}) == "http://w1"
    # ties rotate, so an idle pool is not all worker 0
    assert {ll.choose("p", WORKERS, {}) for _ in range(2)} == set(WORKERS)


def test_cache_aware_follows_the_prefix_above_the_threshold():
    policy = CacheAware(CacheAwareConfig(cache_threshold=0.5))
    system = "You are a helpful assistant for tenant A. " * 3
    first = policy.choose(system + "question 1", WORKERS, {})
    other = policy.choose("something else entirely", WORKERS, {})
    assert other != first  # below the threshold: the smaller tree (the empty one)
    # the hot prefix sticks to its worker even though that worker is busier (within the balance thresholds)
    for i in range(5):
        loads = {first: 3, other: 0}
        assert policy.choose(system + f"question {i + 2}", WORKERS, loads) == first
    assert policy.decisions["cache_hit"] == 5 and policy.decisions["smallest_tree"] == 2
    assert policy.prefix_match_rate > 0.5


def test_cache_aware_below_threshold_goes_to_the_smallest_tree():
    for threshold, expected in ((0.9, "http://w1"), (0.5, "http://w0")):
        policy = CacheAware(CacheAwareConfig(cache_threshold=threshold))
        policy.tree.insert("x" * 50, "http://w0")
        policy.tree.insert("y" * 10, "http://w1")
        # 40 of 50 characters match w0's text: a match rate of 0.8
        assert policy.choose("x" * 40 + "q" * 10, WORKERS, {}) == expected


@pytest.mark.parametrize("holder_load, idle_load, balanced", [
    (5, 0, False),  # abs diff 5 > 4 and 5 > 2 * 0: imbalanced -> the idle worker despite the prefix
    (4, 0, True),  # abs diff 4 is not > 4: affinity
    (10, 5, True),  # abs diff 5 > 4 but 10 is not > 2 * 5: affinity
])
def test_cache_aware_balances_only_when_both_thresholds_are_exceeded(holder_load, idle_load, balanced):
    policy = CacheAware(CacheAwareConfig(cache_threshold=0.1, balance_abs_threshold=4, balance_rel_threshold=2.0))
    hot = "shared system prompt " * 4
    holder = policy.choose(hot, WORKERS, {})
    idle = next(w for w in WORKERS if w != holder)
    got = policy.choose(hot + "q", WORKERS, {holder: holder_load, idle: idle_load})
    assert got == (holder if balanced else idle)
    assert policy.decisions.get("balance", 0) == (0 if balanced else 1)


def test_cache_aware_spreads_tenants_and_never_piles_on_one_worker():
    """Multi-tenant traffic: four system prompts over two workers. Affinity keeps each tenant on
    one worker (high match rate) and the smallest-tree rule spreads the tenants (both used)."""
    policy = CacheAware(CacheAwareConfig())
    tenants = [f"tenant {k}: " + "instructions " * 10 for k in range(4)]
    chosen = {k: set() for k in range(4)}
    loads = {w: 0 for w in WORKERS}
    for i in range(40):
        k = i % 4
        w = policy.choose(tenants[k] + f"user question number {i}", WORKERS, loads)
        chosen[k].add(w)
        loads[w] += 1
    assert all(len(ws) == 1 for ws in chosen.values())  # each tenant stays where its prefix is
    assert {w for ws in chosen.values() for w in ws} == set(WORKERS)
    assert policy.prefix_match_rate > 0.7


def test_bad_policy_and_thresholds_name_the_flag():
    with pytest.raises(ValueError, match="--policy 'random' is not one of round_robin, least_load, cache_aware"):
        make_policy("random")
    with pytest.raises(ValueError, match="--cache-threshold must lie in"):
        CacheAware(CacheAwareConfig(cache_threshold=1.5))
    with pytest.raises(ValueError, match="--balance-rel-threshold must be >= 1.0"):
        CacheAware(CacheAwareConfig(balance_rel_threshold=0.5))


def test_tenant_trace_shares_exactly_the_system_prompt_and_skews_popularity(tmp_path):
    from minillm.traces.synthetic import Trace
    from minillm.traces.tenant import make_tenant_trace, tenant_weights

    trace = make_tenant_trace(400, num_tenants=4, system_prompt_len=10, question_len=3, zipf_s=1.0, seed=3)
    assert tenant_weights(4, 1.0).tolist() == pytest.approx([12 / 25, 6 / 25, 4 / 25, 3 / 25])
    counts = [sum(r.prefix_id == k for r in trace) for k in range(4)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 2 * counts[3]
    a, b = [r for r in trace if r.prefix_id == 0][:2]
    c = next(r for r in trace if r.prefix_id == 1)
    assert a.prompt_token_ids[:10] == b.prompt_token_ids[:10] and a.prompt_token_ids[10] != b.prompt_token_ids[10]
    assert a.prompt_token_ids[0] != c.prompt_token_ids[0] and a.prompt_len == 13 and a.max_tokens == 16
    trace.save_jsonl(tmp_path / "t.jsonl")
    assert Trace.load_jsonl(tmp_path / "t.jsonl").requests == trace.requests
    assert make_tenant_trace(400, num_tenants=4, system_prompt_len=10, question_len=3, seed=3).requests == trace.requests


@pytest.mark.parametrize("argv, message", [
    (["router", "--worker", "127.0.0.1:8001"], "--worker must be a URL starting with http://"),
    (["router", "--worker", "http://a:1", "--worker", "http://a:1"], "--worker URLs must differ"),
    (["router", "--worker", "http://a:1", "--cache-threshold", "2"], "--cache-threshold must lie in [0, 1]"),
    (["router", "--worker", "http://a:1", "--health-failure-threshold", "0"], "--health-failure-threshold must be >= 1"),
    (["serve", "--data-parallel-size", "0"], "--data-parallel-size must be >= 1, got 0"),
    (["serve", "--data-parallel-size", "2", "--balance-rel-threshold", "0.5"], "--balance-rel-threshold must be >= 1.0"),
])
def test_router_and_data_parallel_flags_fail_clearly_before_starting_anything(argv, message, capsys):
    from minillm.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_replicas_get_the_serve_flags_without_the_routers_and_the_port():
    from minillm.cli import replica_argv

    argv = ["serve", "models/m", "--data-parallel-size=2", "--port", "9000", "--host", "0.0.0.0", "--policy",
            "least_load", "--max-num-seqs", "4", "--enable-prefix-caching", "--cache-threshold", "0.5"]
    assert replica_argv(argv) == ["models/m", "--max-num-seqs", "4", "--enable-prefix-caching"]
