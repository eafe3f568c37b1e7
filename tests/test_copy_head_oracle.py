"""reproduce/copy_head_oracle.py: its greedy acceptance and its hindsight dynamic program."""
import itertools
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reproduce"))
from copy_head_oracle import cheapest, tree_accepted, walk  # noqa: E402

from dart_lab.acceptance import greedy_accept  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def test_tree_accepted_is_the_longest_path_the_answer_follows():
    tree = Tree.from_paths(7, [[1, 2, 3], [1, 4], [5]])
    assert tree_accepted(tree, [1, 4, 9]) == 2
    assert tree_accepted(tree, [1, 2, 3, 3]) == 3
    assert tree_accepted(tree, [5, 1]) == 1
    assert tree_accepted(tree, [9]) == 0
    assert tree_accepted(Tree.single(7), [1]) == 0
    for future in ([1, 4, 9], [1, 2, 3, 3], [5, 1], [9]):  # = the engine's greedy acceptance, answer as argmax
        logits = torch.nn.functional.one_hot(torch.tensor([(future + [0] * 4)[d] for d in tree.depths.tolist()]), 10).float()
        assert tree_accepted(tree, future) == len(greedy_accept(tree, logits)[0]) - 1


def test_hindsight_program_is_the_minimum_over_every_sequence_of_steps():
    """The dynamic program equals brute force over every way through, and no online walk beats it."""
    rng = np.random.default_rng(0)
    cost = {"verify_ms": {1: 1.0}}  # no context growth: curve_at returns it as is
    for _ in range(30):
        n = int(rng.integers(1, 7))
        rows = [{"ctx": 10 + j, "opts": [(1, float(rng.uniform(1, 3)))] +
                 [(int(rng.integers(1, 4)), float(rng.uniform(1, 6))) for _ in range(2)]} for j in range(n)]
        opts = lambda r, c: r["opts"]  # noqa: E731

        def brute(j):
            if j >= n:
                return 0.0
            return min(ms + brute(j + adv) for adv, ms in rows[j]["opts"])
        best = cheapest(rows, cost, opts)
        assert np.isclose(best, brute(0))
        for pick in itertools.product(range(3), repeat=2):  # online rules that pick by position parity
            assert walk(rows, cost, lambda r, c: r["opts"][pick[r["ctx"] % 2]]) >= best - 1e-9
