"""BAPO's clip-bound search, free of any process-group logic.

The search is split in two pure steps so that data-parallel ranks can meet in between:

1. ``BoundSearch.local_sums`` makes one pass over the tokens and returns, after a two-value
   header, the positive contribution P (one value per upper candidate) and the negative
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
# The sums vector opens with a header: ranks whose inputs failed, non-finite live tokens.
FAILED, NONFINITE, HEADER = 0, 1, 2
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


def _suffix_sums(values: torch.Tensor) -> torch.Tensor:
    """Entry k: the sum of ``values[k:]``."""
    return values.flip(0).cumsum(0).flip(0)


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
        settings = repr((lower, upper, target, search_order, contribution, clip_ratio_c))
        fingerprint = int.from_bytes(hashlib.sha256(settings.encode()).digest()[:7])
        # What every rank of a group must agree on before their sums can be added up.
        self.settings = (fingerprint, len(lower), len(upper))
        self.length = HEADER + len(upper) + len(lower)  # values in a sums vector
        self._constants: Dict[Tuple, Tuple[torch.Tensor, ...]] = {}

    def _constants_on(self, ratio: torch.Tensor, advantages: torch.Tensor):
        """Return the signed edges, bounds and dual clip on the ratio's device, in float64.

        Each is rounded as the loss compares it: ``torch.clamp`` compares a ratio with a bound
        in the ratio's own dtype (in bfloat16 the bound 1.2 is 1.203125, and a ratio of
        1.203125 still carries gradient), while the dual clip ``-A * C`` is computed in the
        dtype of ``A * r``. Kept per device and dtypes: a copy per call from host memory would
        wait on the device.
        """
        dual_dtype = torch.result_type(advantages, ratio)
        key = (str(ratio.device), ratio.dtype, dual_dtype)
        if key not in self._constants:
            bounds = torch.tensor(self.lower + self.upper, dtype=torch.float64)
            lower, upper = bounds.to(ratio.dtype).double().split([len(self.lower), len(self.upper)])
            dual = torch.tensor([self.clip_ratio_c or math.inf], dtype=torch.float64)
            dual = dual.to(dual_dtype).double()
            signed = torch.cat([-lower.flip(0), torch.zeros(1, dtype=torch.float64), upper])
            parts = (signed, lower, upper, dual)
            self._constants[key] = tuple(t.to(ratio.device) for t in parts)
        return self._constants[key]

    def local_sums(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        finite: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """[0, non-finite count | P per upper candidate | N per lower candidate], float64.

        ``ratio`` is detached; ``finite`` marks tokens whose inputs are all finite. A live
        token (``mask != 0``) weighs ``|A|`` times ``weight``, by default its mask value (any
        non-bool mask weighs its token, as the loss's aggregation does); masked and non-finite
        tokens weigh 0 (filled, not multiplied, so NaN cannot leak in). Nothing here waits on
        the device.

        Each token falls in one bin of a signed axis, ``x = copysign(r, A)`` cut at
        ``[-b-, ..., -a-, 0, a+, ..., b+]`` (a token with A = 0 weighs 0 on either side). A
        negative token's bin counts the lower candidates above its ratio, a positive one's
        (after the 0) the upper candidates below it; a ratio on a bound counts as unclipped,
        since ``torch.clamp`` passes its gradient there. Two weighted histograms give every
        candidate's sums: prefix sums for the tokens a candidate leaves unclipped and suffix
        sums for those it clips, so each sum adds only that candidate's own tokens (a total
        minus a prefix would let one huge token cancel the small ones).
        """
        signed, lower, upper, dual = self._constants_on(ratio, advantages)
        live = (mask != 0).reshape(-1)
        dropped = ~(live & finite.reshape(-1))
        adv = advantages.detach().reshape(-1)
        if weight is None and mask.dtype != torch.bool:
            weight = mask
        # Our own float64 copies, never the caller's tensors, worked on in place. The ratio stays
        # inside (0, e^20]: in half precision it can underflow to 0 (which would file a positive
        # token with the negative ones) or overflow to inf.
        r = ratio.detach().reshape(-1).to(torch.float64, copy=True)
        r.clamp_(TINY, math.exp(LOG_RATIO_CLAMP)).masked_fill_(dropped, 1.0)
        w = adv.to(torch.float64, copy=True).abs_()
        if weight is not None:
            w.mul_(weight.detach().reshape(-1))
        w.masked_fill_(dropped, 0.0)
        bins = torch.bucketize(torch.copysign(r, adv), signed)  # edges below x; A = 0 weighs 0
        share = None
        if self.contribution == "gradient" and self.clip_ratio_c is not None:
            # Past the dual clip A < 0 has no gradient; on it, torch.min splits it in half.
            share = torch.where(r > dual, 0.0, torch.where(r == dual, 0.5, 1.0))
            share.masked_fill_(adv > 0, 1.0)
        weight_r = r.mul_(w)  # |A| r, in the ratio's buffer
        if share is not None:
            weight_r.mul_(share)
        lanes = LANES if bins.is_cuda else 1
        hist_r, hist_w = histograms(bins, [weight_r, w], len(signed) + 1, lanes)

        # A > 0, bin k holds ratios with k upper candidates below them: candidate j keeps A r
        # of bins <= j and, under Eq. 8, counts the tokens of bins > j at c_high. A < 0,
        # flipped so that bin k holds ratios with k lower candidates <= r: candidate i keeps
        # |A| r of bins > i and counts those of bins <= i at c_low.
        n_low = len(self.lower)
        pos_r, pos_w = hist_r[n_low + 1 :], hist_w[n_low + 1 :]
        neg_r, neg_w = hist_r[: n_low + 1].flip(0), hist_w[: n_low + 1].flip(0)
        positive, negative = pos_r.cumsum(0)[:-1], _suffix_sums(neg_r)[1:]
        if self.contribution == "surrogate":
            positive = positive + upper * _suffix_sums(pos_w)[1:]
            negative = negative + lower * neg_w.cumsum(0)[:-1]
        nonfinite = (live & dropped).sum(dtype=torch.float64)
        return torch.cat(
            [torch.stack([torch.zeros_like(nonfinite), nonfinite]), positive, negative]
        )

    def failure_sums(self, device) -> torch.Tensor:
        """What a rank whose inputs failed sends instead, so that its peers fail with it."""
        sums = torch.zeros(self.length, dtype=torch.float64, device=device)
        sums[FAILED] = 1.0
        return sums

    def parts(self, sums):
        """(P per upper candidate, N per lower candidate, non-finite count) of a sums vector."""
        n_up = len(self.upper)
        return sums[HEADER : HEADER + n_up], sums[HEADER + n_up :], sums[NONFINITE]

    def decide(self, sums) -> SearchResult:
        """Walk the candidate path on the (reduced) sums, a tensor (one host transfer) or list."""
        values = sums.tolist() if isinstance(sums, torch.Tensor) else sums
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
