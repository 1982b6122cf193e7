"""A per-candidate search, the baseline the bench measures ours against.

It computes each candidate as the authors' code does, but walks Algorithm 1's order (upper
bound first), so that it visits the same pairs as ``BoundSearch`` with ``upper_first``. For
every candidate pair on the path it makes one full pass over the tokens with
torch ops (clamp, multiply by the sign mask, sum) to get P and N at that pair, optionally
all-reduces the two numbers, and reads rho back to the host with ``.item()`` before deciding
whether to move on. That is one pass, one host sync and (with a group) one collective per
candidate: 52 of each on the paper grid when the target is never met.

The walk is Algorithm 1 (upper first) with exact rational bounds, so it visits the same pairs
as ``BoundSearch`` and both must end on the same pair.
"""

from fractions import Fraction
from typing import Callable, Dict, Optional, Tuple

import torch


def _exact(x: float) -> Fraction:
    return Fraction(repr(float(x)))


def surrogate_share(ratio, advantages, mask, low: float, high: float, all_reduce=None) -> float:
    """Return rho at one pair by Eq. 8, read back to the host (the per-candidate host sync)."""
    valid = mask.to(ratio.dtype)
    positive = (advantages * torch.clamp(ratio, max=high) * (advantages > 0) * valid).sum()
    negative = (-advantages * torch.clamp(ratio, min=low) * (advantages < 0) * valid).sum()
    pair = torch.stack([positive, negative]).to(torch.float64)
    if all_reduce is not None:
        all_reduce(pair)
    total = pair[0] + pair[1]
    return torch.where(total == 0, torch.ones_like(total), pair[0] / total).item()


def literal_search(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    grid: Dict[str, float],
    all_reduce: Optional[Callable[[torch.Tensor], None]] = None,
) -> Tuple[float, float, int]:
    """Algorithm 1 with rho recomputed from the tokens for each pair; returns (low, high, steps).

    ``grid`` holds BAPOPolicyLossFn's range keywords and ``positive_contribution_target``;
    ``all_reduce`` (in-place SUM over the DP group) runs once per candidate when given.
    Surrogate contribution (Eq. 8), as the authors' code sums it.
    """
    target = grid["positive_contribution_target"]
    c_low, c_high = _exact(grid["ratio_lower_start"]), _exact(grid["ratio_upper_start"])
    b_low, b_high = _exact(grid["ratio_lower_max"]), _exact(grid["ratio_upper_max"])
    d_low, d_high = _exact(grid["ratio_lower_step"]), _exact(grid["ratio_upper_step"])

    def rho(low: float, high: float) -> float:
        return surrogate_share(ratio, advantages, mask, low, high, all_reduce)

    steps = 0
    while rho(float(c_low), float(c_high)) < target and c_low + d_low <= b_low:
        if c_high + d_high <= b_high:
            c_high += d_high
        else:
            c_low += d_low
        steps += 1
    return float(c_low), float(c_high), steps
