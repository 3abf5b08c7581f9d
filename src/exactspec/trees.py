"""Token trees: several drafted continuations scored in one target forward pass.

Source: Miao et al. 2024, "SpecInfer" (arXiv 2305.09781), §3 (token tree verification: one
forward over all nodes, each attending to its own root-to-node path only); Li et al. 2024,
"EAGLE-2" (arXiv 2406.16858), §4 (the tree grown from the draft's own probabilities).
A tree is given by its nodes' parents, every parent before its children (a chain is the
tree whose node i has parent i − 1). The engine's block is ``[last, nodes ...]`` with the
last committed token as the root (row 0); verification walks it from the root
(:func:`exactspec.verification.verify_tree`) and the target keeps the cache rows of the
accepted path only (``Backend.retain``).
"""

from __future__ import annotations

import itertools

import torch


class TreePaths:
    """The paths of a token tree's nodes, in the form the attention kernel reads.

    Args:
        parents: ``[n]`` each node's parent (a smaller index), −1 for a root; nodes in an
            order where every parent comes before its children.
    Attributes:
        paths: ``[n]`` lists: node i's root-to-node path (ascending node indices, i last).
        depths: ``[n]`` each node's depth (0 for a root).
        rows: the paths concatenated (int64); offsets: ``[n + 1]`` where each path starts.
    Raises:
        ValueError: if a parent does not come before its child.
    """

    def __init__(self, parents: list[int]) -> None:
        self.paths: list[list[int]] = []
        for node, parent in enumerate(parents):
            if not -1 <= parent < node:
                raise ValueError(f"node {node}'s parent {parent} must be −1 or an earlier node")
            self.paths.append([node] if parent < 0 else [*self.paths[parent], node])
        self.depths = [len(path) - 1 for path in self.paths]
        self.rows = torch.tensor([row for path in self.paths for row in path], dtype=torch.int64)
        self.offsets = torch.tensor([0, *itertools.accumulate(map(len, self.paths))],
                                    dtype=torch.int64)
