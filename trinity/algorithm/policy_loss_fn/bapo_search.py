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

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import List, Tuple

import torch

from trinity.algorithm.policy_loss_fn.bapo_edges import EdgeCounter

SEARCH_ORDERS = ("upper_first", "lower_first")
CONTRIBUTIONS = ("surrogate", "gradient")
MAX_CANDIDATES = 10_000  # per range; guards against a step so small the grid explodes
RATIO_RANGE = (math.exp(-20.0), math.exp(20.0))  # the loss clamps log r to [-20, 20]


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


def _split_sums(hist: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """For bins h_0..h_K, per edge k the totals of bins <= k and of bins > k."""
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
        # Signed axis [-b-, ..., -a-, 0, a+, ..., b+]; its tables are copied to a device once,
        # since a copy per call from host memory would block on the device stream.
        self._edges = EdgeCounter([-c for c in reversed(lower)] + [0.0] + list(upper))

    def local_sums(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        finite: torch.Tensor,
    ) -> torch.Tensor:
        """[P per upper candidate | N per lower candidate | non-finite token count], float64.

        ``ratio`` is detached; ``finite`` marks tokens whose inputs are all finite. Masked and
        non-finite tokens get zero weight (filled, not multiplied, so NaN cannot leak in).
        Nothing here waits on the device (the edge tables are copied to it once), so it costs no
        host sync.

        Every token falls in one bin of a signed axis ``x = copysign(r, A)`` cut at
        ``[-b-, ..., -a-, 0, a+, ..., b+]``: a positive token is placed among the upper
        candidates, a negative one (at ``-r``) among the lower ones, and the edge at 0 keeps
        the two sides apart. One count of edges and two 1-D histograms then serve both sides, and
        prefix sums over the small histograms give every candidate at once.
        """
        mask, finite = mask.reshape(-1).bool(), finite.reshape(-1)
        excluded = ~(mask & finite)
        adv = advantages.detach().reshape(-1)
        # In-place steps on few buffers: on CPU each fresh token-sized buffer costs page
        # faults that outweigh the arithmetic. Copies, so float64 inputs are never aliased.
        r = ratio.detach().reshape(-1).to(torch.float64, copy=True).masked_fill_(excluded, 0.0)
        # Back inside the loss's clamp: a half-precision ratio can underflow to 0, and a
        # negative token at -0.0 would then count on the positive side; or overflow to inf.
        r.clamp_(*RATIO_RANGE)
        x = torch.copysign(r, adv)
        weight = adv.to(torch.float64, copy=True).abs_().masked_fill_(excluded, 0.0)  # |A|
        edges, n_low = self._edges.edges_on(x.device), len(self.lower)
        upper, lower = edges[n_low + 1 :], -edges[:n_low].flip(0)  # exact: negation
        bins = self._edges.count(x)  # number of signed edges <= x
        weight_r = r.mul_(weight)  # |A| r, reusing r's buffer
        if self.contribution == "gradient" and self.clip_ratio_c is not None:
            weight_r.masked_fill_(x < -self.clip_ratio_c, 0.0)  # dual clip: A < 0 has no grad
        hist_r = weight.new_zeros(edges.numel() + 1).index_add_(0, bins, weight_r)
        hist_a = weight.new_zeros(edges.numel() + 1).index_add_(0, bins, weight)

        # A > 0 sits in bin n_low + 1 + #{c_high <= r}. Tokens with r < c_high keep A * r;
        # under Eq. 8 the others count at c_high.
        below_r, _ = _split_sums(hist_r[n_low + 1 :])
        _, above_a = _split_sums(hist_a[n_low + 1 :])
        positive = below_r
        if self.contribution == "surrogate":
            positive = positive + upper * above_a

        # A < 0 sits in bin n_low - #{c_low < r}; flipped, bin k holds #{c_low < r} = k.
        # Tokens with r > c_low keep |A| r; under Eq. 8 the others count at c_low.
        _, negative = _split_sums(hist_r[: n_low + 1].flip(0))
        if self.contribution == "surrogate":
            below_a, _ = _split_sums(hist_a[: n_low + 1].flip(0))
            negative = negative + lower * below_a

        nonfinite = (mask & ~finite).sum().to(torch.float64)
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
