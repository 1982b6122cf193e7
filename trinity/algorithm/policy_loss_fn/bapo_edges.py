"""Counting candidate bounds at or below each token's ratio, fast and exactly.

This is the one per-token step of BAPO's search whose cost depends on the grid.
``torch.searchsorted`` does it with a branchy binary search, which took more than half of the
search's time on CPU. The candidate bounds come from one or two regular grids, so a table over
small equal cells answers most tokens with one lookup; two comparisons with the neighbouring
edges then make the count exact.
"""

from typing import Dict, List, Tuple

import torch

MAX_CELLS = 1 << 16  # beyond this (a tiny gap, e.g. a capped last step) the binary search is used


class EdgeCounter:
    """``count(x)`` equals ``torch.searchsorted(edges, x, right=True)`` for float64 ``x``.

    Cells are no wider than half the smallest gap between edges, so a cell holds at most one
    edge, and ``x``'s cell gives the count up to that edge. Rounding in the cell index can put
    ``x`` one cell off, which can miss one edge below ``x`` or count one above it: one
    comparison each way corrects both.
    """

    def __init__(self, edges: List[float]):
        self.edges = torch.tensor(edges, dtype=torch.float64)
        self.width = min(b - a for a, b in zip(edges, edges[1:])) / 2
        self.origin = edges[0] - self.width
        self.cells = int((edges[-1] - self.origin) / self.width) + 3
        self._tables: Dict[str, Tuple[torch.Tensor, ...]] = {}

    def _tables_on(self, device: torch.device) -> Tuple[torch.Tensor, ...]:
        """(edges, count at each cell's left end, next edge, previous edge), once per device."""
        key = str(device)
        if key not in self._tables:
            left = torch.arange(self.cells, dtype=torch.float64) * self.width + self.origin
            inf = torch.tensor([float("inf")], dtype=torch.float64)
            tables = (
                self.edges,
                torch.searchsorted(self.edges, left, right=True),
                torch.cat([self.edges, inf]),  # entry k: the smallest edge not in count k
                torch.cat([-inf, self.edges]),  # entry k: the largest edge in count k
            )
            self._tables[key] = tuple(t.to(device) for t in tables)
        return self._tables[key]

    def edges_on(self, device: torch.device) -> torch.Tensor:
        """The edges as a float64 tensor on ``device``."""
        return self._tables_on(device)[0]

    def count(self, x: torch.Tensor) -> torch.Tensor:
        edges, at_cell, next_edge, prev_edge = self._tables_on(x.device)
        if self.cells > MAX_CELLS:
            return torch.searchsorted(edges, x, right=True)
        scratch = (x - self.origin).mul_(1.0 / self.width).floor_().clamp_(0, self.cells - 1)
        counts = at_cell.index_select(0, scratch.long())
        torch.index_select(next_edge, 0, counts, out=scratch)
        counts += x >= scratch  # an edge <= x that the cell left out
        torch.index_select(prev_edge, 0, counts, out=scratch)
        counts += x >= scratch  # 0 where the cell counted an edge > x, else 1 ...
        return counts.sub_(1)  # ... taken back here
