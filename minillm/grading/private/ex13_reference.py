"""Exercise 13's reference (chapter 13: many engines): the routing rule of the exercise, a variant of
SGLang's that the chapter did not show. Grader-private: imported only by minillm.grading.ex13.

SGLang's router gives up prefix affinity for the whole request once the loads are imbalanced. The
exercise's rule only skips the workers that are overloaded (more than `abs` above the idlest and more
than `rel` times its load) and keeps matching among the others.
"""

from __future__ import annotations

from minillm.router.policies import CacheAwareConfig
from minillm.router.radix import RadixTree


def overloaded(loads: dict[str, int], abs_threshold: int, rel_threshold: float) -> set[str]:
    idlest = min(loads.values())
    busy = set()
    for worker in loads:
        above_abs = loads[worker] > idlest + abs_threshold
        above_rel = loads[worker] > rel_threshold * idlest
        if above_abs and above_rel:
            busy.add(worker)
    return busy


def allowed(tree: RadixTree, text: str, workers: list[str], loads: dict[str, int],
            config: CacheAwareConfig) -> tuple[str, set[str]]:
    """The rule that applies and every worker it allows (ties may be broken either way)."""
    def least(among: list[str]) -> set[str]:
        low = min(loads.get(w, 0) for w in among)
        return {w for w in among if loads.get(w, 0) == low}

    busy = overloaded({w: loads.get(w, 0) for w in workers}, config.balance_abs_threshold,
                      config.balance_rel_threshold)
    open_ = [w for w in workers if w not in busy]
    skipped = f" (overloaded, skipped: {sorted(busy)})" if busy else ""
    matched, holders = tree.prefix_match(text, open_)
    if text and matched / len(text) > config.cache_threshold:
        return (f"match rate {matched}/{len(text)} = {matched / len(text):.2f} > cache_threshold "
                f"{config.cache_threshold} among the workers not overloaded{skipped}: the least loaded of those "
                f"holding the longest match {holders}"), least(holders)
    sizes = {w: tree.size(w) for w in open_}
    smallest = min(sizes.values())
    return (f"match rate {matched}/{len(text)} among the workers not overloaded{skipped} not above cache_threshold "
            f"{config.cache_threshold}: the least loaded of those with the smallest tree (tree sizes {sizes})"), \
        least([w for w in open_ if sizes[w] == smallest])


class Router:
    """The rule as a router, on minillm's RadixTree; ties go to the first worker listed."""

    def __init__(self, config: CacheAwareConfig) -> None:
        self.config, self.tree = config, RadixTree()

    def choose(self, text: str, workers: list[str], loads: dict[str, int]) -> str:
        _, allowed_workers = allowed(self.tree, text, workers, loads, self.config)
        worker = next(w for w in workers if w in allowed_workers)
        self.tree.insert(text, worker)
        return worker

    def evict(self) -> int:
        return self.tree.evict(self.config.max_tree_size)
