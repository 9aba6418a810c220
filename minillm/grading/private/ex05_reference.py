"""Exercise 05's references (chapter 05: paged KV), private to its grader (see the package docstring).

Variants chapter 05 does not show: an allocator that hands out the lowest-numbered free block
(task 1) and a block table that is a ring of at most `max_blocks` blocks, as sliding-window attention
needs (task 2). (Task 4's expected matrix, a loop the task forbids, stays in the grader.)
Written unlike a learner's answer on purpose: the copy detector compares learner code with them.
"""

from __future__ import annotations


class LowestFirstAllocator:
    """Reference counts, and a free flag per block: allocate takes the lowest free block."""

    def __init__(self, num_blocks):
        self.ref_counts = [0] * num_blocks
        self.is_free = [True] * num_blocks

    @property
    def free_ids(self):
        return [block for block, free in enumerate(self.is_free) if free]

    def allocate(self):
        if True not in self.is_free:
            raise RuntimeError("no free block")
        block = self.is_free.index(True)
        self.is_free[block], self.ref_counts[block] = False, 1
        return block

    def share(self, block):
        self.ref_counts[block] = self.ref_counts[block] + 1

    def release(self, block, keep_cached=False):
        if not self.ref_counts[block]:
            raise RuntimeError(f"block {block} released more often than allocated")
        self.ref_counts[block] = self.ref_counts[block] - 1
        self.is_free[block] = self.ref_counts[block] == 0


def ring_length(num_tokens, block_size, max_blocks):
    """How many blocks a ring table holding `num_tokens` tokens has."""
    return min(max_blocks, (num_tokens + block_size - 1) // block_size)


def ring_slot(table, position, block_size):
    """The slot of `position` in a ring table: logical block i lives in table[i mod len(table)]."""
    logical, offset = divmod(position, block_size)
    return table[logical % len(table)] * block_size + offset
