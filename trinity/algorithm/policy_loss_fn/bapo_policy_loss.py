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
import numbers
from decimal import Decimal
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from trinity.algorithm.policy_loss_fn.bapo_search import (
    CONTRIBUTIONS,
    LOG_RATIO_CLAMP,
    SEARCH_ORDERS,
    BoundSearch,
    candidate_grid,
)
from trinity.algorithm.policy_loss_fn.bapo_sync import ContributionSync
from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn
from trinity.algorithm.utils import aggregate_loss, masked_mean

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# The loss compares ratios with the bounds in the model's precision, so a bound must survive
# the cast to float32 (bfloat16 has the same range): no underflow to 0, no overflow to inf.
SMALLEST_BOUND = float(torch.finfo(torch.float32).tiny)
LARGEST_BOUND = float(torch.finfo(torch.float32).max)


def _require(condition: bool, name: str, allowed: str, value) -> None:
    if not condition:
        raise ValueError(f"BAPO: `{name}` must be {allowed}, got {value!r}")


def _choice(name: str, value, choices: Tuple[str, ...]) -> None:
    _require(value in choices, name, f"one of {choices}", value)


def _number(name: str, value) -> float:
    """Any finite real number as a float: Python, numpy, ``Decimal`` or a 0-d tensor."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool:
        value = value.item()
    real = isinstance(value, (numbers.Real, Decimal)) and not isinstance(value, (bool, np.bool_))
    _require(real, name, "a real number (int, float, Decimal, numpy or 0-d tensor)", value)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    _require(math.isfinite(number), name, "a finite number", value)
    return number


def _movable_range(prefix: str, values, smallest: float, largest: float, allowed: str, cap: bool):
    """Validate one movable range (start, max, step) and return its exact candidate grid."""
    names = (f"{prefix}_start", f"{prefix}_max", f"{prefix}_step")
    start, maximum, step = (_number(name, value) for name, value in zip(names, values))
    for name, value in zip(names, (start, maximum)):
        _require(smallest <= value <= largest, name, allowed, value)
    _require(start <= maximum, names[0], f"<= {names[1]} ({maximum})", start)
    if start < maximum:
        _require(step > 0, names[2], "> 0 when the range is not a point", step)
    return candidate_grid(start, maximum, step, cap, name=names[2])


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
        _choice("search_order", search_order, SEARCH_ORDERS)
        _choice("contribution", contribution, CONTRIBUTIONS)
        _choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
        target = _number("positive_contribution_target", positive_contribution_target)
        _require(0.0 <= target <= 1.0, "positive_contribution_target", "in [0, 1]", target)
        if clip_ratio_c is not None:
            clip_ratio_c = _number("clip_ratio_c", clip_ratio_c)
            _require(clip_ratio_c > 1.0, "clip_ratio_c", "> 1 (or None to disable)", clip_ratio_c)
        flag = isinstance(sync_across_dp, (bool, np.bool_))
        _require(flag, "sync_across_dp", "a boolean (true or false)", sync_across_dp)
        cap = search_order == "lower_first"
        lower = _movable_range(
            "ratio_lower",
            (ratio_lower_start, ratio_lower_max, ratio_lower_step),
            SMALLEST_BOUND,
            1.0,
            f"in (0, 1] and at least {SMALLEST_BOUND:.3g} (the smallest normal float32)",
            cap,
        )
        upper = _movable_range(
            "ratio_upper",
            (ratio_upper_start, ratio_upper_max, ratio_upper_step),
            1.0,
            LARGEST_BOUND,
            f"a ratio >= 1 and at most {LARGEST_BOUND:.3g} (the largest float32)",
            cap,
        )
        self.search = BoundSearch(lower, upper, target, search_order, contribution, clip_ratio_c)
        self.sync_across_dp = bool(sync_across_dp)
        self.sync = ContributionSync(self.search.settings, self.sync_across_dp)
        self.clip_ratio_c = clip_ratio_c
        self.loss_agg_mode = loss_agg_mode

    _runtime_keys = {"dp_group"}  # passed by the trainer alongside the batch, not read from it

    def __call__(  # type: ignore
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        dp_group=None,
        **kwargs,
    ) -> Tuple[torch.Tensor, Dict]:
        """Choose the clip pair for this micro-batch (over the group); return the clipped loss.

        When the sums are synchronised, a rank whose inputs fail still joins the all-reduce,
        so that every rank of the group raises in this same call rather than pairing its next
        collective with the wrong one.
        """
        group = self.sync.group_for(dp_group)
        try:
            ratio, log_ratio, advantages, sums = self._search_inputs(
                logprob, old_logprob, action_mask, advantages
            )
        except Exception:
            if group is not None:  # the peers must neither wait nor pair with the next call
                device = logprob.device if isinstance(logprob, torch.Tensor) else None
                self.sync.report_failure(self.search.failure_sums(device), group)
            raise
        choice = self.search.decide(self.sync.reduce(sums, group))

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

    def _search_inputs(self, logprob, old_logprob, action_mask, advantages):
        """Check the inputs; return the ratio, log-ratio, cleaned advantages and local sums."""
        shapes = {t.shape for t in (logprob, old_logprob, action_mask, advantages)}
        if len(shapes) != 1:
            raise ValueError(
                "BAPO: logprob, old_logprob, action_mask and advantages must share one shape, "
                f"got {tuple(logprob.shape)}, {tuple(old_logprob.shape)}, "
                f"{tuple(action_mask.shape)}, {tuple(advantages.shape)}"
            )
        # Masked tokens take part in nothing: zeroed before any arithmetic, so that even a NaN
        # there reaches neither the loss nor its gradient. Live tokens see PPO's exact values.
        masked = action_mask == 0
        raw_log_ratio = (logprob - old_logprob).masked_fill(masked, 0.0)
        advantages = advantages.masked_fill(masked, 0.0)
        log_ratio = torch.clamp(raw_log_ratio, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        # One test covers every input: NaN and +-inf survive the sum (inf - inf is NaN), while
        # the clamp above would hide an infinite log-prob inside a finite ratio.
        checked = raw_log_ratio.detach() + advantages.detach()
        if action_mask.dtype != torch.bool:  # a NaN mask value leaves its token live (NaN != 0)
            checked = checked + action_mask.detach()
        finite = torch.isfinite(checked)
        weight = None
        if self.search.contribution == "gradient":
            weight = self._gradient_weights(raw_log_ratio.detach(), action_mask)
        sums = self.search.local_sums(ratio, advantages, action_mask, finite, weight)
        return ratio, log_ratio, advantages, sums

    def _gradient_weights(self, raw_log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each token's factor in dL/dlogp besides |A| r: what autograd gives it.

        The aggregation's own weight (up to one constant per call, which rho does not see) and
        0 past the log-ratio clamp, where the loss no longer depends on logp.
        """
        weight = mask.to(torch.float64)
        if self.loss_agg_mode == "seq-mean-token-mean":  # each sequence weighs 1 / its length
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-8)
        return weight.masked_fill(raw_log_ratio.abs() > LOG_RATIO_CLAMP, 0.0)

    def _clipped_loss(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        low: float,
        high: float,
    ) -> Tuple[torch.Tensor, Dict]:
        """Compute PPO's clipped surrogate with explicit bounds, and its dual clip for A < 0.

        The expressions and metrics are ``PPOPolicyLossFn``'s, so with both ranges collapsed
        to points the loss, its gradient and the clip fractions are PPO's exactly.
        """
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, low, high)
        losses = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean(torch.gt(clipped, unclipped).float(), mask)
        clipfrac_lower = torch.zeros((), device=ratio.device)
        if self.clip_ratio_c is not None:
            dual = -advantages * self.clip_ratio_c
            negative = advantages < 0
            clipfrac_lower = masked_mean(torch.gt(losses, dual) * negative.float(), mask)
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
