"""Grader of exercise 07 (chapter 07: prefix caching): the hash chain, the lookup with its token and
parent checks, predicting the engine's hits, and a token-granular radix cache with split and LRU.

Tasks 1 and 2 compare with minillm's `HashChain` and `BlockManager` (without K/V tensors), disabled
(`forbid`) while the learner's code runs; task 3 runs the bundled model; task 4 compares with
`_ReferenceRadix` below, a token-granular radix tree (SGLang's default page size of 1), on seeded
sequences of inserts, matches and evictions.
"""

from __future__ import annotations

import random

from minillm import LLM, SamplingParams
from minillm.grading import Fail, forbid, grade_time_seeds, task
from minillm.kv.block_manager import BlockManager, HashChain
from minillm.kv.radix import RadixNode, RadixTree
from minillm.llm import BUNDLED_TARGET
from minillm.request import Request
from minillm.workload import LengthDist, make_trace

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
FRESH_CASES = 20  # cases drawn at grade time, besides the seeded ones (memoised answers fail)
LEARNER_TOOLS = ()

MODEL = BUNDLED_TARGET
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PREFIX_CACHE = (HashChain, BlockManager, RadixTree, RadixNode)


def _reference_hashes(tokens, block_size):
    chain = HashChain(block_size)
    blocks = list(range(len(tokens) // block_size))
    chain.insert(tokens, blocks)
    return [chain.hash_of_block[b] for b in blocks]


def _served_manager(rng, bs):
    # A BlockManager (no tensors) after serving a few seeded requests that share prefixes.
    kv = BlockManager(1, 1, 1, 64, bs, enable_prefix_caching=True, allocate_pool=False, watermark=0.0)
    prefixes = [[rng.randrange(6, 60) for _ in range(rng.randint(0, 4 * bs))] for _ in range(3)]
    served = []
    for i in range(rng.randint(1, 6)):
        tokens = rng.choice(prefixes) + [rng.randrange(6, 60) for _ in range(rng.randint(1, 3 * bs))]
        req = Request(f"r{i}", tokens, GREEDY, 0.0)
        req.num_computed_tokens = kv.get_computed_tokens(req)
        if not kv.allocate(req, req.num_tokens - req.num_computed_tokens):
            kv.free(req)
            continue
        kv.commit_step()  # the step that computes its K/V has run: the lookup is counted, the blocks kept
        served.append(tokens)
        if rng.random() < 0.7:
            kv.free(req)  # finished: its full blocks stay cached (LRU)
    return kv, prefixes, served


SHARED_TRACE = dict(num_requests=16, seed=17, vocab_size=4096, shared_prefix_len=88, num_prefixes=3,
                    prompt_len=LengthDist.lognormal(20, 0.6), output_len=LengthDist.lognormal(6, 0.5),
                    min_prompt_len=4, max_prompt_len=200, min_output_len=2, max_output_len=12,
                    token_id_range=(6, 4096))


@task(1, "hash chain")
def check_task_1(chain_hashes) -> str:
    rng = random.Random(70)
    for case in range(200):
        bs = rng.choice([1, 2, 4, 8, 16])
        base = [rng.randrange(6, 4096) for _ in range(rng.randint(0, 80))]
        tokens = base if rng.random() < 0.5 else base[: len(base) // 2] * 2  # repeated blocks too
        want = _reference_hashes(tokens, bs)
        with forbid(*PREFIX_CACHE):
            got = list(chain_hashes(list(tokens), bs))
        if got != want:
            where = f"case {case}: {len(tokens)} tokens, block_size {bs}"
            if len(got) != len(want):
                raise Fail(f"{where}: expected {len(want)} hashes (one per full block), got {len(got)}")
            first = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            raise Fail(f"{where}: first difference at block {first}")
    return "200 seeded prompts, hashes equal to HashChain's"


def _cache_dict(kv):
    chain = kv.prefix_cache
    return {h: (b, chain.parent_of_block[b], chain.tokens_of_block[b]) for h, b in chain.cached_block_of.items()}


def _crafted_cases():
    # By construction: (name, cache, tokens, block_size, expected blocks).
    bs = 4
    prompt = list(range(10, 23))  # 3 full blocks + 1 token
    hashes = _reference_hashes(prompt, bs)
    blocks = {hashes[i]: (20 + i, 20 + i - 1 if i else None, tuple(prompt[i * bs : (i + 1) * bs])) for i in range(3)}
    collided = dict(blocks)
    collided[hashes[1]] = (99, 20, (1, 2, 3, 4))  # block 1's hash now names different tokens
    orphaned = dict(blocks)
    orphaned[hashes[1]] = (98, 77, tuple(prompt[4:8]))  # the right tokens, cached after another parent
    exact = prompt[:12]  # exactly 3 full blocks, all cached
    return [
        ("all three full blocks cached", blocks, prompt, bs, [20, 21, 22]),
        ("forced hash collision at block 1 (other tokens)", collided, prompt, bs, [20]),
        ("forced hash collision at block 1 (same tokens, another parent)", orphaned, prompt, bs, [20]),
        ("fully cached prompt (12 tokens, 3 full blocks)", blocks, exact, bs, [20, 21]),
        ("one-block prompt, fully cached", {hashes[0]: (20, None, tuple(prompt[:4]))}, prompt[:4], bs, []),
        ("empty cache", {}, prompt, bs, []),
        ("first block missing", {h: v for h, v in blocks.items() if h != hashes[0]}, prompt, bs, []),
    ]


@task(2, "prefix lookup")
def check_task_2(lookup) -> str:
    cases = 0
    for name, cache, tokens, bs, want in _crafted_cases():
        with forbid(*PREFIX_CACHE):
            got = list(lookup(dict(cache), list(tokens), bs))
        if got != want:
            raise Fail(f"{name}: expected blocks {want}, got {got}")
        cases += 1
    rng = random.Random(71)
    for case in range(150):
        bs = rng.choice([2, 4, 8])
        kv, prefixes, served = _served_manager(rng, bs)
        pool = prefixes + served
        tokens = rng.choice(pool)
        if rng.random() < 0.6:
            tokens = tokens + [rng.randrange(6, 60) for _ in range(rng.randint(0, 2 * bs))]
        if not tokens:
            tokens = [7]
        want = kv._match(Request("probe", tokens, GREEDY, 0.0), touch=False)
        cache = _cache_dict(kv)
        with forbid(*PREFIX_CACHE):
            got = list(lookup(cache, list(tokens), bs))
        if got != want:
            raise Fail(f"seeded case {case}: block_size {bs}, prompt of {len(tokens)} tokens: "
                       f"BlockManager reuses blocks {want}, your lookup returned {got}")
        cases += 1
    return f"{cases} scenarios, same blocks as BlockManager (a collision costs a miss: tokens and parent checked)"


@task(3, "predict the engine's cache hits")
def check_task_3(predict_cached_tokens) -> str:
    trace = make_trace(**SHARED_TRACE)
    # Two requests at the end repeat earlier prompts exactly: fully cached prompts.
    prompts = [r.prompt_token_ids for r in trace] + [trace[1].prompt_token_ids, trace[5].prompt_token_ids]
    lengths = [r.max_tokens for r in trace] + [4, 4]
    with forbid(*PREFIX_CACHE):
        predicted = list(predict_cached_tokens([list(p) for p in prompts], 16))
    llm = LLM(MODEL, block_size=16, num_kv_blocks=256, max_num_seqs=4, max_model_len=256,
              enable_prefix_caching=True)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    metrics = llm.engine.metrics.requests
    actual = [metrics[o.request_id].num_cached_prompt_tokens for o in outs]
    if predicted != actual:
        first = next((i for i, (p, a) in enumerate(zip(predicted, actual)) if p != a), min(len(predicted), len(actual)))
        raise Fail(f"request {first}: you predicted {predicted[first] if first < len(predicted) else 'nothing'}, "
                   f"the engine served {actual[first] if first < len(actual) else 'nothing'} cached tokens "
                   f"(all predicted: {predicted})")
    hit = llm.engine.metrics.summary().prefix_cache_hit_rate
    return f"{len(actual)} requests, cached prompt tokens {actual}, hit rate {hit:.3f}"


# --- task 4: a token-granular radix cache --------------------------------------------------------


class _Edge:
    """A node of the grader's tree: the edge tokens that lead to it, its parent, when a call last
    touched it, and its children by first token."""

    __slots__ = ("tokens", "parent", "last_access", "children")

    def __init__(self, tokens, parent, last_access):
        self.tokens, self.parent, self.last_access, self.children = tuple(tokens), parent, last_access, {}


def _common(edge, tokens) -> int:
    limit = min(len(edge), len(tokens))
    return next((j for j in range(limit) if edge[j] != tokens[j]), limit)


def _descend(node, tokens, clock, split):
    """(the node where `tokens` stop matching, how many matched), stamping the path with `clock`; with
    `split`, an edge the tokens leave part-way is cut in two there."""
    child = node.children.get(tokens[0]) if tokens else None
    if child is None:
        return node, 0
    child.last_access = clock
    k = _common(child.tokens, tokens)
    if k == len(child.tokens):
        end, more = _descend(child, tokens[k:], clock, split)
        return end, k + more
    if not (split and k < len(tokens)):
        return child, k
    upper = _Edge(child.tokens[:k], node, clock)
    node.children[upper.tokens[0]] = upper
    child.tokens, child.parent = child.tokens[k:], upper
    upper.children[child.tokens[0]] = child
    return upper, k


def _leaves(node):
    for child in node.children.values():
        if child.children:
            yield from _leaves(child)
        else:
            yield child


class _ReferenceRadix:
    """The rules of task 4, the grader's own (private, and guarded while a check runs): edges split
    where an insert diverges (never merged), every call stamps the nodes its path touches with the
    next clock value, and `evict` removes the least recently used leaf (ties: the smaller edge
    tokens) until enough tokens are gone."""

    def __init__(self):
        self.root, self.clock = _Edge((), None, 0), 0

    def match(self, tokens):
        self.clock += 1
        return _descend(self.root, tuple(tokens), self.clock, split=False)[1]

    def insert(self, tokens):
        self.clock += 1
        tokens = tuple(tokens)
        end, matched = _descend(self.root, tokens, self.clock, split=True)
        if matched < len(tokens):
            end.children[tokens[matched]] = _Edge(tokens[matched:], end, self.clock)
        return matched

    def evict(self, num_tokens):
        removed = 0
        while removed < num_tokens:
            victim = min(_leaves(self.root), key=lambda n: (n.last_access, n.tokens), default=None)
            if victim is None:
                break
            del victim.parent.children[victim.tokens[0]]
            removed += len(victim.tokens)
        return removed


def _shape(node, depth=0):
    """A canonical picture of a tree: (edge tokens, children's shapes sorted by first token)."""
    if depth > 200:
        raise Fail("the tree is deeper than 200 levels: does a node list itself as its child?")
    children = getattr(node, "children", None)
    if not isinstance(children, dict):
        raise Fail("every node needs a `children` dict keyed by the first token of the child's edge")
    for key, child in children.items():
        edge = tuple(getattr(child, "tokens", ()))
        if not edge or edge[0] != key:
            raise Fail(f"a child under key {key} has edge {edge}: edges are non-empty and keyed by their first token")
    return (tuple(getattr(node, "tokens", ())), tuple(_shape(children[k], depth + 1) for k in sorted(children)))


@task(4, "radix cache with split and LRU")
def check_task_4(radix_class, num_sequences: int = 150) -> str:
    operations = 0
    for seed in [*range(num_sequences), *grade_time_seeds(FRESH_CASES)]:  # fresh ones cannot be memoised
        rng = random.Random(700 + seed)
        ref = _ReferenceRadix()
        with forbid(*PREFIX_CACHE):
            mine = radix_class()
        history = []
        for _ in range(rng.randint(1, 25)):
            roll = rng.random()
            tokens = [rng.randint(1, 3) for _ in range(rng.randint(0, 8))]
            op = ("insert", tokens) if roll < 0.5 else ("match", tokens) if roll < 0.8 else ("evict", rng.randint(1, 6))
            history.append(op)
            expected = getattr(ref, op[0])(op[1])
            with forbid(*PREFIX_CACHE):
                got = getattr(mine, op[0])(list(op[1]) if op[0] != "evict" else op[1])
                shape = _shape(mine.root)
            operations += seed < num_sequences  # the PASS line counts the seeded sequences' operations
            where = f"sequence {seed}, after {history[-4:]} (last 4 operations)"
            if got != expected:
                raise Fail(f"{where}: {op[0]} returned {got}, expected {expected}")
            if shape != _shape(ref.root):
                raise Fail(f"{where}: your tree {shape}, expected {_shape(ref.root)} "
                           "((edge, children) from the root)")
    return f"{num_sequences} seeded sequences, {operations} operations: results and tree shape agree"
