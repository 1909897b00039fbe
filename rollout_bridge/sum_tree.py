"""A sum tree over non-negative weights: O(log n) update and proportional draw.

Leaves hold the weights; each inner node holds the sum of its two children (recomputed
from the children on every update, so repeated updates never accumulate rounding drift).
``draw(u)`` with u uniform in [0, total) walks down from the root: the leaf reached is
index i with probability w_i / total. Successive draws with the drawn leaf's weight set to
0 in between are sampling without replacement with each draw ∝ w (SPEC 3's law, the same
as Gumbel top-k).

The nodes are built with NumPy (vectorised per level) and then held as a Python list of
floats in a contiguous ``array.array("d")``: the per-request walks touch ~2·log2(n)
scalars, and its index is several times cheaper than a NumPy scalar index and more
cache-friendly than a list of float objects (the same float64 sums either way).
"""

from __future__ import annotations

import array

import numpy as np


class SumTree:
    def __init__(self, weights: np.ndarray):
        weights = np.asarray(weights, np.float64)
        if weights.ndim != 1 or weights.size == 0:
            raise ValueError(f"weights must be a non-empty 1-D array, got shape {weights.shape}")
        if not np.all(np.isfinite(weights) & (weights >= 0)):
            raise ValueError("weights must be finite and >= 0")
        self.size = weights.size
        self.capacity = 1 << max(0, (self.size - 1).bit_length())
        nodes = np.zeros(2 * self.capacity, np.float64)
        nodes[self.capacity:self.capacity + self.size] = weights
        for level_start in _levels(self.capacity):  # bottom-up, vectorised per level
            end = 2 * level_start
            nodes[level_start:end] = nodes[2 * level_start:2 * end:2] + nodes[2 * level_start + 1:2 * end:2]
        self.nodes = array.array("d", nodes.tobytes())

    @property
    def total(self) -> float:
        return self.nodes[1]  # the root (the only leaf when capacity is 1)

    def weight(self, index: int) -> float:
        return self.nodes[self.capacity + index]

    def update(self, index: int, weight: float) -> None:
        """Set leaf ``index`` to ``weight``; recompute its ancestors (O(log n))."""
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} outside [0, {self.size})")
        nodes = self.nodes
        node = self.capacity + index
        nodes[node] = float(weight)
        node >>= 1
        while node >= 1:
            nodes[node] = nodes[2 * node] + nodes[2 * node + 1]
            node >>= 1

    def find(self, mass: float) -> int:
        """The leaf whose cumulative-weight interval holds ``mass`` in [0, total)."""
        nodes, node = self.nodes, 1
        while node < self.capacity:
            left = nodes[2 * node]
            if mass < left:
                node = 2 * node
            else:
                mass -= left
                node = 2 * node + 1
        index = node - self.capacity
        if index >= self.size or nodes[node] <= 0:  # rounding at an interval's edge: step back
            index = self._last_positive_before(min(index, self.size - 1))
        return index

    def _last_positive_before(self, index: int) -> int:
        leaves = np.asarray(self.nodes[self.capacity:self.capacity + self.size])
        positive = np.flatnonzero(leaves[:index + 1] > 0)
        if positive.size:
            return int(positive[-1])
        return int(np.flatnonzero(leaves > 0)[0])

    def draw(self, rng: np.random.Generator) -> int:
        """One leaf, index i with probability w_i / total (total must be > 0)."""
        total = self.nodes[1]
        if not total > 0:
            raise ValueError("cannot draw from a sum tree of total weight 0")
        return self.find(rng.random() * total)


def _levels(capacity: int):
    """Start index of each inner level, deepest first (capacity/2, ..., 2, 1)."""
    start = capacity // 2
    while start >= 1:
        yield start
        start //= 2
