"""Tree structure invariants: the attention mask is the ancestor closure (checked with networkx)."""
import networkx as nx
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
