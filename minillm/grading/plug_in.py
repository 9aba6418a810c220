"""A check shared by the exercises whose task plugs the learner's part into `LLM` (ex04-ex06, chapters
04-06): the knobs the learner's `make_learner_llm(**knobs)` is given reach the engine."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from minillm.grading import Fail, grade_time_seeds


def knobs_reach_the_engine(make_llm: Callable[..., Any], knobs: dict, yours: Callable[[Any], bool]) -> None:
    """Build a second LLM with `knobs` but a batch size drawn now: the size must reach the engine, and
    `yours(llm)` (the learner's part is in it) must hold."""
    sizes = [n for n in range(2, 8) if n != knobs.get("max_num_seqs")]  # never the check's own: hard-coded knobs fail
    knobs = dict(knobs, max_num_seqs=random.Random(grade_time_seeds(1)[0]).choice(sizes))
    other = make_llm(**knobs)
    if other.engine.config.max_num_seqs != knobs["max_num_seqs"] or not yours(other):
        raise Fail(f"make_learner_llm(max_num_seqs={knobs['max_num_seqs']}, ...) (a size drawn now) built an engine "
                   f"with max_num_seqs={other.engine.config.max_num_seqs}: pass every knob on, and plug in your part")
