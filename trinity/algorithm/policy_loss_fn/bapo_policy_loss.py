"""BAPO policy loss: PPO clipping with bounds chosen per update.

BAPO (Balanced Policy Optimization with Adaptive Clipping, arXiv 2510.18927) keeps the PPO-clip
surrogate but picks explicit importance-ratio bounds ``c_low`` / ``c_high`` on every call,
raising them inside movable ranges until tokens with positive advantage carry at least a share
rho0 of the loss. Off-policy data otherwise lets negative tokens dominate the update, which
drives entropy down and destabilises training.

The search itself lives in ``bapo_search`` (pure tensors) and the data-parallel reduction in
``bapo_sync``; this module validates the configuration and computes the clipped loss.
"""

import math
from decimal import Decimal
from typing import Dict, Optional, Tuple

import torch

from trinity.algorithm.policy_loss_fn.bapo_search import (
    CONTRIBUTIONS,
    MAX_CANDIDATES,
    SEARCH_ORDERS,
    BoundSearch,
    candidate_grid,
)
from trinity.algorithm.policy_loss_fn.bapo_sync import reduce_contribution_sums
from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn
from trinity.algorithm.utils import aggregate_loss, masked_mean

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _require(condition: bool, name: str, allowed: str, value) -> None:
    if not condition:
        raise ValueError(f"BAPO: `{name}` must be {allowed}, got {value!r}")


def _number(name: str, value) -> float:
    is_real = isinstance(value, (int, float)) and not isinstance(value, bool)
    _require(is_real and math.isfinite(value), name, "a finite number", value)
    return float(value)


def _lower_bound_ok(value: float) -> bool:
    return 0.0 < value <= 1.0


def _upper_bound_ok(value: float) -> bool:
    return value >= 1.0


def _checked_range(prefix: str, start, maximum, step, bound_ok, allowed: str, cap: bool):
    """Validate one movable range and return its exact candidate grid."""
    start, maximum = _number(f"{prefix}_start", start), _number(f"{prefix}_max", maximum)
    step = _number(f"{prefix}_step", step)
    for name, value in ((f"{prefix}_start", start), (f"{prefix}_max", maximum)):
        _require(bound_ok(value), name, allowed, value)
    _require(start <= maximum, f"{prefix}_start", f"<= {prefix}_max ({maximum})", start)
    if start < maximum:
        _require(step > 0, f"{prefix}_step", "> 0 when the range is not a point", step)
        steps = (Decimal(repr(maximum)) - Decimal(repr(start))) / Decimal(repr(step))
        count = int(steps) + 1 + int(cap and steps != int(steps))  # the capped max adds one
        _require(
            count <= MAX_CANDIDATES,
            f"{prefix}_step",
            f"large enough for at most {MAX_CANDIDATES} candidates in [{start}, {maximum}]",
            step,
        )
    return candidate_grid(start, maximum, step, cap)


class BAPOPolicyLossFn(PolicyLossFn):
    """PPO-clip loss whose ratio bounds are searched per call (registered as ``bapo``)."""

    def __init__(
        self,
        backend: str = "verl",
        ratio_lower_start: float = 0.6,  # a-: first lower bound tried
        ratio_lower_max: float = 0.9,  # b-: highest lower bound allowed
        ratio_lower_step: float = 0.02,  # delta2: lower-bound increment
        ratio_upper_start: float = 1.2,  # a+: first upper bound tried
        ratio_upper_max: float = 3.0,  # b+: highest upper bound allowed
        ratio_upper_step: float = 0.05,  # delta1: upper-bound increment
        positive_contribution_target: float = 0.4,  # rho0: share of the loss from A > 0
        search_order: str = "upper_first",  # Algorithm 1; "lower_first" is the authors' code
        contribution: str = "surrogate",  # Eq. 8 as printed; "gradient": grad-carrying tokens
        clip_ratio_c: Optional[float] = 3.0,  # dual clip for A < 0 as in PPO; None disables it
        loss_agg_mode: str = "token-mean",
        sync_across_dp: bool = True,  # all-reduce the search sums over the trainer's dp_group
    ) -> None:
        """Validate every argument here, so a bad config fails before training starts."""
        super().__init__(backend=backend)
        _require(
            search_order in SEARCH_ORDERS, "search_order", f"one of {SEARCH_ORDERS}", search_order
        )
        _require(
            contribution in CONTRIBUTIONS, "contribution", f"one of {CONTRIBUTIONS}", contribution
        )
        _require(
            loss_agg_mode in LOSS_AGG_MODES,
            "loss_agg_mode",
            f"one of {LOSS_AGG_MODES}",
            loss_agg_mode,
        )
        target = _number("positive_contribution_target", positive_contribution_target)
        _require(0.0 <= target <= 1.0, "positive_contribution_target", "in [0, 1]", target)
        if clip_ratio_c is not None:
            clip_ratio_c = _number("clip_ratio_c", clip_ratio_c)
            _require(clip_ratio_c > 1.0, "clip_ratio_c", "> 1 (or None to disable)", clip_ratio_c)
        _require(
            isinstance(sync_across_dp, bool), "sync_across_dp", "true or false", sync_across_dp
        )
        cap = search_order == "lower_first"
        lower = _checked_range(
            "ratio_lower", ratio_lower_start, ratio_lower_max, ratio_lower_step,
            _lower_bound_ok, "in (0, 1]", cap,
        )  # fmt: skip
        upper = _checked_range(
            "ratio_upper", ratio_upper_start, ratio_upper_max, ratio_upper_step,
            _upper_bound_ok, "a ratio >= 1", cap,
        )  # fmt: skip
        self.search = BoundSearch(lower, upper, target, search_order, contribution, clip_ratio_c)
        self.clip_ratio_c = clip_ratio_c
        self.loss_agg_mode = loss_agg_mode
        self.sync_across_dp = sync_across_dp

    def __call__(  # type: ignore
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        dp_group=None,
        **kwargs,
    ) -> Tuple[torch.Tensor, Dict]:
        shapes = {t.shape for t in (logprob, old_logprob, action_mask, advantages)}
        if len(shapes) != 1:
            raise ValueError(
                "BAPO: logprob, old_logprob, action_mask and advantages must share one shape, "
                f"got {tuple(logprob.shape)}, {tuple(old_logprob.shape)}, "
                f"{tuple(action_mask.shape)}, {tuple(advantages.shape)}"
            )
        mask = action_mask.bool()
        raw_log_ratio = logprob - old_logprob
        log_ratio = torch.clamp(raw_log_ratio, min=-20.0, max=20.0)
        ratio = torch.exp(log_ratio)
        # One test covers all three inputs: NaN and +-inf survive the sum (inf - inf is NaN),
        # while the clamp above would hide an infinite log-prob inside a finite ratio.
        finite = torch.isfinite(raw_log_ratio.detach() + advantages)

        sums = self.search.local_sums(ratio, advantages, mask, finite)
        reduce_contribution_sums(sums, dp_group, self.sync_across_dp)
        choice = self.search.decide(sums)

        pg_loss, clip_metrics = self._clipped_loss(
            ratio, advantages, action_mask, choice.clip_low, choice.clip_high
        )
        metrics = {
            "bapo_clip_low": choice.clip_low,
            "bapo_clip_high": choice.clip_high,
            "bapo_positive_contribution": choice.positive_contribution,
            "bapo_target_met": float(choice.target_met),
            "bapo_search_steps": choice.steps,
            "bapo_nonfinite_tokens": choice.nonfinite_tokens,
            **clip_metrics,
            "ppo_kl": masked_mean(-log_ratio, action_mask).detach().item(),
            "pg_loss": pg_loss.detach().item(),
        }
        return pg_loss, metrics

    def _clipped_loss(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        low: float,
        high: float,
    ) -> Tuple[torch.Tensor, Dict]:
        """PPO's clipped surrogate with explicit bounds, plus PPO's dual clip for A < 0.

        The loss uses ``PPOPolicyLossFn``'s expressions, so with both ranges collapsed to
        points it and its gradient are PPO's exactly. The clip fractions are counted directly
        rather than through ``masked_mean``: the counts are exact either way, so the values are
        PPO's too, for fewer passes over the tokens.
        """
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, low, high)
        losses = torch.maximum(unclipped, clipped)
        live, tokens = mask.bool(), mask.sum() + 1e-8  # masked_mean's denominator
        clipfrac = (torch.gt(clipped, unclipped) & live).sum() / tokens
        clipfrac_lower = torch.zeros((), device=ratio.device)
        if self.clip_ratio_c is not None:
            dual = -advantages * self.clip_ratio_c
            negative = advantages < 0
            clipfrac_lower = (torch.gt(losses, dual) & negative & live).sum() / tokens
            losses = torch.where(negative, torch.min(dual, losses), losses)
        loss = aggregate_loss(losses, mask, loss_agg_mode=self.loss_agg_mode)
        return loss, {
            "pg_clipfrac": clipfrac.detach().item(),
            "pg_clipfrac_lower": clipfrac_lower.detach().item(),
        }

    @classmethod
    def default_args(cls) -> Dict:
        """The paper's Sec. 5.1 settings (see the README for the authors' variants)."""
        return {
            "ratio_lower_start": 0.6,
            "ratio_lower_max": 0.9,
            "ratio_lower_step": 0.02,
            "ratio_upper_start": 1.2,
            "ratio_upper_max": 3.0,
            "ratio_upper_step": 0.05,
            "positive_contribution_target": 0.4,
            "search_order": "upper_first",
            "contribution": "surrogate",
            "clip_ratio_c": 3.0,
            "loss_agg_mode": "token-mean",
            "sync_across_dp": True,
        }
