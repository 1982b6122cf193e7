"""BAPO's clip-bound search as pure tensor code: tokens in, per-candidate sums out, a pair back.

``P`` (Eq. 8's positive part) depends only on ``c_high`` and ``N`` only on ``c_low``, so one pass
over the tokens gives both parts for every candidate in one float64 vector, and no tokens x
candidates tensor is ever built. ``decide`` walks the candidate path on those sums on the host.
Adding the vectors of several data-parallel ranks first gives every rank the same pair.
"""

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Dict, Tuple

import torch

LOG_RATIO_CLAMP = 20.0  # the loss clamps log r to [-20, 20], as PPOPolicyLossFn does
MAX_CANDIDATES = 10_000  # per range; a step so small that the grid explodes is a config error


def candidate_grid(start: float, maximum: float, step: float, cap_at_max: bool, name="step"):
    """Exact candidates ``start + k * step`` that do not pass ``maximum``.

    Decimal arithmetic on the values as written avoids the float trap (0.6 + 15 * 0.02 must be
    0.90, not 0.8999...). ``cap_at_max`` appends an off-grid ``maximum``, as the authors'
    ``min(c + step, max)`` does. Too many candidates, or ones that are not distinct floats,
    raise a ``ValueError`` that names ``name``.
    """
    a, b, d = (Decimal(repr(x)) for x in (start, maximum, step))
    count = int((b - a) / d) + 1 if a < b else 1
    grid = [float(a + k * d) for k in range(min(count, MAX_CANDIDATES + 1))]
    if cap_at_max and grid[-1] < maximum:
        grid.append(maximum)
    if len(grid) > MAX_CANDIDATES or any(nxt <= prev for prev, nxt in zip(grid, grid[1:])):
        raise ValueError(
            f"BAPO: `{name}` must give at most {MAX_CANDIDATES} distinct candidates in "
            f"[{start}, {maximum}], got {step!r}"
        )
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
    """Return rho = P / (P + N), defined as 1 where no token contributes."""
    total = positive + negative
    return 1.0 if total == 0 else positive / total


def _suffix_sums(values: torch.Tensor) -> torch.Tensor:
    """Entry k: the sum of ``values[k:]``."""
    return values.flip(0).cumsum(0).flip(0)


class BoundSearch:
    """Candidate grids and the two search steps for one set of BAPO hyper-parameters."""

    def __init__(self, lower, upper, target, search_order, contribution, clip_ratio_c) -> None:
        """Keep the candidate grids (lists of floats) and the settings of the walk."""
        self.lower, self.upper = lower, upper
        self.target = target
        self.search_order = search_order
        self.contribution = contribution
        self.clip_ratio_c = clip_ratio_c
        self._constants: Dict[Tuple, Tuple[torch.Tensor, ...]] = {}

    def _constants_on(self, ratio: torch.Tensor, advantages: torch.Tensor):
        """The signed edges (in the ratio's dtype), bounds and dual clip (float64), cached.

        Rounded as the loss compares them: ``torch.clamp`` in the ratio's dtype (in bfloat16
        1.2 is 1.203125), ``-A * C`` in that of ``A * r``; cached, so no call copies from host.
        """
        dual_dtype = torch.result_type(advantages, ratio)
        key = (ratio.device, ratio.dtype, dual_dtype)
        if key not in self._constants:
            bounds = torch.tensor(self.lower + self.upper, dtype=torch.float64)
            lower, upper = bounds.to(ratio.dtype).double().split([len(self.lower), len(self.upper)])
            signed = torch.cat([-lower.flip(0), torch.zeros(1, dtype=torch.float64), upper])
            dual = torch.tensor(self.clip_ratio_c or math.inf).to(dual_dtype).double()
            parts = (signed.to(ratio.dtype), lower, upper, dual)
            self._constants[key] = tuple(t.to(ratio.device) for t in parts)
        return self._constants[key]

    def local_sums(self, ratio, advantages, mask, finite, weight=None) -> torch.Tensor:
        """[P per upper candidate | N per lower candidate | non-finite live tokens], float64.

        A live token (``mask != 0``) weighs ``|A|`` times ``weight`` (by default its mask
        value); masked tokens and tokens not ``finite`` weigh 0. Each token falls in one bin of
        ``copysign(r, A)`` cut at ``[-b-, ..., -a-, 0, a+, ..., b+]`` (a ratio on a bound is
        unclipped, as in ``torch.clamp``). No host sync; the caller's tensors stay unwritten.
        """
        signed, lower, upper, dual = self._constants_on(ratio, advantages)
        live = (mask != 0).reshape(-1)
        dropped = ~(live & finite.reshape(-1))
        adv = advantages.detach().reshape(-1)
        if weight is None and mask.dtype != torch.bool:
            weight = mask
        # In 16-bit precision a ratio can underflow to 0, which would file a positive token on
        # the negative side; the float64 copy stays below e^20 where the 16-bit one overflows.
        r = ratio.detach().reshape(-1).clamp(min=torch.finfo(ratio.dtype).tiny)
        bins = torch.bucketize(torch.copysign(r, adv), signed)  # A = 0 weighs 0 on either side
        bins = torch.where(dropped, len(signed) + 1, bins)  # a last bin, never read: NaN there
        r = r.double().clamp_(max=math.exp(LOG_RATIO_CLAMP))
        w = adv.to(torch.float64, copy=True).abs_()
        if weight is not None:
            w.mul_(weight.detach().reshape(-1))
        if self.contribution == "gradient" and self.clip_ratio_c is not None:
            # Past the dual clip A < 0 has no gradient; on it, torch.min splits it in half.
            # (Only |A| r is read under "gradient", so |A| may carry this share.)
            share = torch.where(r > dual, 0.0, torch.where(r == dual, 0.5, 1.0))
            w.mul_(share.masked_fill_(adv > 0, 1.0))
        hist_r, hist_w = (w.new_zeros(len(signed) + 2).index_add_(0, bins, x) for x in (r * w, w))
        return self._candidate_sums(hist_r, hist_w, upper, lower, (live & dropped).sum())

    def _candidate_sums(self, hist_r, hist_w, upper, lower, nonfinite) -> torch.Tensor:
        """Every candidate's P and N from the per-bin sums of ``|A| r`` and ``|A|``.

        A > 0: bin k (after the 0) holds ratios with k upper candidates below them, so
        candidate j keeps A r of bins <= j and, under Eq. 8, counts bins > j at c_high. A < 0,
        flipped so that bin k holds ratios with k lower candidates <= r: candidate i keeps
        |A| r of bins > i and counts bins <= i at c_low. Prefix and suffix sums add only a
        candidate's own tokens, so one huge token cannot erase the small ones.
        """
        n_low = len(self.lower)
        pos_r, pos_w = hist_r[n_low + 1 : -1], hist_w[n_low + 1 : -1]
        neg_r, neg_w = hist_r[: n_low + 1].flip(0), hist_w[: n_low + 1].flip(0)
        positive, negative = pos_r.cumsum(0)[:-1], _suffix_sums(neg_r)[1:]
        if self.contribution == "surrogate":
            positive = positive + upper * _suffix_sums(pos_w)[1:]
            negative = negative + lower * neg_w.cumsum(0)[:-1]
        return torch.cat([positive, negative, nonfinite.double().reshape(1)])

    def decide(self, sums) -> SearchResult:
        """Walk the candidate path on sums (a list, or a tensor) laid out as ``local_sums``'s."""
        values = sums.tolist() if isinstance(sums, torch.Tensor) else sums
        n_up, n_low = len(self.upper), len(self.lower)
        positive, negative = values[:n_up], values[n_up : n_up + n_low]
        nonfinite = int(values[n_up + n_low])

        def rho(i: int, j: int) -> float:
            return positive_share(positive[j], negative[i])

        if nonfinite > 0:
            i = j = steps = 0
        elif self.search_order == "upper_first":
            i, j, steps = self._walk_upper_first(rho)
        else:
            i, j, steps = self._walk_lower_first(rho)
        share = rho(i, j)
        return SearchResult(
            self.lower[i], self.upper[j], share, share >= self.target, steps, nonfinite
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
