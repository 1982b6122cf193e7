"""Shared pieces of the BAPO data-parallel checks: configs, per-rank data, a tiny policy.

Imported by the torchrun worker (``bapo_checks.py``, next to this file) and by the pytest driver
(``tests/test_bapo_distributed.py``), so that the driver can rebuild exactly what each rank saw
and compute the single-process answer on the union itself. Nothing here touches BAPO's code.
"""

from typing import Dict, List

import torch

# Search settings exercised by every check: both orders x both contribution definitions, on the
# paper's grid and on the authors' grids (their yaml, and their run script whose 0.95 / 2.0
# ends are reached only through the ``min(c + step, max)`` cap).
CONFIGS: Dict[str, Dict] = {
    "paper_upper_surrogate": dict(search_order="upper_first", contribution="surrogate"),
    "paper_upper_gradient": dict(search_order="upper_first", contribution="gradient"),
    "paper_lower_surrogate": dict(search_order="lower_first", contribution="surrogate"),
    "paper_lower_gradient": dict(search_order="lower_first", contribution="gradient"),
    "yaml_lower_surrogate": dict(
        search_order="lower_first",
        contribution="surrogate",
        ratio_lower_start=0.6,
        ratio_lower_max=0.8,
        ratio_lower_step=0.05,
        ratio_upper_start=1.2,
        ratio_upper_max=2.0,
        ratio_upper_step=0.05,
        positive_contribution_target=0.5,
    ),
    "script_lower_gradient": dict(
        search_order="lower_first",
        contribution="gradient",
        ratio_lower_start=0.8,
        ratio_lower_max=0.95,
        ratio_lower_step=0.1,
        ratio_upper_start=1.2,
        ratio_upper_max=2.0,
        ratio_upper_step=0.3,
        positive_contribution_target=1 / 3,
    ),
}

# The paper's Sec. 5.1 values; a config above overrides some of them.
PAPER = dict(
    ratio_lower_start=0.6,
    ratio_lower_max=0.9,
    ratio_lower_step=0.02,
    ratio_upper_start=1.2,
    ratio_upper_max=3.0,
    ratio_upper_step=0.05,
    positive_contribution_target=0.4,
    clip_ratio_c=3.0,
)


def loss_kwargs(name: str, **extra) -> Dict:
    """Full BAPOPolicyLossFn keyword arguments of one named config."""
    return {**PAPER, **CONFIGS[name], **extra}


CASES = ("mixed", "one_empty", "signs")

# Per-rank share of positive advantages in the "mixed" case (ranks beyond 4 reuse these).
_POSITIVE_SHARE = (0.45, 0.2, 0.7, 0.3)
_LOG_RATIO_SHIFT = (0.1, -0.1, 0.25, 0.0)


def _case_seed(seed: int, case: str, rank: int) -> int:
    return seed * 10_000 + CASES.index(case) * 100 + rank


def make_case(case: str, rank: int, world: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """One rank's padded micro-batch for ``case``; differs in shape and sign mix per rank.

    - ``mixed``: every rank has both signs, in different proportions.
    - ``one_empty``: as ``mixed`` but the last rank's response mask is all zero (its values are
      wild on purpose: a rank that leaks masked tokens into the sums is caught).
    - ``signs``: rank 0 only positive advantages, rank 1 only negative, the rest mixed.

    Returns float32 ``logprob``, ``old_logprob``, ``advantages``, an int ``mask`` and the
    per-row response lengths ``response_len`` (the mask is zero beyond them, as padding is).
    """
    gen = torch.Generator().manual_seed(_case_seed(seed, case, rank))
    rows, width = 3 + rank, 6 + 3 * rank
    response_len = torch.randint(width // 2, width + 1, (rows,), generator=gen)
    response_len[0] = width  # at least one row fills the padded width
    inside = torch.arange(width).unsqueeze(0) < response_len.unsqueeze(1)
    mask = inside & (torch.rand(rows, width, generator=gen) > 0.15)

    share = _POSITIVE_SHARE[rank % len(_POSITIVE_SHARE)]
    if case == "signs" and rank < 2:
        share = 1.0 if rank == 0 else 0.0
    positive = torch.rand(rows, width, generator=gen) < share
    magnitude = torch.randn(rows, width, generator=gen).abs() + 0.05
    advantages = torch.where(positive, magnitude, -magnitude)

    old_logprob = -(torch.rand(rows, width, generator=gen) * 2.0 + 0.1)
    shift = _LOG_RATIO_SHIFT[rank % len(_LOG_RATIO_SHIFT)]
    log_ratio = torch.randn(rows, width, generator=gen) * 0.5 + shift
    if case == "one_empty" and rank == world - 1:
        mask = torch.zeros_like(mask)
        log_ratio = log_ratio * 10.0  # ratios far outside every range, all masked
        advantages = -advantages.abs() * 100.0
    return {
        "logprob": (old_logprob + log_ratio).float(),
        "old_logprob": old_logprob.float(),
        "advantages": advantages.float(),
        "mask": mask.to(torch.int64),
        "response_len": response_len,
    }


def case_to_lists(data: Dict[str, torch.Tensor]) -> Dict[str, List]:
    """JSON-friendly copy (floats survive the round trip exactly)."""
    return {key: value.tolist() for key, value in data.items()}


def lists_to_case(data: Dict[str, List]) -> Dict[str, torch.Tensor]:
    """Turn a case's JSON lists back into tensors."""
    return {
        "logprob": torch.tensor(data["logprob"], dtype=torch.float32),
        "old_logprob": torch.tensor(data["old_logprob"], dtype=torch.float32),
        "advantages": torch.tensor(data["advantages"], dtype=torch.float32),
        "mask": torch.tensor(data["mask"], dtype=torch.int64),
    }


# --------------------------------------------------------------------------- tiny policy

VOCAB, WIDTH = 7, 3
TOKENS_PER_RANK = 24  # equal on every rank, so the mean of per-rank token-means is the union's
_GRAD_SHAPES = ((4, 8), (3, 10), (5, 6), (6, 5))
_GRAD_POSITIVE_SHARE = (1.0, 0.0, 0.5, 0.3)  # rank 0 all positive, rank 1 all negative


def tiny_policy_params(seed: int = 0) -> Dict[str, torch.Tensor]:
    """Embedding + output matrix of a bigram policy, float64 so sums agree to ~1e-12."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(VOCAB, WIDTH, generator=gen, dtype=torch.float64) * 0.7,
        "out": torch.randn(WIDTH, VOCAB, generator=gen, dtype=torch.float64) * 0.7,
    }


def tiny_policy_logprob(params: Dict[str, torch.Tensor], prev: torch.Tensor, target: torch.Tensor):
    """Return log pi(target | prev) for every position."""
    logits = params["embed"][prev] @ params["out"]
    return torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


def make_policy_batch(rank: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A rank's tokens for the gradient check: its own shape, exactly TOKENS_PER_RANK unmasked.

    ``log_ratio`` is the wanted log-ratio; the old log-prob is the current one minus it, so the
    ratios spread over [0.4, 2.5] whatever the parameters are.
    """
    gen = torch.Generator().manual_seed(seed * 1000 + 17 + rank)
    rows, width = _GRAD_SHAPES[rank % len(_GRAD_SHAPES)]
    order = torch.randperm(rows * width, generator=gen)
    mask = torch.zeros(rows * width, dtype=torch.int64)
    mask[order[:TOKENS_PER_RANK]] = 1
    share = _GRAD_POSITIVE_SHARE[rank % len(_GRAD_POSITIVE_SHARE)]
    positive = torch.rand(rows, width, generator=gen) < share
    magnitude = torch.rand(rows, width, generator=gen, dtype=torch.float64) + 0.1
    return {
        "prev": torch.randint(0, VOCAB, (rows, width), generator=gen),
        "target": torch.randint(0, VOCAB, (rows, width), generator=gen),
        "log_ratio": (torch.rand(rows, width, generator=gen, dtype=torch.float64) - 0.5) * 1.8,
        "advantages": torch.where(positive, magnitude, -magnitude),
        "mask": mask.reshape(rows, width),
    }
