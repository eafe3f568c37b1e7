"""Test-only drafters: an oracle that knows the AR continuation and a random one."""
import torch

from dart_lab import Drafter, Tree


class OracleDrafter(Drafter):
    """Proposes the true continuation (depth `depth`) plus random distractor branches."""

    name = "oracle"

    def __init__(self, reference: list[int], vocab: int, depth: int = 4, seed: int = 0):
        super().__init__()
        self.reference, self.vocab, self.depth = reference, vocab, depth
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, ids):
        truth = self.reference[len(ids):len(ids) + self.depth]
        noise = torch.randint(0, self.vocab, (3, self.depth), generator=self.g).tolist()
        # distractors first so the accepted path is not always child 0
        return Tree.from_paths(ids[-1], noise[:2] + [truth] + noise[2:])


class RandomDrafter(Drafter):
    """A random tree of random tokens: almost nothing is accepted, the bonus token carries decoding."""

    name = "random"

    def __init__(self, vocab: int, n_nodes: int = 12, seed: int = 0):
        super().__init__()
        self.vocab, self.n_nodes = vocab, n_nodes
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, ids):
        n = int(torch.randint(1, self.n_nodes + 1, (), generator=self.g))
        parents = [-1] + [int(torch.randint(0, i, (), generator=self.g)) for i in range(1, n)]
        tokens = [ids[-1]] + torch.randint(0, self.vocab, (n - 1,), generator=self.g).tolist()
        return Tree(torch.tensor(tokens), torch.tensor(parents))
