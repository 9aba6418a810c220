"""Known-wrong answers to exercise 13 (a router of your own: overloaded workers, the prefix tree, the decision):
see tests/known_wrong/__init__.py.

Besides the bugs of each piece, chapter 13's printed SGLang rule (`CacheAware.imbalanced`, `.choose`)
transcribed for the old tasks fails: the busiest worker's test is not the set of overloaded workers, and
balancing every request once the loads are uneven is not the exercise's rule."""

from known_wrong import Mutant, reads_the_checks_frame, source_reexecuted

OVERLOADED = ("return {w for w, load in loads.items() if load - idlest > abs_threshold "
              "and load > rel_threshold * idlest}")
# Chapter 13's CacheAware.imbalanced, retyped for task 1: everybody is "overloaded" or nobody.
CHAPTER_IMBALANCED = """
def overloaded(loads, abs_threshold, rel_threshold):
    values = list(loads.values())
    high, low = max(values), min(values)
    if high - low > abs_threshold and high > rel_threshold * low:
        return {w for w, load in loads.items() if load == high}
    return set()
"""
# Chapter 13's CacheAware.choose, retyped on the learner's tree: balance outright when imbalanced.
CHAPTER_CHOOSE = """
class MatchOrBalance:
    def __init__(self, config):
        self.config, self.tree = config, PrefixTree()
    def choose(self, text, workers, loads):
        cfg = self.config
        least = lambda among: min(among, key=lambda w: loads.get(w, 0))
        values = [loads.get(w, 0) for w in workers]
        matched, holders = self.tree.match(text, workers)
        if len(workers) > 1 and max(values) - min(values) > cfg.balance_abs_threshold \\
                and max(values) > cfg.balance_rel_threshold * min(values):
            worker = least(workers)
        elif text and matched / len(text) > cfg.cache_threshold:
            worker = least(holders)
        else:
            smallest = min(self.tree.size(w) for w in workers)
            worker = least([w for w in workers if self.tree.size(w) == smallest])
        self.tree.insert(text, worker)
        return worker
    def evict(self):
        return self.tree.evict(self.config.max_tree_size)
"""
LEAST_LOAD = """
class MatchOrBalance:
    def __init__(self, config):
        self.config, self.tree = config, PrefixTree()
    def choose(self, text, workers, loads):
        chosen = min(workers, key=lambda w: loads.get(w, 0))
        self.tree.insert(text, chosen)
        return chosen
    def evict(self):
        return self.tree.evict(self.config.max_tree_size)
"""
DELEGATES = """
from minillm.router.policies import CacheAware as _Ref
class MatchOrBalance:
    def __init__(self, config):
        self._ref = _Ref(config)
        self.config, self.tree = config, PrefixTree()
    def choose(self, text, workers, loads):
        worker = self._ref.choose(text, workers, loads)
        self.tree.insert(text, worker)
        return worker
    def evict(self):
        self._ref.evict()
        return self.tree.evict(self.config.max_tree_size)
"""
TREE_WRAPS_RADIX = """
from minillm.router.radix import RadixTree as _Radix
class PrefixTree:
    def __init__(self):
        self._t = _Radix()
    def insert(self, text, worker):
        self._t.insert(text, worker)
    def match(self, text, workers):
        return self._t.prefix_match(text, workers)
    def size(self, worker):
        return self._t.size(worker)
    def evict(self, max_chars):
        return self._t.evict(max_chars)
"""
NO_SKIP = (("open_workers = [w for w in workers if w not in busy]", "open_workers = list(workers)"),)

KNOWN_WRONG = [
    # task 1: the overloaded workers
    Mutant(1, "thresholds swapped (the relative one on the difference, the absolute one on the ratio)",
           edits=((OVERLOADED, "return {w for w, load in loads.items() if load - idlest > rel_threshold "
                               "and load > abs_threshold * idlest}"),), expect="both must hold"),
    Mutant(1, "either threshold is enough (or instead of and)",
           edits=(("> abs_threshold and load", "> abs_threshold or load"),), expect="both must hold"),
    Mutant(1, "at the threshold counts as over (>= instead of >)",
           edits=((OVERLOADED, "return {w for w, load in loads.items() if load - idlest >= abs_threshold "
                               "and load >= rel_threshold * idlest}"),), expect="both must hold"),
    Mutant(1, "measured against the busiest worker instead of the idlest",
           edits=(("idlest = min(loads.values())", "idlest = max(loads.values())"),), expect="expected"),
    Mutant(1, "transcribes chapter 13's imbalanced(): only the busiest, and only when the whole pool is imbalanced",
           code=CHAPTER_IMBALANCED, expect="expected"),
    Mutant(1, "delegates to CacheAware.imbalanced", code=(
        "from minillm.router.policies import CacheAware as _Ref, CacheAwareConfig as _Cfg\n"
        "def overloaded(loads, abs_threshold, rel_threshold):\n"
        "    ref = _Ref(_Cfg(balance_abs_threshold=abs_threshold, balance_rel_threshold=rel_threshold))\n"
        "    return {w for w in loads if ref.imbalanced([w, min(loads, key=loads.get)], loads)}\n"),
        expect="reference"),
    reads_the_checks_frame(1, "def overloaded(loads, abs_threshold, rel_threshold):\n    return _expected()\n"),
    # task 2: the prefix tree
    Mutant(2, "no split: a text that leaves an edge in its middle gets a sibling edge",
           edits=(("            if shared < len(child[\"label\"]):  # split the edge", "            if False:  # split the edge"),
                  ("            node, rest = child, rest[shared:]\n",
                   "            if shared < len(child[\"label\"]):\n"
                   "                child = node[\"kids\"][rest[0] + \"#\" + str(self.time)] = "
                   "{\"label\": rest, \"parent\": node, \"kids\": {}, \"stamp\": {worker: self.time}}\n"
                   "                self.chars[worker] += len(rest)\n                break\n"
                   "            node, rest = child, rest[shared:]\n")),
           expect="expected"),
    Mutant(2, "sizes count every insert, not each node once",
           edits=(("            if worker not in child[\"stamp\"]:\n                self.chars[worker] += len(child[\"label\"])\n",
                   "            self.chars[worker] += len(child[\"label\"])\n"),), expect="size("),
    Mutant(2, "match ignores which workers it is asked about",
           edits=(("owners = sorted(w for w in node[\"stamp\"] if w in workers)", "owners = sorted(node[\"stamp\"])"),),
           expect="match returned"),
    Mutant(2, "match counts a whole edge when the text leaves it in its middle",
           edits=(("length, holders = length + shared, owners", "length, holders = length + len(node[\"label\"]), owners"),),
           expect="match returned"),
    Mutant(2, "evict drops the most recently used leaf first",
           edits=(("oldest = min(leaves, key=lambda n: n[\"stamp\"][worker])",
                   "oldest = max(leaves, key=lambda n: n[\"stamp\"][worker])"),), expect="expected"),
    Mutant(2, "evict drops the oldest node, a leaf or not",
           edits=(("                leaves = [n for n in nodes if worker in n[\"stamp\"]\n"
                   "                          and not any(worker in kid[\"stamp\"] for kid in n[\"kids\"].values())]\n",
                   "                leaves = [n for n in nodes if worker in n[\"stamp\"]]\n"),), expect="expected"),
    Mutant(2, "evict returns nothing", edits=(("        return dropped\n", "        return None\n"),),
           expect="evict returned None"),
    Mutant(2, "evict counts what it dropped for the last worker only",
           edits=(("        for worker in list(self.chars):\n", "        for worker in list(self.chars):\n            dropped = 0\n"),),
           expect="evict returned"),
    Mutant(2, "delegates to minillm's RadixTree", code=TREE_WRAPS_RADIX, expect="reference"),
    source_reexecuted(2, "PrefixTree", "minillm.router.radix", "RadixTree", keyword="class"),
    # task 3: the decision, then the trace
    Mutant(3, "transcribes chapter 13's CacheAware.choose: balances outright when the pool is imbalanced",
           code=CHAPTER_CHOOSE, expect="overloaded worker elsewhere"),
    Mutant(3, "matches among all workers, overloaded ones included", edits=NO_SKIP, expect="you chose"),
    Mutant(3, "pure least-load: ignores the prefixes", code=LEAST_LOAD, expect="cache_threshold"),
    Mutant(3, "evict() forgets to return what the tree dropped",
           edits=(("        return self.tree.evict(self.config.max_tree_size)\n",
                   "        self.tree.evict(self.config.max_tree_size)\n"),), expect="evict() returned None"),
    Mutant(3, "a tree never evicted", edits=(("        return self.tree.evict(self.config.max_tree_size)\n",
                                              "        return 0\n"),), expect="evict() returned 0"),
    Mutant(3, "a match at the threshold counts (>= instead of >)",
           edits=(("matched / len(text) > cfg.cache_threshold", "matched / len(text) >= cfg.cache_threshold"),),
           expect="not above cache_threshold"),
    Mutant(3, "the least loaded of all open workers on a match, not of the holders",
           edits=(("chosen = least_loaded(holders)", "chosen = least_loaded(open_workers)"),),
           expect="holding the longest match"),
    Mutant(3, "never inserts: the tree stays empty", edits=(("        self.tree.insert(text, chosen)\n", ""),),
           expect="inserted under the chosen worker"),
    Mutant(3, "minillm's RadixTree as the router's tree", code="MatchOrBalance.__init__ = lambda self, config: "
           "(setattr(self, 'config', config), setattr(self, 'tree', __import__('minillm.router.radix', "
           "fromlist=['RadixTree']).RadixTree()))[0]\n", expect="reference"),
    Mutant(3, "delegates to minillm's CacheAware", code=DELEGATES, expect="reference"),
    source_reexecuted(3, "MatchOrBalance", "minillm.router.policies", "CacheAware", keyword="class"),
]
