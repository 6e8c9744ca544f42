"""DDTree scoring: the tree is the `budget` likeliest prefixes of the per-slot candidates, closed under
prefixes, and greedy verification accepts the longest path equal to the target's continuation."""

from __future__ import annotations

import itertools
import math
import random

from regen.evaluate import report
from regen.evaluate.tree import accepted_depth, build_tree

CANDS = [[(1, 0.9), (2, 0.1)], [(3, 0.6), (4, 0.4)], [(5, 0.5), (6, 0.5)]]


def test_tree_takes_the_likeliest_prefixes_in_order() -> None:
    assert build_tree(CANDS, 1) == {(1,)}
    assert build_tree(CANDS, 3) == {(1,), (1, 3), (1, 4)}  # .9, .54, .36
    assert build_tree(CANDS, 4) == {(1,), (1, 3), (1, 4), (1, 3, 5)} or build_tree(CANDS, 4) == {
        (1,),
        (1, 3),
        (1, 4),
        (1, 3, 6),
    }
    assert len(build_tree(CANDS, 100)) == 2 + 4 + 8  # every prefix, once


def test_tree_matches_brute_force_and_is_prefix_closed() -> None:
    rng = random.Random(0)
    for _ in range(30):
        slots = [
            sorted(((t, rng.random()) for t in rng.sample(range(50), 3)), key=lambda x: -x[1])
            for _ in range(4)
        ]
        budget = rng.randrange(1, 30)
        tree = build_tree(slots, budget)
        assert len(tree) == budget and all(p[:-1] in tree for p in tree if len(p) > 1)
        scores = {}
        for depth in range(1, 5):
            for picks in itertools.product(range(3), repeat=depth):
                prefix = tuple(slots[i][k][0] for i, k in enumerate(picks))
                scores[prefix] = math.prod(slots[i][k][1] for i, k in enumerate(picks))
        worst_in = min(scores[p] for p in tree)
        best_out = max(s for p, s in scores.items() if p not in tree)
        assert worst_in >= best_out


def test_accepted_depth_is_the_longest_matching_path() -> None:
    tree = build_tree(CANDS, 4)
    assert accepted_depth(tree, [1, 3, 5]) in (2, 3)
    assert accepted_depth(tree, [1, 4, 6]) == 2
    assert accepted_depth(tree, [2, 3, 5]) == 0
    assert accepted_depth(build_tree(CANDS, 100), [2, 4, 6]) == 3


def test_report_carries_tree_acceptance_per_budget() -> None:
    base = {"prompt_id": "a", "category": None, "tokens": 3, "seconds": 1, "plain_tokens": 3}
    base.update(plain_seconds=1, lossless=True)
    rows = [
        dict(base, drafter="trained", accepted=[0, 1], tree={"4": [1, 2], "16": [2, 3]}),
        dict(base, drafter="untrained", accepted=[0, 0], tree={"4": [0, 0], "16": [0, 1]}),
    ]
    doc = report.build_report(rows, block_size=16, settings={}, inputs={})
    assert doc["tree"]["measured"] is True
    assert doc["tree"]["budgets"]["4"]["trained"]["acceptance_length"] == 2.5
    assert doc["tree"]["budgets"]["16"]["untrained"]["acceptance_length"] == 1.5
    text = report.render_markdown(doc, [])
    assert "| chain | 1.50 | 1.00 |" in text and "| 16 | 3.50" in text
