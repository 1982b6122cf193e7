"""The paper's grid and a micro-batch on which its target is never met (bench, DP worker, tests)."""

from typing import Any, Dict, Tuple

import torch

# The paper's Sec. 5.1 values, as BAPOPolicyLossFn.default_args() has them
PAPER: Dict[str, Any] = dict(
    ratio_lower_start=0.6,
    ratio_lower_max=0.9,
    ratio_lower_step=0.02,
    ratio_upper_start=1.2,
    ratio_upper_max=3.0,
    ratio_upper_step=0.05,
    positive_contribution_target=0.4,
    clip_ratio_c=3.0,
)


PAPER_PATH_STEPS = 51  # (37 - 1) upper + (16 - 1) lower steps when the target is never met


def bench_batch(
    shape: Tuple[int, ...], seed: int, negative_share: float = 0.85, device: Any = "cpu"
) -> Dict[str, torch.Tensor]:
    """A float32 micro-batch on which BAPO's paper target is never met.

    85% negative advantages keep rho near 0.15 on the whole grid, so Algorithm 1 walks all 51
    steps, the worst case for a per-candidate loop. Log-ratio std 0.3 puts tokens on both sides
    of every bound; the bool mask drops ~10%; advantages have magnitude 0.1..1.1.
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
