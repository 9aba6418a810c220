"""Exercise 08's reference (chapter 08: chunked prefill): the step rules the exercise asks for, variants
of minillm's `ContinuousScheduler` that the chapter did not show. Grader-private: imported only by
minillm.grading.ex08.

- The order: decodes first (admission order), then the other running requests with the fewest missing
  tokens first (shortest remaining prefill first; admission order among equals).
- The budget: as minillm's chunked step, except that a chunk that does not finish its request's prompt
  ends on a KV block boundary (rounded down; a request left with nothing gets no row, and a waiting
  one left with nothing stops the admissions).
- SplitFuse's step: the even share of the prompt pool rounded up to whole blocks, never above the room
  the decodes leave of the target.
"""

from __future__ import annotations

from minillm.request import Request


def _missing(req: Request) -> int:
    return req.num_tokens - req.num_computed_tokens


def _decoding(req: Request) -> bool:
    return _missing(req) == 1 and req.num_computed_tokens > 0


def serve_order(running: list[Request]) -> list[Request]:
    decodes = [req for req in running if _decoding(req)]
    rest = sorted((req for req in running if not _decoding(req)), key=_missing)  # sorted() is stable
    return decodes + rest


def _aligned(req: Request, offer: int, block_size: int) -> int:
    """How many tokens `req` takes when offered `offer`: all it misses, or a chunk ending on a block boundary."""
    if offer >= _missing(req):
        return _missing(req)
    end = (req.num_computed_tokens + offer) // block_size * block_size
    return max(0, end - req.num_computed_tokens)


def fill_budget(running: list[Request], waiting: list[Request], budget: int, threshold: int, max_num_seqs: int,
                block_size: int) -> list[tuple[Request, int]]:
    plan: list[tuple[Request, int]] = []
    left = budget
    cap = threshold if threshold > 0 else budget
    for req in serve_order(running):
        if left <= 0:
            break
        take = _aligned(req, min(left, cap), block_size)
        if take > 0:
            plan.append((req, take))
            left -= take
    seats = max_num_seqs - len(running)
    index = 0
    while left > 0 and seats > 0 and index < len(waiting):
        take = _aligned(waiting[index], min(left, cap), block_size)
        if take == 0:
            break
        plan.append((waiting[index], take))
        left, seats, index = left - take, seats - 1, index + 1
    return plan


def splitfuse_budget(running: list[Request], waiting: list[Request], target: int, max_num_seqs: int,
                     block_size: int) -> int:
    decodes = sum(1 for req in running if _decoding(req))
    pool = sum(_missing(req) for req in running if not _decoding(req))
    seats = max(0, max_num_seqs - len(running))
    pool += sum(_missing(req) for req in list(waiting)[:seats])
    room = target - decodes
    if room <= 0 or pool <= room:
        return target
    passes = (pool + room - 1) // room
    share = (pool + passes - 1) // passes
    share = min(room, (share + block_size - 1) // block_size * block_size)
    return decodes + share


def splitfuse_fill(running: list[Request], waiting: list[Request], target: int, threshold: int, max_num_seqs: int,
                   block_size: int) -> list[tuple[Request, int]]:
    budget = splitfuse_budget(running, waiting, target, max_num_seqs, block_size)
    return fill_budget(running, waiting, budget, threshold, max_num_seqs, block_size)
