"""The paper's grid, a micro-batch that never meets it, and Eq. 8 at one pair (bench, trainer).

``surrogate_sums`` and the per-candidate search built on it are the baseline the bench times
BAPO's one-pass search against, and the rho the trainer logs for fixed-clip variants. The test
oracle (tests/bapo_reference.py) is written apart from both.
"""

from fractions import Fraction
from typing import Any, Dict, Tuple

import torch

from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

# The paper's Sec. 5.1 grid and target, BAPO's defaults (tests/test_bapo_config.py checks them)
PAPER: Dict[str, Any] = BAPOPolicyLossFn.default_args()
RANGE_ARGS = [
    f"ratio_{side}_{part}" for side in ("lower", "upper") for part in ("start", "max", "step")
]


def bench_batch(
    shape: Tuple[int, ...], seed: int, negative_share: float = 0.85, device: Any = "cpu"
) -> Dict[str, torch.Tensor]:
    """A float32 micro-batch on which the paper's target is never met (the whole 51-step walk).

    85% negative advantages keep rho near 0.15; log-ratio std 0.3 puts tokens on both sides of
    every bound; the bool mask drops ~10%; advantages have magnitude 0.1..1.1.
    """
    g = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(shape, generator=g)
    logprob = old + 0.3 * torch.randn(shape, generator=g)
    sign = torch.where(torch.rand(shape, generator=g) < negative_share, -1.0, 1.0)
    advantages = sign * (0.1 + torch.rand(shape, generator=g))
    mask = torch.rand(shape, generator=g) < 0.9
    batch = dict(logprob=logprob, old_logprob=old, action_mask=mask, advantages=advantages)
    return {k: v.to(device) for k, v in batch.items()}


def search_inputs(batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """(ratio, advantages, mask, finite) as BAPOPolicyLossFn hands them to the search."""
    raw = batch["logprob"].detach() - batch["old_logprob"]
    ratio = torch.exp(torch.clamp(raw, min=-20.0, max=20.0))
    finite = torch.isfinite(raw + batch["advantages"])
    return ratio, batch["advantages"], batch["action_mask"], finite


def surrogate_sums(ratio, advantages, mask, low: float, high: float) -> torch.Tensor:
    """Eq. 8's (P, N) at one pair over the live tokens, in float64."""
    ratio, advantages, live = ratio.double(), advantages.double(), mask.bool()
    positive = (advantages * ratio.clamp(max=high))[(advantages > 0) & live].sum()
    negative = (-advantages * ratio.clamp(min=low))[(advantages < 0) & live].sum()
    return torch.stack([positive, negative])


def literal_search(ratio, advantages, mask, grid: Dict, all_reduce=None):
    """The baseline: Algorithm 1 recomputing rho from the tokens at every pair it visits.

    Exact rational bounds, so it visits ``BoundSearch``'s pairs, with one host sync and (given
    ``all_reduce``) one collective per pair. Returns (low, high, steps).
    """
    c_low, b_low, d_low, c_high, b_high, d_high = (
        Fraction(repr(float(grid[k]))) for k in RANGE_ARGS
    )
    steps, target = 0, grid["positive_contribution_target"]

    def share() -> float:
        pair = surrogate_sums(ratio, advantages, mask, float(c_low), float(c_high))
        if all_reduce is not None:
            all_reduce(pair)
        positive, negative = pair.tolist()
        return 1.0 if positive + negative == 0 else positive / (positive + negative)

    while share() < target and c_low + d_low <= b_low:
        if c_high + d_high <= b_high:
            c_high += d_high
        else:
            c_low += d_low
        steps += 1
    return float(c_low), float(c_high), steps
