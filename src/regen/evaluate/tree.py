"""DDTree-style tree drafting, scored for greedy verification (Ringel & Romano, "Accelerating Speculative
Decoding with Block Diffusion Draft Trees").

A DFlash drafter scores every block slot in one forward, so each slot has its own distribution over the
vocabulary. A draft tree spends a node budget on the likeliest *prefixes*: a prefix's score is the product
of its tokens' per-slot probabilities, and the tree is the `budget` best-scoring prefixes (best-first from
the root; a child never outscores its parent, so the set is closed under prefixes). Greedy verification of
the tree accepts the longest path that matches the target's own greedy continuation, plus the bonus token.

Given the target's greedy continuation (known here: speculative decoding is lossless, so it is what plain
decoding produced), the accepted depth follows from the tree alone; no tree-attention kernel is needed to
know what tree verification *would* accept. Pure functions over plain lists (torch only supplies top-k).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

BUDGETS = (4, 16, 64)


def build_tree(candidates: Sequence[Sequence[tuple[int, float]]], budget: int) -> set[tuple[int, ...]]:
    """The `budget` best prefixes (as token tuples) from per-slot candidates [(token, prob), ...] sorted by
    probability, best first. Ties keep the earlier-found prefix, so the result is deterministic."""
    chosen: set[tuple[int, ...]] = set()
    if not candidates or budget < 1 or not candidates[0]:
        return chosen

    def cost(picks: tuple[int, ...]) -> float:
        """-log of the prefix's score; a zero-probability token makes it the last resort."""
        probs = [candidates[slot][pick][1] for slot, pick in enumerate(picks)]
        return math.inf if min(probs) <= 0 else -sum(math.log(p) for p in probs)

    # Best-first over prefixes, each named by the candidate index it uses at every slot. A popped prefix
    # offers its next sibling and its best child: every prefix has exactly one such predecessor, so each
    # is pushed once and they come out in order of score.
    heap: list[tuple[float, int, tuple[int, ...]]] = [(cost((0,)), 0, (0,))]
    pushed = 1
    while heap and len(chosen) < budget:
        _, _, picks = heapq.heappop(heap)
        chosen.add(tuple(candidates[slot][pick][0] for slot, pick in enumerate(picks)))
        depth = len(picks)
        successors = []
        if picks[-1] + 1 < len(candidates[depth - 1]):
            successors.append((*picks[:-1], picks[-1] + 1))
        if depth < len(candidates) and candidates[depth]:
            successors.append((*picks, 0))
        for nxt in successors:
            heapq.heappush(heap, (cost(nxt), pushed, nxt))
            pushed += 1
    return chosen


def accepted_depth(tree: set[tuple[int, ...]], continuation: Sequence[int]) -> int:
    """How many draft tokens greedy verification accepts: the longest prefix of the target's continuation
    that is a path of the tree."""
    depth = 0
    while depth < len(continuation) and tuple(continuation[: depth + 1]) in tree:
        depth += 1
    return depth
