"""BAPO's clip-bound search as pure code: tokens in, per-bin sums out; sums in, a pair out.

Eq. 8's P and N at every candidate follow from the sums of ``|A| r`` and ``|A|`` per bin between
neighbouring bounds: one pass over the tokens, and bins added over ranks act as their union.
"""

import math
from itertools import accumulate
from typing import List, Tuple

import torch

MAX_CANDIDATES = 10_000  # per range: a finer grid is a typo, not a setting


def candidate_grid(name: str, start, maximum, step, low: float, high: float, cap: bool):
    """The bounds ``start + k * step`` up to ``maximum`` of the range ``name``, checked.

    Rounding to 12 decimals keeps 0.6 + 15 * 0.02 at 0.9 rather than 0.8999999999999999, so the
    grid keeps its last step. ``cap`` appends an off-grid maximum, as the authors' ``min(c + step,
    max)`` does. Bad values raise a ``ValueError`` naming the argument and what it allows.
    """
    if not low <= start <= maximum <= high:
        raise ValueError(
            f"BAPO: `{name}_start` <= `{name}_max` must lie in [{low}, {high}]: {start}, {maximum}"
        )
    if start == maximum:
        return [float(start)]
    if not (step > 0 and (maximum - start) / step < MAX_CANDIDATES):
        raise ValueError(
            f"BAPO: `{name}_step` must be > 0, for {MAX_CANDIDATES} bounds at most: {step}"
        )
    count = math.floor(round((maximum - start) / step, 9)) + 1
    grid = [round(start + k * step, 12) for k in range(count)]
    return grid + [float(maximum)] if cap and grid[-1] < maximum else grid


def bin_sums(ratio, advantages, live, finite, edges) -> torch.Tensor:
    """``[0, non-finite live tokens | sum |A| r per bin | sum |A| per bin]`` in float64.

    ``edges`` are ``[-b-, ..., -a-, 0, a+, ..., b+]`` in the ratio's dtype, as ``torch.clamp``
    compares the bounds; a token's bin is that of ``copysign(r, A)``. Masked tokens and live ones
    that are not ``finite`` go to a last bin, never read. Slot 0 is the sync's failure flag.
    """
    r = ratio.detach().clamp(min=torch.finfo(ratio.dtype).tiny)  # no 16-bit underflow to 0
    bins = torch.bucketize(torch.copysign(r, advantages.detach()), edges)
    bins = torch.where(live & finite, bins, len(edges) + 1).reshape(-1)
    weight = advantages.detach().abs().double().reshape(-1)
    sums = weight.new_zeros(2, len(edges) + 2)
    sums[0].index_add_(0, bins, weight * r.double().reshape(-1))
    sums[1].index_add_(0, bins, weight)
    bad = (live & ~finite).sum().double().reshape(1)
    return torch.cat([bad.new_zeros(1), bad, sums[:, :-1].reshape(-1)])


def decide(values: List[float], bounds: List[float], n_lower: int, target: float, upper_first):
    """Walk the candidates on ``bin_sums``'s values; return the pair's indices and its rho.

    ``bounds``: the lower, then the upper candidates, as the loss compares them. Positive bin k
    holds ratios above k upper bounds: c_high_j keeps ``A r`` of bins ``<= j`` and counts the
    rest at c_high. Negative bins, flipped, hold ratios at or above k lower bounds: c_low_i keeps
    ``|A| r`` of bins ``> i`` and counts the rest at c_low. A non-finite token keeps the start.
    """
    cut, n_bins = n_lower + 1, len(bounds) + 2
    ar, a = values[2 : 2 + n_bins], values[2 + n_bins :]
    kept_pos = list(accumulate(ar[cut:]))  # A r of positive bins <= j
    above_pos = list(accumulate(a[cut:][::-1]))[::-1]  # A of positive bins >= j
    kept_neg = list(accumulate(ar[:cut]))[::-1]  # |A| r of flipped negative bins >= i
    below_neg = list(accumulate(a[:cut][::-1]))  # |A| of flipped negative bins <= i
    positive = [kept_pos[j] + c * above_pos[j + 1] for j, c in enumerate(bounds[n_lower:])]
    negative = [kept_neg[i + 1] + c * below_neg[i] for i, c in enumerate(bounds[:n_lower])]

    def rho(i: int, j: int) -> float:
        total = positive[j] + negative[i]
        return 1.0 if total == 0 else positive[j] / total

    i, j = (0, 0) if values[1] else walk(rho, n_lower, len(bounds) - n_lower, target, upper_first)
    return i, j, rho(i, j)


def walk(rho, n_lower: int, n_upper: int, target: float, upper_first: bool) -> Tuple[int, int]:
    """Return the indices of (c_low, c_high); each step raises one bound by one candidate.

    Algorithm 1 (``upper_first``): while rho < rho0 and c_low has room, raise c_high if it has
    room, else c_low. The authors' order: raise c_low while it has room, then c_high.
    """
    i = j = 0
    if upper_first:
        while rho(i, j) < target and i + 1 < n_lower:
            if j + 1 < n_upper:
                j += 1
            else:
                i += 1
        return i, j
    while rho(i, j) < target and i + 1 < n_lower:
        i += 1
    while rho(i, j) < target and j + 1 < n_upper:
        j += 1
    return i, j
