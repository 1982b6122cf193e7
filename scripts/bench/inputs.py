"""Benchmark inputs and candidate grids.

The timed batches are built so that BAPO's target is never met: 85% of the advantages are
negative, so under the paper's surrogate contribution rho stays near 0.15 for every pair on the
paper grid (below rho0 = 0.4), and Algorithm 1 walks its whole path (36 upper + 15 lower steps
= 51). That is the worst case for the per-candidate loop and the case the figures describe.
The paper's hyper-parameters are kept as they are; only the data is adversarial.
"""

from typing import Any, Dict, Tuple

import torch

PAPER: Dict[str, Any] = dict(  # Sec. 5.1, as BAPOPolicyLossFn.default_args()
    ratio_lower_start=0.6,
    ratio_lower_max=0.9,
    ratio_lower_step=0.02,
    ratio_upper_start=1.2,
    ratio_upper_max=3.0,
    ratio_upper_step=0.05,
    positive_contribution_target=0.4,
)
PAPER_PATH_STEPS = 51  # (37 - 1) upper + (16 - 1) lower steps when the target is never met

# Grids used to scale the number of candidates (upper, lower); totals 10, 100, 500, 2000.
# Spans stay fixed-ish and steps shrink, so more candidates means finer bounds, as in practice.
CANDIDATE_GRIDS = {
    10: ((1.0, 2.0, 0.2), (0.6, 0.9, 0.1)),  # 6 + 4
    100: ((1.0, 2.0, 0.02), (0.5, 0.98, 0.01)),  # 51 + 49
    500: ((1.0, 2.0, 0.004), (0.5, 0.996, 0.002)),  # 251 + 249
    2000: ((1.0, 2.499, 0.001), (0.5, 0.999, 0.001)),  # 1500 + 500
}


def grid_kwargs(total: int) -> Dict[str, float]:
    """Return BAPOPolicyLossFn keyword arguments for one of CANDIDATE_GRIDS (paper rho0)."""
    (a_hi, b_hi, d_hi), (a_lo, b_lo, d_lo) = CANDIDATE_GRIDS[total]
    return dict(
        ratio_lower_start=a_lo,
        ratio_lower_max=b_lo,
        ratio_lower_step=d_lo,
        ratio_upper_start=a_hi,
        ratio_upper_max=b_hi,
        ratio_upper_step=d_hi,
        positive_contribution_target=PAPER["positive_contribution_target"],
    )


def make_batch(
    shape: Tuple[int, ...],
    seed: int,
    negative_share: float = 0.85,
    device: str = "cpu",
    requires_grad: bool = False,
) -> Dict[str, torch.Tensor]:
    """Build one micro-batch.

    Float32 log-probs near an off-policy behaviour policy, a bool mask with ~10% padding, and
    advantages of magnitude 0.1..1.1 with the given negative share.

    The log-ratio spread (std 0.3) puts tokens on both sides of every paper bound, so every
    histogram bin and every clamp in the search does real work.
    """
    g = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(shape, generator=g)
    logprob = old + 0.3 * torch.randn(shape, generator=g)
    sign = torch.where(torch.rand(shape, generator=g) < negative_share, -1.0, 1.0)
    advantages = sign * (0.1 + torch.rand(shape, generator=g))
    mask = torch.rand(shape, generator=g) < 0.9
    batch = dict(logprob=logprob, old_logprob=old, action_mask=mask, advantages=advantages)
    batch = {k: v.to(device) for k, v in batch.items()}
    if requires_grad:
        batch["logprob"].requires_grad_(True)
    return batch


def input_bytes(batch: Dict[str, torch.Tensor]) -> int:
    """Bytes held by the four input tensors (the RSS ratio's denominator)."""
    return sum(t.numel() * t.element_size() for t in batch.values())


def ratio_of(batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ratio, finite) exactly as BAPOPolicyLossFn computes them before the search."""
    raw = batch["logprob"].detach() - batch["old_logprob"]
    ratio = torch.exp(torch.clamp(raw, min=-20.0, max=20.0))
    finite = torch.isfinite(raw + batch["advantages"])
    return ratio, finite
