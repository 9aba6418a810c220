"""Known-wrong answers to exercise 13 (cache-aware routing, match or balance): see tests/known_wrong/__init__.py."""

from known_wrong import Mutant, reads_the_checks_frame, source_reexecuted

NO_BALANCE = (("        if len(workers) > 1 and imbalanced(", "        if False and imbalanced("),)
LEAST_LOAD = ("class MatchOrBalance:\n"
              "    def __init__(self, config):\n"
              "        self.config, self.tree = config, RadixTree()\n"
              "    def choose(self, text, workers, loads):\n"
              "        chosen = min(workers, key=lambda w: loads.get(w, 0))\n"
              "        self.tree.insert(text, chosen)\n"
              "        return chosen\n"
              "    def evict(self):\n"
              "        return self.tree.evict(self.config.max_tree_size)\n")
DELEGATES = ("from minillm.router.policies import CacheAware as _Ref\n"
             "class MatchOrBalance:\n"
             "    def __init__(self, config):\n"
             "        self._ref = _Ref(config)\n"
             "        self.config, self.tree = config, self._ref.tree\n"
             "    def choose(self, text, workers, loads):\n"
             "        return self._ref.choose(text, workers, loads)\n"
             "    def evict(self):\n"
             "        return self._ref.evict()\n")
CODE_REUSED = ("import types as _types\n"
               "from minillm.router import policies as _lib\n"
               "class MatchOrBalance:\n"
               "    def __init__(self, config):\n"
               "        self.config, self.tree, self._turn = config, RadixTree(), 0\n"
               "        self.matched_chars = self.request_chars = 0\n"
               "        self.decisions = {}\n"
               "    choose = _types.FunctionType(_lib.CacheAware.choose.__code__, vars(_lib), 'choose')\n"
               "    def imbalanced(self, workers, loads):\n"
               "        return imbalanced([loads.get(w, 0) for w in workers], self.config.balance_abs_threshold,\n"
               "                          self.config.balance_rel_threshold)\n"
               "    def _count(self, decision, text, matched=0):\n"
               "        pass\n"
               "    def evict(self):\n"
               "        return self.tree.evict(self.config.max_tree_size)\n")

KNOWN_WRONG = [
    # task 1: the imbalance test
    Mutant(1, "balance thresholds inverted (the relative one on the difference, the absolute one on the ratio)",
           edits=(("return busiest - idlest > abs_threshold and busiest > rel_threshold * idlest",
                   "return busiest - idlest > rel_threshold and busiest > abs_threshold * idlest"),),
           expect="both must hold"),
    Mutant(1, "either threshold is enough (or instead of and)",
           edits=(("> abs_threshold and busiest", "> abs_threshold or busiest"),), expect="both must hold"),
    Mutant(1, "at the threshold counts as over (>= instead of >)",
           edits=(("return busiest - idlest > abs_threshold and busiest > rel_threshold * idlest",
                   "return busiest - idlest >= abs_threshold and busiest >= rel_threshold * idlest"),),
           expect="both must hold"),
    Mutant(1, "delegates to CacheAware.imbalanced", code=(
        "from minillm.router.policies import CacheAware as _Ref, CacheAwareConfig as _Cfg\n"
        "def imbalanced(loads, abs_threshold, rel_threshold):\n"
        "    ws = [str(i) for i in range(len(loads))]\n"
        "    return _Ref(_Cfg(balance_abs_threshold=abs_threshold, balance_rel_threshold=rel_threshold))"
        ".imbalanced(ws, dict(zip(ws, loads)))\n"), expect="reference"),
    reads_the_checks_frame(1, "def imbalanced(loads, abs_threshold, rel_threshold):\n    return _expected()\n"),
    # task 2: the decision
    Mutant(2, "pure prefix affinity: no balance rule, the hot prefix piles onto its holder", edits=NO_BALANCE,
           expect="imbalanced: the least loaded worker"),
    Mutant(2, "pure least-load: ignores the prefixes", code=LEAST_LOAD, expect="cache_threshold"),
    Mutant(2, "a tree never evicted", edits=(("return self.tree.evict(self.config.max_tree_size)", "return 0"),),
           expect="was the tree cut back"),
    Mutant(2, "balance thresholds inverted in the call",
           edits=(("imbalanced([loads.get(w, 0) for w in workers], cfg.balance_abs_threshold,\n"
                   "                                           cfg.balance_rel_threshold)",
                   "imbalanced([loads.get(w, 0) for w in workers], cfg.balance_rel_threshold,\n"
                   "                                           cfg.balance_abs_threshold)"),), expect="you chose"),
    Mutant(2, "a match at the threshold counts (>= instead of >)",
           edits=(("matched / len(text) > cfg.cache_threshold", "matched / len(text) >= cfg.cache_threshold"),),
           expect="not above cache_threshold"),
    Mutant(2, "the least loaded of all workers on a match, not of the holders",
           edits=(("chosen = least_loaded(holders)", "chosen = least_loaded(workers)"),), expect="holding the longest match"),
    Mutant(2, "never inserts: the tree stays empty", edits=(("        self.tree.insert(text, chosen)\n", ""),),
           expect="inserted under the chosen worker"),
    Mutant(2, "delegates to minillm's CacheAware", code=DELEGATES, expect="reference"),
    source_reexecuted(2, "MatchOrBalance", "minillm.router.policies", "CacheAware", keyword="class"),
    Mutant(2, "the library's answer under another name: CacheAware.choose's code object reused",
           code=CODE_REUSED, expect="bytecode"),
    # task 3: the trace
    Mutant(3, "pure prefix affinity: the hot tenants pile onto one worker", edits=NO_BALANCE, expect="pile onto"),
    Mutant(3, "pure least-load: balanced, but requests miss their prefix", code=LEAST_LOAD, expect="prefix hit rate"),
    Mutant(3, "delegates to minillm's CacheAware", code=DELEGATES, expect="reference"),
]
