"""The paper's grid and a micro-batch on which its target is never met (bench, DP worker, tests)."""

from typing import Any, Dict, Tuple

import torch

from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

# The paper's Sec. 5.1 grid and target, BAPO's defaults (tests/test_bapo_config.py checks them)
PAPER: Dict[str, Any] = BAPOPolicyLossFn.default_args()
PAPER_PATH_STEPS = 51  # (37 - 1) upper + (16 - 1) lower steps when the target is never met


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
