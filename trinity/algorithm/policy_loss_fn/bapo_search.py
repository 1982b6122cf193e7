"""BAPO's clip-bound search, free of any process-group logic.

The search is split in two pure steps so that data-parallel ranks can meet in between:

1. ``BoundSearch.local_sums`` makes one pass over the tokens and returns, for every candidate
   bound, the positive contribution P (one value per upper candidate) and the negative
   contribution N (one value per lower candidate), plus a count of non-finite tokens, all in one
   float64 vector. P depends only on ``c_high`` and N only on ``c_low`` (see
   ``shared/bapo-notes.md``), so the vector has ``len(upper) + len(lower) + 1`` entries and no
   tokens x candidates tensor is ever built.
2. ``BoundSearch.decide`` walks the candidate path of Algorithm 1 (or the authors' order) on
   the host over those sums. Summing the vectors of several ranks before this step gives the
   decision one process would take on the union of their tokens.
"""

from dataclasses import dataclass
from decimal import Decimal
from typing import List, Tuple

import torch

SEARCH_ORDERS = ("upper_first", "lower_first")
CONTRIBUTIONS = ("surrogate", "gradient")
MAX_CANDIDATES = 10_000  # per range; guards against a step so small the grid explodes


def candidate_grid(start: float, maximum: float, step: float, cap_at_max: bool) -> List[float]:
    """Exact candidates ``start + k * step`` with ``k = 0, 1, ...`` that do not pass ``maximum``.

    Decimal arithmetic on the values as written avoids the float trap (0.6 + 15 * 0.02 must be
    0.90, not 0.8999...). ``cap_at_max`` appends ``maximum`` when it is not on the grid, as the
    authors' ``min(c + step, max)`` update does; Algorithm 1 never overshoots and so never does.
    """
    a, b, d = Decimal(repr(start)), Decimal(repr(maximum)), Decimal(repr(step))
    if a == b:
        return [float(a)]
    count = int((b - a) / d) + 1
    grid = [float(a + k * d) for k in range(count)]
    if cap_at_max and grid[-1] < float(b):
        grid.append(float(b))
    return grid


@dataclass(frozen=True)
class SearchResult:
    """The chosen pair and how the search got there."""

    clip_low: float
    clip_high: float
    positive_contribution: float  # rho at the chosen pair
    target_met: bool
    steps: int
    nonfinite_tokens: int  # > 0 means the start pair was kept without searching


def positive_share(positive: float, negative: float) -> float:
    """rho = P / (P + N), defined as 1 where no token contributes."""
    total = positive + negative
    return 1.0 if total == 0 else positive / total


def _bin_sums(
    ratio: torch.Tensor, weights: torch.Tensor, edges: torch.Tensor, right: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per edge e_k, the weight columns summed over tokens on each side of e_k.

    With ``right=True`` the sides are ``r < e_k`` and ``r >= e_k``; with ``right=False`` they
    are ``r <= e_k`` and ``r > e_k``. One histogram over the edges plus prefix sums gives every
    edge at once.
    """
    index = torch.searchsorted(edges, ratio, right=right)
    hist = weights.new_zeros(edges.numel() + 1, weights.shape[1]).index_add_(0, index, weights)
    below = hist.cumsum(0)[:-1]
    above = hist.flip(0).cumsum(0).flip(0)[1:]
    return below, above


class BoundSearch:
    """Candidate grids and the two search steps for one set of BAPO hyper-parameters."""

    def __init__(
        self,
        lower: List[float],
        upper: List[float],
        target: float,
        search_order: str,
        contribution: str,
        clip_ratio_c,
    ):
        self.lower, self.upper = lower, upper
        self.target = target
        self.search_order = search_order
        self.contribution = contribution
        self.clip_ratio_c = clip_ratio_c

    @property
    def num_sums(self) -> int:
        return len(self.upper) + len(self.lower) + 1

    def local_sums(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        finite: torch.Tensor,
    ) -> torch.Tensor:
        """[P per upper candidate | N per lower candidate | non-finite token count], float64.

        ``ratio`` is detached; ``finite`` marks tokens whose inputs are all finite. Masked and
        non-finite tokens get zero weight (``where``, not a product, so NaN cannot leak in).
        Nothing here waits on the device, so it costs no host sync.
        """
        r = ratio.detach().reshape(-1).to(torch.float64)
        adv = advantages.detach().reshape(-1).to(torch.float64)
        valid = (mask.reshape(-1) & finite.reshape(-1)).bool()
        zero = r.new_zeros(())
        pos = torch.where(valid & (adv > 0), adv, zero)  # A on positive tokens
        neg = torch.where(valid & (adv < 0), -adv, zero)  # |A| on negative tokens
        r = torch.where(valid, r, zero)
        upper = torch.tensor(self.upper, dtype=torch.float64, device=r.device)
        lower = torch.tensor(self.lower, dtype=torch.float64, device=r.device)

        # P(c_high): tokens with r < c_high keep weight A * r; the rest are clipped to c_high.
        below, above = _bin_sums(r, torch.stack([pos * r, pos], 1), upper, right=True)
        positive = below[:, 0]
        if self.contribution == "surrogate":
            positive = positive + upper * above[:, 1]

        # N(c_low): tokens with r > c_low keep weight |A| * r; the rest are clipped to c_low.
        neg_grad = neg * r
        if self.contribution == "gradient" and self.clip_ratio_c is not None:
            neg_grad = torch.where(r <= self.clip_ratio_c, neg_grad, zero)  # dual clip: no grad
        below, above = _bin_sums(r, torch.stack([neg_grad, neg], 1), lower, right=False)
        negative = above[:, 0]
        if self.contribution == "surrogate":
            negative = negative + lower * below[:, 1]

        nonfinite = (mask.reshape(-1).bool() & ~finite.reshape(-1)).sum().to(torch.float64)
        return torch.cat([positive, negative, nonfinite.reshape(1)])

    def decide(self, sums: torch.Tensor) -> SearchResult:
        """Walk the candidate path on (possibly all-reduced) sums: one host transfer."""
        values = sums.tolist()
        n_up = len(self.upper)
        positive, negative = values[:n_up], values[n_up:-1]
        nonfinite = int(values[-1])

        def rho(i: int, j: int) -> float:
            return positive_share(positive[j], negative[i])

        if nonfinite > 0:
            i, j, steps = 0, 0, 0
        elif self.search_order == "upper_first":
            i, j, steps = self._walk_upper_first(rho)
        else:
            i, j, steps = self._walk_lower_first(rho)
        share = rho(i, j)
        return SearchResult(
            clip_low=self.lower[i],
            clip_high=self.upper[j],
            positive_contribution=share,
            target_met=share >= self.target,
            steps=steps,
            nonfinite_tokens=nonfinite,
        )

    def _walk_upper_first(self, rho) -> Tuple[int, int, int]:
        """Algorithm 1: raise c_high while it fits, then c_low, while the lower range has room."""
        i = j = steps = 0
        while rho(i, j) < self.target and i + 1 < len(self.lower):
            if j + 1 < len(self.upper):
                j += 1
            else:
                i += 1
            steps += 1
        return i, j, steps

    def _walk_lower_first(self, rho) -> Tuple[int, int, int]:
        """The authors' order: exhaust c_low first, then c_high."""
        i = j = steps = 0
        while rho(i, j) < self.target and i + 1 < len(self.lower):
            i += 1
            steps += 1
        while rho(i, j) < self.target and j + 1 < len(self.upper):
            j += 1
            steps += 1
        return i, j, steps
