"""BAPO's clip-bound search, free of any process-group logic.

The search is split in two pure steps so that data-parallel ranks can meet in between:

1. ``BoundSearch.local_sums`` makes one pass over the tokens and returns, for every candidate
   bound, the positive contribution P (one value per upper candidate) and the negative
   contribution N (one value per lower candidate) in one float64 vector. P depends only on
   ``c_high`` and N only on ``c_low`` (Eq. 8 of the paper), so no tokens x candidates tensor
   is ever built.
2. ``BoundSearch.decide`` walks the candidate path of Algorithm 1 (or the authors' order) on
   the host over those sums. Summing the vectors of several ranks before this step gives the
   decision one process would take on the union of their tokens.
"""

import hashlib
import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Dict, List, Optional, Tuple

import torch

SEARCH_ORDERS = ("upper_first", "lower_first")
CONTRIBUTIONS = ("surrogate", "gradient")
LOG_RATIO_CLAMP = 20.0  # the loss clamps log r to [-20, 20], as PPOPolicyLossFn does
TINY = torch.finfo(torch.float64).tiny  # below every bound (bounds are normal float32 numbers)
MAX_CANDIDATES = 10_000  # per range; guards against a step so small the grid explodes
HEADER = 3  # fingerprint, its square, non-finite token count
SYNC_LENGTH = HEADER + 2 * MAX_CANDIDATES  # every rank reduces this many values, whatever its grid
LANES = 256  # copies of each histogram bin on CUDA, against atomic-add contention


def candidate_grid(
    start: float, maximum: float, step: float, cap_at_max: bool, name: str = "step"
) -> List[float]:
    """Exact candidates ``start + k * step`` with ``k = 0, 1, ...`` that do not pass ``maximum``.

    Decimal arithmetic on the values as written avoids the float trap (0.6 + 15 * 0.02 must be
    0.90, not 0.8999...). ``cap_at_max`` appends ``maximum`` when it is not on the grid, as the
    authors' ``min(c + step, max)`` update does; Algorithm 1 never overshoots and so never does.
    Raises ``ValueError`` naming ``name`` when the grid is too long or its points are closer
    together than float resolution.
    """
    a, b, d = Decimal(repr(start)), Decimal(repr(maximum)), Decimal(repr(step))
    if a == b:
        return [start]
    count = int((b - a) / d) + 1
    extra = int(cap_at_max and a + (count - 1) * d < b)
    if count + extra > MAX_CANDIDATES:
        raise ValueError(
            f"BAPO: `{name}` must be large enough for at most {MAX_CANDIDATES} candidates "
            f"in [{start}, {maximum}], got {step!r}"
        )
    grid = [float(a + k * d) for k in range(count)] + [maximum] * extra
    if any(nxt <= prev for prev, nxt in zip(grid, grid[1:])):
        raise ValueError(
            f"BAPO: `{name}` must keep the candidates in [{start}, {maximum}] apart as "
            f"floating-point numbers, got {step!r}"
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


def histograms(bins: torch.Tensor, weights: List, size: int, lanes: int) -> List[torch.Tensor]:
    """Per bin, the sum of each of ``weights`` over the tokens in it.

    ``torch.bincount`` would read the largest bin back to the host on CUDA; ``index_add_``
    does not. With ``lanes`` > 1 each bin gets that many copies, so that the atomic adds of
    neighbouring tokens rarely land on one address (on CUDA).
    """
    if lanes > 1:
        bins = bins * lanes + torch.arange(bins.numel(), device=bins.device) % lanes
    sums = [w.new_zeros(size * lanes).index_add_(0, bins, w) for w in weights]
    return [h.view(size, lanes).sum(1) for h in sums]


class BoundSearch:
    """Candidate grids and the two search steps for one set of BAPO hyper-parameters."""

    def __init__(
        self,
        lower: List[float],
        upper: List[float],
        target: float,
        search_order: str,
        contribution: str,
        clip_ratio_c: Optional[float],
    ):
        """Keep the grids and settings, and fingerprint them for the data-parallel check."""
        self.lower, self.upper = lower, upper
        self.target = target
        self.search_order = search_order
        self.contribution = contribution
        self.clip_ratio_c = clip_ratio_c
        # An integer in [1, 2**16]: sums of it and its square over up to 2**21 ranks are exact
        # in float64, so ranks whose settings differ show up in the reduced header.
        settings = repr((lower, upper, target, search_order, contribution, clip_ratio_c))
        self.fingerprint = 1 + int.from_bytes(hashlib.sha256(settings.encode()).digest()[:2])
        self._constants: Dict[Tuple[str, torch.dtype], Tuple[torch.Tensor, ...]] = {}

    def _constants_on(self, ratio: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Return the signed edges, bounds, dual clip and fingerprint on the ratio's device.

        All float64. The bounds are rounded to the ratio's dtype first: ``torch.clamp`` compares
        a ratio with a bound in the ratio's own dtype, so in bfloat16 the bound 1.2 is 1.203125,
        and a ratio of 1.203125 still carries gradient. Kept per device and dtype, since a copy
        per call from host memory would wait on the device.
        """
        key = (str(ratio.device), ratio.dtype)
        if key not in self._constants:
            bounds = self.lower + self.upper + [self.clip_ratio_c or math.inf]
            rounded = torch.tensor(bounds, dtype=torch.float64).to(ratio.dtype).double()
            lower, upper, dual = rounded.split([len(self.lower), len(self.upper), 1])
            signed = torch.cat([-lower.flip(0), torch.zeros(1, dtype=torch.float64), upper])
            pair = torch.tensor([self.fingerprint, self.fingerprint**2], dtype=torch.float64)
            parts = (signed, lower, upper, dual, pair)
            self._constants[key] = tuple(t.to(ratio.device) for t in parts)
        return self._constants[key]

    def local_sums(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        finite: torch.Tensor,
    ) -> torch.Tensor:
        """[fingerprint, its square, non-finite count | P per upper | N per lower], float64.

        ``ratio`` is detached; ``finite`` marks tokens whose inputs are all finite. A token
        weighs ``|A| * mask``, as in the loss's aggregation; masked and non-finite tokens weigh
        0 (filled, not multiplied, so NaN cannot leak in). Nothing here waits on the device.

        Each token falls in one bin of a signed axis, ``x = copysign(r, A)`` cut at
        ``[-b-, ..., -a-, 0, a+, ..., b+]`` (a token with A = 0 weighs 0 on either side). A
        negative token's bin counts the lower candidates above its ratio, a positive one's
        (after the 0) the upper candidates below it; a ratio on a bound counts as unclipped,
        since ``torch.clamp`` passes its gradient there. Two weighted histograms, and prefix
        sums over them, give every candidate.
        """
        signed, lower, upper, dual, fingerprint = self._constants_on(ratio)
        live = (mask != 0).reshape(-1)
        dropped = ~(live & finite.reshape(-1))
        adv = advantages.detach().reshape(-1)
        # Our own float64 copies, never the caller's tensors, worked on in place. The ratio stays
        # inside (0, e^20]: in half precision it can underflow to 0 (which would file a positive
        # token with the negative ones) or overflow to inf.
        r = ratio.detach().reshape(-1).to(torch.float64, copy=True)
        r.clamp_(TINY, math.exp(LOG_RATIO_CLAMP)).masked_fill_(dropped, 1.0)
        weight = adv.to(torch.float64, copy=True).abs_().masked_fill_(dropped, 0.0)
        if mask.is_floating_point():  # a fractional mask weighs its token, as in the loss
            weight.mul_(mask.reshape(-1))
        bins = torch.bucketize(torch.copysign(r, adv), signed)  # edges below x; A = 0 weighs 0
        share = None
        if self.contribution == "gradient" and self.clip_ratio_c is not None:
            # Past the dual clip A < 0 has no gradient; on it, torch.min splits it in half.
            share = torch.where(r > dual, 0.0, torch.where(r == dual, 0.5, 1.0))
            share.masked_fill_(adv > 0, 1.0)
        weight_r = r.mul_(weight)  # |A| r, in the ratio's buffer
        if share is not None:
            weight_r.mul_(share)
        lanes = LANES if bins.is_cuda else 1
        hist_r, hist_w = histograms(bins, [weight_r, weight], len(signed) + 1, lanes)

        # Prefix sums per side. A > 0, bin k: k upper candidates below r; tokens with
        # r <= c_high keep A r, and under Eq. 8 the others count at c_high. A < 0, flipped so
        # that bin k holds k lower candidates <= r: those with r >= c_low keep |A| r, and under
        # Eq. 8 the others count at c_low.
        n_low = len(self.lower)
        pos_r, pos_w = (h[n_low + 1 :].cumsum(0) for h in (hist_r, hist_w))
        neg_r, neg_w = (h[: n_low + 1].flip(0).cumsum(0) for h in (hist_r, hist_w))
        positive, clipped = pos_r[:-1], pos_w[-1] - pos_w[:-1]
        negative, floored = neg_r[-1] - neg_r[:-1], neg_w[:-1]
        if self.contribution == "surrogate":
            positive, negative = positive + upper * clipped, negative + lower * floored
        nonfinite = (live & dropped).sum(dtype=torch.float64).reshape(1)
        return torch.cat([fingerprint, nonfinite, positive, negative])

    def parts(self, sums):
        """(P per upper candidate, N per lower candidate, non-finite count) of a sums vector."""
        n_up = len(self.upper)
        return sums[HEADER : HEADER + n_up], sums[HEADER + n_up :], sums[2]

    def decide(self, sums: torch.Tensor, ranks: int = 1) -> SearchResult:
        """Walk the candidate path on sums over ``ranks`` ranks: one host transfer.

        Raises ``RuntimeError`` when the reduced fingerprint shows that the ranks' settings
        differ: their sums would not describe one search.
        """
        values = sums.tolist()
        if values[0] != ranks * self.fingerprint or values[1] != ranks * self.fingerprint**2:
            raise RuntimeError(
                "BAPO: the policy loss settings (candidate grids, positive_contribution_target, "
                "search_order, contribution or clip_ratio_c) differ between the ranks of the "
                "dp_group; every data-parallel rank must use the same policy_loss_fn_args"
            )
        positive, negative, nonfinite = self.parts(values)

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
            clip_low=self.lower[i],
            clip_high=self.upper[j],
            positive_contribution=share,
            target_met=share >= self.target,
            steps=steps,
            nonfinite_tokens=int(nonfinite),
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
