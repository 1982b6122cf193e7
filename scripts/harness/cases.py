"""The paper's grid, a micro-batch that never meets it, Eq. 8 at a pair, and the two searches.

``authors_loop``, the authors' per-candidate search, is the baseline the bench times
``product_search``, BAPO's own sums and walk, against.
"""

from fractions import Fraction
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

# The paper's Sec. 5.1 grid and target: BAPO's defaults
PAPER: Dict[str, Any] = BAPOPolicyLossFn.default_args()
RANGE_ARGS = [
    f"ratio_{side}_{part}" for side in ("lower", "upper") for part in ("start", "max", "step")
]
# a call's choice as its metrics report it, in the order ``product_search`` returns it
CHOICE = [f"bapo_{k}" for k in ("clip_low", "clip_high", "search_steps", "positive_contribution")]


def bench_batch(shape, seed: int, negative_share: float = 0.85, device: Any = "cpu") -> Dict:
    """A float32 micro-batch on which the paper's target is never met (the whole 51-step walk).

    85% negative advantages keep rho near 0.15; log-ratio std 0.3 spans every bound.
    """
    g = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(shape, generator=g)
    logprob = old + 0.3 * torch.randn(shape, generator=g)
    sign = torch.where(torch.rand(shape, generator=g) < negative_share, -1.0, 1.0)
    advantages = sign * (0.1 + torch.rand(shape, generator=g))
    mask = torch.rand(shape, generator=g) < 0.9
    batch = dict(logprob=logprob, old_logprob=old, action_mask=mask, advantages=advantages)
    return {k: v.to(device) for k, v in batch.items()}


def product_search(loss_fn: BAPOPolicyLossFn, batch: Dict, group=None) -> Tuple[float, ...]:
    """The search of ``loss_fn.__call__`` alone, over ``group``: (c_low, c_high, steps, rho)."""
    sums = loss_fn._prepare(**batch)[-1]
    if group is not None:
        dist.all_reduce(sums, group=group)
    i, j, rho = loss_fn._search(sums.tolist())
    return loss_fn.lower[i], loss_fn.upper[j], i + j, rho


def surrogate_sums(ratio, advantages, mask, low: float, high: float) -> torch.Tensor:
    """Eq. 8's (P, N) at one pair over the live tokens, in float64."""
    ratio, advantages, live = ratio.double(), advantages.double(), mask.bool()
    positive = (advantages * ratio.clamp(max=high))[(advantages > 0) & live].sum()
    negative = (-advantages * ratio.clamp(min=low))[(advantages < 0) & live].sum()
    return torch.stack([positive, negative])


def authors_loop(ratio, advantages, mask, grid: Dict, all_reduce=None) -> Tuple[float, ...]:
    """The authors' search: raise c_low by its step (capped at b-), then c_high, while rho < rho0.

    rho is recomputed from the tokens at every candidate, with one host sync and (given
    ``all_reduce``) one collective each. Bounds move by exact decimal steps, as a config writes
    them. Returns (c_low, c_high, steps).
    """
    exact = [Fraction(repr(float(grid[k]))) for k in RANGE_ARGS]
    c_low, b_low, d_low, c_high, b_high, d_high = exact
    steps, target = 0, grid["positive_contribution_target"]

    def share() -> float:
        pair = surrogate_sums(ratio, advantages, mask, float(c_low), float(c_high))
        if all_reduce is not None:
            all_reduce(pair)
        positive, negative = pair.tolist()
        return 1.0 if positive + negative == 0 else positive / (positive + negative)

    while share() < target and c_low < b_low:
        c_low = min(c_low + d_low, b_low)
        steps += 1
    while share() < target and c_high < b_high:
        c_high = min(c_high + d_high, b_high)
        steps += 1
    return float(c_low), float(c_high), steps
