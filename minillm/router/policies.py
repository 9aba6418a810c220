"""Routing policies: which worker gets the next request (chapter 13).

    round_robin   the next worker in turn; blind to load and to prefixes
    least_load    the worker with the fewest requests in flight (shortest queue)
    cache_aware   SGLang's router: prefix affinity through an approximate radix tree, unless the
                  loads are too uneven, then the least loaded worker

cache_aware decides, for a request whose text is `text` (SGLang's rules, its flag names):

1. Imbalanced? `max_load - min_load > balance_abs_threshold` AND `max_load > balance_rel_threshold
   * min_load`: send to the least loaded worker outright. Without this rule a hot prefix piles all
   its traffic onto the one worker that holds it while the others idle.
2. Otherwise match `text` against the tree: `match_rate = matched chars / len(text)`. Above
   `cache_threshold`, send to the worker holding the longest match (the least loaded of them if
   several hold all of it). Without a threshold, one shared word of a system prompt would pin
   unrelated requests to one worker.
3. Otherwise send to the worker whose part of the tree is smallest: it has cached the least, so
   it has the most room, and new prefixes spread over the workers.

Whatever was chosen, the text is inserted under that worker, so the tree records where requests
really went. Eviction (`max_tree_size` characters per worker, LRU) runs every
`eviction_interval_secs` from the router's event loop.

"Load" is the router's own count of requests in flight per worker (sent, response not finished),
as SGLang's router counts it: no scrape of the workers needed, exact for traffic that passes here.
"""

from __future__ import annotations

from dataclasses import dataclass

from minillm.router.radix import RadixTree

POLICIES = ("round_robin", "least_load", "cache_aware")


@dataclass
class CacheAwareConfig:
    """SGLang router's knobs, with its meanings and its documented defaults."""

    cache_threshold: float = 0.3  # min prefix match rate for affinity routing, in [0, 1]
    balance_abs_threshold: int = 64  # imbalance needs max - min load above this ...
    balance_rel_threshold: float = 1.5  # ... and max load above this times min load
    eviction_interval_secs: float = 120.0
    max_tree_size: int = 2 ** 26  # characters per worker kept in the tree

    def validate(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must lie in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"--balance-abs-threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"--balance-rel-threshold must be >= 1.0, got {self.balance_rel_threshold}")
        if not self.eviction_interval_secs > 0:
            raise ValueError(f"--eviction-interval-secs must be > 0, got {self.eviction_interval_secs}")
        if self.max_tree_size < 1:
            raise ValueError(f"--max-tree-size must be >= 1, got {self.max_tree_size}")


class Policy:
    """Pick one of `workers` (healthy ones, in a fixed order) given `loads` (in flight per worker)."""

    name = "policy"
    eviction_interval_secs: float | None = None  # how often the router calls `evict` (None: never)
    uses_text = False  # whether `choose` reads the request's text (else the router does not parse the body)

    def __init__(self) -> None:
        self.matched_chars = 0  # cache_aware's prefix matches, in characters (0 for the others)
        self.request_chars = 0  # characters of every routed text
        self.decisions: dict[str, int] = {}

    def choose(self, text: str, workers: list[str], loads: dict[str, int]) -> str:
        raise NotImplementedError

    def remove_worker(self, worker: str) -> None:
        """`worker` went away (unhealthy): forget what it was thought to hold."""

    def evict(self) -> int:
        return 0

    def _count(self, decision: str, text: str, matched: int = 0) -> None:
        self.decisions[decision] = self.decisions.get(decision, 0) + 1
        self.request_chars += len(text)
        self.matched_chars += matched

    @property
    def prefix_match_rate(self) -> float:
        """Matched characters over routed characters since start (what the tree predicted to be cached)."""
        return self.matched_chars / self.request_chars if self.request_chars else 0.0


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self._next = 0

    def choose(self, text: str, workers: list[str], loads: dict[str, int]) -> str:
        worker = workers[self._next % len(workers)]
        self._next += 1
        self._count("round_robin", text)
        return worker


def _least_loaded(workers: list[str], loads: dict[str, int], turn: int) -> str:
    """The worker with the fewest in flight; ties rotate with `turn` so an idle pool is not all worker 0."""
    low = min(loads.get(w, 0) for w in workers)
    tied = [w for w in workers if loads.get(w, 0) == low]
    return tied[turn % len(tied)]


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self) -> None:
        super().__init__()
        self._turn = 0

    def choose(self, text: str, workers: list[str], loads: dict[str, int]) -> str:
        self._turn += 1
        self._count("least_load", text)
        return _least_loaded(workers, loads, self._turn)


class CacheAware(Policy):
    name = "cache_aware"
    uses_text = True

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        super().__init__()
        self.config = config or CacheAwareConfig()
        self.config.validate()
        self.eviction_interval_secs = self.config.eviction_interval_secs
        self.tree = RadixTree()
        self._turn = 0

    def imbalanced(self, workers: list[str], loads: dict[str, int]) -> bool:
        values = [loads.get(w, 0) for w in workers]
        high, low = max(values), min(values)
        cfg = self.config
        return high - low > cfg.balance_abs_threshold and high > cfg.balance_rel_threshold * low

    def choose(self, text: str, workers: list[str], loads: dict[str, int]) -> str:
        self._turn += 1
        matched, holders = self.tree.prefix_match(text, workers)
        if len(workers) > 1 and self.imbalanced(workers, loads):
            worker, decision = _least_loaded(workers, loads, self._turn), "balance"
        elif text and matched / len(text) > self.config.cache_threshold:
            worker, decision = _least_loaded(holders, loads, self._turn), "cache_hit"
        else:
            smallest = min(self.tree.size(w) for w in workers)
            worker = _least_loaded([w for w in workers if self.tree.size(w) == smallest], loads, self._turn)
            decision = "smallest_tree"
        # What the chosen worker will find cached, as far as the tree knows (0 if it holds none of it).
        found = matched if worker in holders else self.tree.prefix_match(text, [worker])[0]
        self.tree.insert(text, worker)
        self._count(decision, text, found)
        return worker

    def remove_worker(self, worker: str) -> None:
        self.tree.remove_tenant(worker)

    def evict(self) -> int:
        return self.tree.evict(self.config.max_tree_size)


def make_policy(name: str, config: CacheAwareConfig | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(config)
    raise ValueError(f"--policy {name!r} is not one of {', '.join(POLICIES)}")
