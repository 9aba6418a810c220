"""Grader of exercise 07 (chapter 07: prefix caching): a salted hash chain, the lookup through hash
buckets with its token and parent checks, predicting the engine's hits, and a token-granular radix
cache with split and LRU.

Chains and lookups, salted or not, are compared with minillm's `HashChain` and `BlockManager` (without
K/V tensors): `HashChain.insert` continues a chain from any cursor, so started from `(salt, None)` it
gives the salted chain, and a tenant's prompts served behind a salt block (the hash of that block is
then the salt) give minillm's own answer to a salted lookup. The radix cache (task 4), which minillm
does not ship, is compared with the grader-private reference of `minillm.grading.private.ex07_reference`;
a student release, which has no private reference, compares it by answer key (`minillm.grading.answer_key`:
a digest of each case's transcript, every operation's result and the tree's shape after it, over five
sequences). All of them are disabled (`forbid`, or guarded as grader code) while the learner's code runs.
Task 3 runs the bundled model on a seeded trace and on one drawn at grade time.
"""

from __future__ import annotations

import random
from functools import partial

from minillm import LLM, SamplingParams
from minillm.grading import Fail, forbid, grade_time_seeds, private_reference, task
from minillm.grading.answer_key import AnswerKey
from minillm.kv.block_manager import BlockManager, HashChain, block_hash
from minillm.kv.radix import RadixNode, RadixTree
from minillm.llm import BUNDLED_TARGET
from minillm.request import Request
from minillm.traces.synthetic import LengthDist, make_trace

# Lent to the learner during a check (minillm.grading.provenance, rule 2): every other function of this
# module raises when learner code calls it while a check runs.
FRESH_CASES = 20  # cases drawn at grade time, besides the seeded ones (memoised answers fail)
LEARNER_TOOLS = ()

_TEACHERS = (private_reference("ex07_reference"),)  # the radix tree: withheld in a student release


def _private():
    """The grader-private references, loaded at import. Held in a tuple, not as a module global, so
    that looking the grader's checks up never touches a withheld module."""
    return _TEACHERS[0]
MODEL = BUNDLED_TARGET
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PREFIX_CACHE = (HashChain, BlockManager, RadixTree, RadixNode)


def _reference_hashes(tokens, block_size, salt=None):
    # The library's chain, started from the cursor (salt, None): block 0's parent hash is the salt.
    chain = HashChain(block_size)
    blocks = list(range(len(tokens) // block_size))
    chain.insert(tokens, blocks, cursor=(salt, None))
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


FRESH_PREFIX_LENS = (40, 56, 72, 104)  # task 3's trace drawn at grade time: none caches the seeded trace's 80
SHARED_TRACE = dict(num_requests=16, seed=17, vocab_size=4096, shared_prefix_len=88, num_prefixes=3,
                    prompt_len=LengthDist.lognormal(20, 0.6), output_len=LengthDist.lognormal(6, 0.5),
                    min_prompt_len=4, max_prompt_len=200, min_output_len=2, max_output_len=12,
                    token_id_range=(6, 4096))


def _salt(rng):
    return None if rng.random() < 0.3 else rng.randrange(1, 2**40)


@task(1, "hash chain")
def check_task_1(chain_hashes) -> str:
    rng, cases = random.Random(70), 200
    for case in range(cases + FRESH_CASES):
        if case == cases:  # then cases drawn at grade time: they cannot be memoised
            rng = random.Random(grade_time_seeds(1)[0])
        bs = rng.choice([1, 2, 4, 8, 16])
        base = [rng.randrange(6, 4096) for _ in range(rng.randint(0, 80))]
        tokens = base if rng.random() < 0.5 else base[: len(base) // 2] * 2  # repeated blocks too
        salt = _salt(rng)
        want = _reference_hashes(tokens, bs, salt)
        with forbid(*PREFIX_CACHE):
            got = list(chain_hashes(list(tokens), bs, salt))
        if got != want:
            where = f"case {case}: {len(tokens)} tokens, block_size {bs}, salt {salt}"
            if len(got) != len(want):
                raise Fail(f"{where}: expected {len(want)} hashes (one per full block), got {len(got)}")
            first = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            raise Fail(f"{where}: first difference at block {first}"
                       + (" (block 0's parent is the salt)" if first == 0 and salt is not None else ""))
    return f"{cases} seeded prompts (salted and not) and {FRESH_CASES} drawn now: hashes equal to the reference chain's"


def _buckets(kv):
    """A BlockManager's cache as task 2's buckets: hash -> [(block, parent block, token ids)]."""
    chain = kv.prefix_cache
    return {h: [(b, chain.parent_of_block[b], chain.tokens_of_block[b])] for h, b in chain.cached_block_of.items()}


def _tenant_cache(rng):
    """One of task 2's drawn cases, grown by minillm's HashChain: prompts sharing prefixes, some served
    behind a tenant's salt block (tokens no prompt uses; its hash is the tenant's salt), shown in task
    2's shape with the salt block left out and its children's parent None, and with colliding entries
    (other tokens, or the same tokens after another parent) added to some buckets, first or last.
    Returns (cache, tokens, block_size, salt, expected): the expected blocks are HashChain's own match
    of the salt block and the prompt, the salt block dropped."""
    bs = rng.choice([2, 4, 8])
    salt_block = tuple(rng.randrange(40, 60) for _ in range(bs))  # prompts use ids 6-39: never a salt block
    heads = {None: (), block_hash(None, salt_block): salt_block}
    prefixes = [[rng.randrange(6, 40) for _ in range(rng.randint(0, 4 * bs))] for _ in range(3)]
    chain, next_block, served = HashChain(bs), 0, []
    for _ in range(rng.randint(1, 6)):
        tokens = rng.choice(prefixes) + [rng.randrange(6, 40) for _ in range(rng.randint(1, 3 * bs))]
        salt = rng.choice(list(heads))
        full = [*heads[salt], *tokens]
        count = len(full) // bs
        chain.insert(full, list(range(next_block, next_block + count)))  # a cached prefix keeps its blocks
        next_block += count
        served.append((tokens, salt))
    salt_blocks = {chain.cached_block_of[h] for h in heads if h is not None and h in chain.cached_block_of}
    cache = {}
    for h, block in chain.cached_block_of.items():
        if block not in salt_blocks:
            parent = chain.parent_of_block[block]
            cache[h] = [(block, None if parent in salt_blocks else parent, chain.tokens_of_block[block])]
    for bucket in cache.values():
        if rng.random() < 0.3:
            block, parent, chunk = bucket[0]
            fake = (1000 + block, parent, tuple(t + 1 for t in chunk)) if rng.random() < 0.5 else \
                (2000 + block, 3000 + (parent or 0), chunk)
            bucket.insert(0, fake) if rng.random() < 0.5 else bucket.append(fake)
    tokens, salt = rng.choice(served)
    if rng.random() < 0.5:
        tokens = tokens + [rng.randrange(6, 40) for _ in range(rng.randint(0, 2 * bs))]
    if rng.random() < 0.2:
        salt = rng.choice(list(heads))  # sometimes another tenant asks
    full = [*heads[salt], *tokens]
    matched = chain.match_prefix(full[: (len(full) - 1) // bs * bs], touch=False)  # >= 1 token left to compute
    return cache, tokens, bs, salt, matched[len(heads[salt]) // bs :]


def _crafted_cases():
    # By construction: (name, cache, tokens, block_size, salt, expected blocks).
    bs, salt = 4, 12345
    prompt = list(range(10, 23))  # 3 full blocks + 1 token
    hashes = _reference_hashes(prompt, bs, salt)
    right = [(20 + i, 20 + i - 1 if i else None, tuple(prompt[i * bs : (i + 1) * bs])) for i in range(3)]
    cache = {hashes[i]: [right[i]] for i in range(3)}
    other_tokens, other_parent = (99, 20, (1, 2, 3, 4)), (98, 77, tuple(prompt[4:8]))
    return [
        ("all three full blocks cached", cache, prompt, bs, salt, [20, 21, 22]),
        ("block 1's bucket: other tokens first, then the right entry",
         {**cache, hashes[1]: [other_tokens, right[1]]}, prompt, bs, salt, [20, 21, 22]),
        ("block 1's bucket: same tokens after another parent first, then the right entry",
         {**cache, hashes[1]: [other_parent, right[1]]}, prompt, bs, salt, [20, 21, 22]),
        ("block 1's bucket: only other tokens (a collision)", {**cache, hashes[1]: [other_tokens]}, prompt, bs, salt, [20]),
        ("block 1's bucket: only the same tokens after another parent", {**cache, hashes[1]: [other_parent]},
         prompt, bs, salt, [20]),
        ("fully cached prompt (12 tokens, 3 full blocks)", cache, prompt[:12], bs, salt, [20, 21]),
        ("one-block prompt, fully cached", {hashes[0]: [right[0]]}, prompt[:4], bs, salt, []),
        ("the cache holds another salt's chain", cache, prompt, bs, salt + 1, []),
        ("the cache holds a salted chain, the lookup has none", cache, prompt, bs, None, []),
        ("empty cache", {}, prompt, bs, salt, []),
        ("first block's bucket empty", {**cache, hashes[0]: []}, prompt, bs, salt, []),
    ]


@task(2, "prefix lookup")
def check_task_2(lookup) -> str:
    cases = 0
    for name, cache, tokens, bs, salt, want in _crafted_cases():
        with forbid(*PREFIX_CACHE):
            got = list(lookup({h: list(b) for h, b in cache.items()}, list(tokens), bs, salt))
        if got != want:
            raise Fail(f"{name} (block_size {bs}, salt {salt}): expected blocks {want}, got {got}")
        cases += 1
    rng = random.Random(71)
    for case in range(150):  # minillm's own cache (one entry per hash, no salt): its lookup is the reference
        bs = rng.choice([2, 4, 8])
        kv, prefixes, served = _served_manager(rng, bs)
        tokens = rng.choice(prefixes + served)
        if rng.random() < 0.6:
            tokens = tokens + [rng.randrange(6, 60) for _ in range(rng.randint(0, 2 * bs))]
        if not tokens:
            tokens = [7]
        want = kv._match(Request("probe", tokens, GREEDY, 0.0), touch=False)
        with forbid(*PREFIX_CACHE):
            got = list(lookup(_buckets(kv), list(tokens), bs, None))
        if got != want:
            raise Fail(f"seeded case {case}: block_size {bs}, prompt of {len(tokens)} tokens, no salt: "
                       f"BlockManager reuses blocks {want}, your lookup returned {got}")
        cases += 1
    for seed in [*range(50), *grade_time_seeds(FRESH_CASES)]:  # buckets with collisions; the fresh ones are new
        cache, tokens, bs, salt, want = _tenant_cache(random.Random(seed))
        with forbid(*PREFIX_CACHE):
            got = list(lookup({h: list(b) for h, b in cache.items()}, list(tokens), bs, salt))
        if got != want:
            raise Fail(f"bucket case {seed}: block_size {bs}, salt {salt}, prompt of {len(tokens)} tokens, "
                       f"{sum(len(b) > 1 for b in cache.values())} bucket(s) with more than one entry: "
                       f"expected blocks {want}, your lookup returned {got}")
        cases += seed < 50
    return (f"{cases} scenarios (colliding buckets, salts, minillm's own cache) and {FRESH_CASES} drawn now: "
            "the blocks a request reuses (tokens and parent checked)")


def _predicted_against_engine(predict_cached_tokens, prompts, lengths, what):
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
        raise Fail(f"{what}, request {first}: you predicted {predicted[first] if first < len(predicted) else 'nothing'}, "
                   f"the engine served {actual[first] if first < len(actual) else 'nothing'} cached tokens "
                   f"(all predicted: {predicted})")
    return actual, llm.engine.metrics.summary().prefix_cache_hit_rate


@task(3, "predict the engine's cache hits")
def check_task_3(predict_cached_tokens) -> str:
    trace = make_trace(**SHARED_TRACE)
    # Two requests at the end repeat earlier prompts exactly: fully cached prompts.
    prompts = [r.prompt_token_ids for r in trace] + [trace[1].prompt_token_ids, trace[5].prompt_token_ids]
    actual, hit = _predicted_against_engine(predict_cached_tokens, prompts, [r.max_tokens for r in trace] + [4, 4],
                                            "the seeded trace")
    # The trace drawn now shares prefixes of another length (cached 32, 48, 64 or 96 tokens where the seeded
    # trace caches 80): an answer fitted to the seeded trace cannot also be this one's by chance.
    seed = grade_time_seeds(1)[0]
    fresh = make_trace(**dict(SHARED_TRACE, num_requests=10, seed=seed, max_output_len=4,
                              shared_prefix_len=FRESH_PREFIX_LENS[seed % len(FRESH_PREFIX_LENS)]))
    _predicted_against_engine(predict_cached_tokens, [r.prompt_token_ids for r in fresh], [r.max_tokens for r in fresh],
                              "a trace drawn now")
    return (f"{len(actual)} requests, cached prompt tokens {actual}, hit rate {hit:.3f}; "
            "and a 10-request trace drawn now, predicted too")


# --- task 4: a token-granular radix cache --------------------------------------------------------


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


SEQUENCES_PER_CASE = 5  # task 4: one case is five sequences of operations (a digest over a short one could be searched)
SEEDED_RADIX_CASES = 30  # sequences 0-149


def _radix_operations(sequence):
    # Task 4's sequence `sequence`: 1-25 inserts, matches and evictions over tokens 1-3 (many shared prefixes).
    rng, operations = random.Random(700 + sequence), []
    for _ in range(rng.randint(1, 25)):
        roll = rng.random()
        tokens = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 8)))
        operations.append(("insert", tokens) if roll < 0.5 else ("match", tokens) if roll < 0.8
                          else ("evict", rng.randint(1, 6)))
    return operations


def _sequences(number):
    return range(number * SEQUENCES_PER_CASE, (number + 1) * SEQUENCES_PER_CASE)


def radix_transcripts(number):
    """Task 4's expected output on case `number`: for each of its sequences, every operation's result
    and the tree's shape after it, as the reference radix cache gives them."""
    out = []
    for sequence in _sequences(number):
        tree, transcript = _private().ReferenceRadix(), []
        for op, arg in _radix_operations(sequence):
            transcript.append((getattr(tree, op)(arg), _shape(tree.root)))
        out.append(transcript)
    return out


KEY_4 = AnswerKey("ex07_prefix_lookup", 4, size=256, seeded=SEEDED_RADIX_CASES, reference=radix_transcripts,
                  private=_TEACHERS[0])


def _radix_difference(number, mine, want):
    for sequence, ours, ref in zip(_sequences(number), mine, want):
        operations = _radix_operations(sequence)
        for index, ((got, shape), (expected, ref_shape)) in enumerate(zip(ours, ref)):
            where = f"sequence {sequence}, after {operations[max(0, index - 3) : index + 1]} (last 4 operations)"
            if got != expected:
                return f"{where}: {operations[index][0]} returned {got}, expected {expected}"
            if shape != ref_shape:
                return f"{where}: your tree {shape}, expected {ref_shape} ((edge, children) from the root)"
    return f"case {number}: your transcript differs from the reference's"


def _checked_result(op, arg, got, tree, where):
    # What any correct radix cache returns, checked before the transcript is compared: clearer messages.
    if type(got) is not int:
        raise Fail(f"{where}: {op} returned {got!r}, not an int (a number of tokens)")
    if op != "evict" and not 0 <= got <= len(arg):
        raise Fail(f"{where}: {op} of {len(arg)} tokens returned {got}: a number of those tokens")
    if op == "evict" and (got < 0 or (got < arg and getattr(tree.root, "children", None))):
        raise Fail(f"{where}: evict({arg}) returned {got} while the tree still holds tokens: "
                   "evict removes leaves until at least that many tokens are gone, or the tree is empty")


@task(4, "radix cache with split and LRU")
def check_task_4(radix_class) -> str:
    operations = 0
    for case in KEY_4.cases(fresh=FRESH_CASES // SEQUENCES_PER_CASE):  # drawn ones cannot be memoised
        case.expected()  # the teacher's copy runs the reference first, before any learner code
        mine = []
        for sequence in _sequences(case.number):
            with forbid(*PREFIX_CACHE):
                tree = radix_class()
            transcript, history = [], []
            for op, arg in _radix_operations(sequence):
                history.append((op, arg))
                with forbid(*PREFIX_CACHE):
                    got = getattr(tree, op)(list(arg) if op != "evict" else arg)
                    shape = _shape(tree.root)
                _checked_result(op, arg, got, tree, f"sequence {sequence}, after {history[-4:]} (last 4 operations)")
                transcript.append((got, shape))
            operations += len(transcript) if case.number < KEY_4.seeded else 0
            mine.append(transcript)
        case.judge(mine, f"case {case.number} (sequences {_sequences(case.number)[0]}-{_sequences(case.number)[-1]}, "
                   "rebuilt by grader._radix_operations(sequence))", explain=partial(_radix_difference, case.number))
    return KEY_4.report(f"{SEEDED_RADIX_CASES * SEQUENCES_PER_CASE} seeded sequences, {operations} operations: "
                        "results and tree shape agree")
