"""A list of numbers with range additions and range maxima in O(log n): the scheduler's
live bytes per slot (order.py), updated by a merge's few lifetime changes instead of a
re-simulation of the whole schedule."""

from __future__ import annotations


class RangeMax:
    """Values v[0..n) with `add(first, last, delta)` (to v[first..last]) and `max(first, last)`."""

    def __init__(self, values: list[int]):
        self.size = 1
        while self.size < max(1, len(values)):
            self.size *= 2
        self.best = [0] * (2 * self.size)  # max of a node's range, its own pending addition included
        self.pending = [0] * (2 * self.size)  # added to every value under the node
        self.best[self.size : self.size + len(values)] = values
        for node in range(self.size - 1, 0, -1):
            self.best[node] = max(self.best[2 * node], self.best[2 * node + 1])

    def add(self, first: int, last: int, delta: int) -> None:
        if first <= last and delta:
            self._add(1, 0, self.size - 1, first, last, delta)

    def _add(self, node: int, low: int, high: int, first: int, last: int, delta: int) -> None:
        if last < low or high < first:
            return
        if first <= low and high <= last:
            self.best[node] += delta
            self.pending[node] += delta
            return
        middle = (low + high) // 2
        self._add(2 * node, low, middle, first, last, delta)
        self._add(2 * node + 1, middle + 1, high, first, last, delta)
        self.best[node] = max(self.best[2 * node], self.best[2 * node + 1]) + self.pending[node]

    def max(self, first: int, last: int) -> int:
        """The largest of v[first..last]; minus infinity for an empty range."""
        return self._max(1, 0, self.size - 1, first, last) if first <= last else -(1 << 62)

    def _max(self, node: int, low: int, high: int, first: int, last: int) -> int:
        if last < low or high < first:
            return -(1 << 62)
        if first <= low and high <= last:
            return self.best[node]
        middle = (low + high) // 2
        left = self._max(2 * node, low, middle, first, last)
        inner = max(left, self._max(2 * node + 1, middle + 1, high, first, last))
        return inner + self.pending[node]

    def get(self, index: int) -> int:
        return self.max(index, index)

    def set(self, index: int, value: int) -> None:
        self.add(index, index, value - self.get(index))

    def values(self) -> list[int]:
        return [self.get(i) for i in range(self.size)]
