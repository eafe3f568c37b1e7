"""Tree structure invariants: the attention mask is the ancestor closure (checked with networkx)."""
import networkx as nx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_lab import Tree


@st.composite
def random_parents(draw, max_nodes=40):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@given(random_parents())
@settings(max_examples=60, deadline=None)
def test_mask_is_ancestor_closure(parents):
    tree = Tree(torch.arange(len(parents)), torch.tensor(parents))
    g = nx.DiGraph()
    g.add_nodes_from(range(len(parents)))
    g.add_edges_from((p, i) for i, p in enumerate(parents) if p >= 0)
    expected = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        for j in nx.ancestors(g, i) | {i}:
            expected[i, j] = True
    assert torch.equal(tree.ancestor_mask(), expected)
    # depths agree with graph distance from the root, paths end at leaves
    lengths = nx.single_source_shortest_path_length(g, 0)
    assert tree.depths.tolist() == [lengths[i] for i in range(len(parents))]
    assert {p[-1] for p in tree.leaf_paths()} == {i for i in g if g.out_degree(i) == 0}


def test_from_paths_shares_prefixes():
    tree = Tree.from_paths(5, [[1, 2, 3], [1, 2, 4], [6]])
    assert tree.tokens.tolist() == [5, 1, 2, 3, 4, 6]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 2, 0]
    assert sorted(tree.tokens[p].tolist() for p in tree.leaf_paths()) == [[5, 1, 2, 3], [5, 1, 2, 4], [5, 6]]


def test_rejects_non_topological_parents():
    with pytest.raises(ValueError):
        Tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError):
        Tree(torch.tensor([1, 2]), torch.tensor([0, 0]))


@given(st.integers(0, 10_000), st.integers(0, 40), st.booleans(), st.sampled_from([np.float32, np.float64]))
@settings(max_examples=80, deadline=None)
def test_the_compiled_closed_tree_equals_the_numpy_one(seed, max_nodes, monotone, dtype):
    """`dart_lab::closed_tree` (csrc/search.cpp) keeps `best_closed_tree`'s nodes in its order, with its parents,
    scores, ranks and chosen candidates: many equal scores (quantised), budgets below, at and above the number of
    candidates, and scores that rise along a path (a parent outside the first pool: the second pass)."""
    from dart_lab.engine import kernels
    from dart_lab.tree import best_closed_tree

    assert kernels.search_here(), kernels._search.get("reason")
    rng = np.random.default_rng(seed)
    M = int(rng.integers(1, 60))
    parents = np.array([-1 if i == 0 or rng.random() < 0.3 else int(rng.integers(0, i)) for i in range(M)], np.int64)
    depths = np.zeros(M, np.int64)
    for i in range(M):
        depths[i] = 0 if parents[i] < 0 else depths[parents[i]] + 1
    scores = -rng.integers(0, 6, M).astype(dtype)
    if monotone:  # as a search gives them: never above the parent's
        for i in range(M):
            if parents[i] >= 0:
                scores[i] = min(scores[i], scores[parents[i]])
    tokens = rng.integers(0, 1000, M)
    a, ca = best_closed_tree(7, tokens, parents, scores, depths, max_nodes, compiled=True)
    b, cb = best_closed_tree(7, tokens, parents, scores, depths, max_nodes, compiled=False)
    assert np.array_equal(ca, cb)
    for x, y in ((a.tokens, b.tokens), (a.parents, b.parents), (a.scores, b.scores), (a.ranks, b.ranks)):
        assert torch.equal(x, y)
    if monotone:  # the budget filled (a rising path can leave a child behind its parent in the last pass)
        assert len(a) == 1 + min(max_nodes, M)
