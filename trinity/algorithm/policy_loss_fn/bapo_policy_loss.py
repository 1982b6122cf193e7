"""BAPO policy loss: PPO clipping with bounds chosen per micro-batch.

BAPO (Balanced Policy Optimization with Adaptive Clipping, arXiv 2510.18927) keeps the PPO-clip
surrogate but picks explicit importance-ratio bounds ``c_low`` / ``c_high`` at every call,
raising them inside movable ranges until tokens with positive advantage carry at least a share
rho0 of the loss; on stale data, negative tokens otherwise dominate the update and entropy
collapses. Trinity calls the loss once per micro-batch; with ``sync_across_dp`` every rank of
the data-parallel group takes the pair chosen on the union of their micro-batches.
"""

import inspect
import math
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from trinity.algorithm.policy_loss_fn.bapo_search import (
    LOG_RATIO_CLAMP,
    BoundSearch,
    candidate_grid,
)
from trinity.algorithm.policy_loss_fn.bapo_sync import ContributionSync
from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn
from trinity.algorithm.utils import aggregate_loss, masked_mean

SEARCH_ORDERS = ("upper_first", "lower_first")  # Algorithm 1, the authors' code
CONTRIBUTIONS = ("surrogate", "gradient")  # Eq. 8 as printed, the update's share
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# The loss compares ratios with the bounds in the model's precision, so a bound must survive
# the cast to float32 (bfloat16 has the same range): no underflow to 0, no overflow to inf.
FLOAT32 = torch.finfo(torch.float32)
RATIO_RANGES = {"ratio_lower": (float(FLOAT32.tiny), 1.0), "ratio_upper": (1.0, float(FLOAT32.max))}


def _check(name: str, value, allowed: str, low=-math.inf, high=math.inf, choices=None):
    """Return ``value`` (as a float unless ``choices``), or raise a ``ValueError`` naming it.

    A number is whatever ``float()`` takes but a boolean, finite and within ``[low, high]``.
    """
    if choices is None:
        try:
            number = math.nan if isinstance(value, (bool, np.bool_)) else float(value)
        except (TypeError, ValueError, OverflowError):
            number = math.nan
        if math.isfinite(number) and low <= number <= high:
            return number
    elif value in choices:
        return value
    raise ValueError(f"BAPO: `{name}` must be {allowed}, got {value!r}")


def _grid(prefix: str, start, maximum, step, cap: bool):
    """One movable range (start, max, step) as its exact candidate grid."""
    low, high = RATIO_RANGES[prefix]
    allowed = f"a ratio in [{low:.3g}, {high:.3g}]"
    start = _check(f"{prefix}_start", start, allowed, low, high)
    maximum = _check(f"{prefix}_max", maximum, f"{allowed} and >= {prefix}_start", start, high)
    smallest = math.ulp(0.0) if start < maximum else -math.inf
    step = _check(f"{prefix}_step", step, "> 0 unless the range is a point", smallest)
    return candidate_grid(start, maximum, step, cap, f"{prefix}_step")


class BAPOPolicyLossFn(PolicyLossFn):
    """PPO-clip loss whose ratio bounds are searched per call (registered as ``bapo``)."""

    _runtime_keys = {"dp_group"}  # passed by the trainer beside the batch, not read from it

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
        contribution: str = "surrogate",  # Eq. 8 as printed; "gradient": the update's share
        clip_ratio_c: Optional[float] = 3.0,  # dual clip for A < 0 as in PPO; None disables it
        loss_agg_mode: str = "token-mean",  # Trinity's aggregation, as algorithm.loss_agg_mode
        sync_across_dp: bool = True,  # all-reduce the search sums over the trainer's dp_group
    ) -> None:
        """Check every argument here, so that a bad config fails before training starts."""
        super().__init__(backend=backend)
        _check("search_order", search_order, f"one of {SEARCH_ORDERS}", choices=SEARCH_ORDERS)
        _check("contribution", contribution, f"one of {CONTRIBUTIONS}", choices=CONTRIBUTIONS)
        _check("loss_agg_mode", loss_agg_mode, f"one of {LOSS_AGG_MODES}", choices=LOSS_AGG_MODES)
        if not isinstance(sync_across_dp, (bool, np.bool_)):
            raise ValueError(
                f"BAPO: `sync_across_dp` must be true or false, got {sync_across_dp!r}"
            )
        target = positive_contribution_target
        target = _check("positive_contribution_target", target, "in [0, 1]", 0.0, 1.0)
        if clip_ratio_c is not None:
            clip_ratio_c = _check("clip_ratio_c", clip_ratio_c, "> 1 or null", math.nextafter(1, 2))
        cap = search_order == "lower_first"
        lower = _grid("ratio_lower", ratio_lower_start, ratio_lower_max, ratio_lower_step, cap)
        upper = _grid("ratio_upper", ratio_upper_start, ratio_upper_max, ratio_upper_step, cap)
        if not cap and len(lower) == 1 < len(upper):
            raise ValueError(
                "BAPO: under `search_order: upper_first` (Algorithm 1) c_high rises only while "
                "c_low has room for a step, so a lower range without one (a point, or "
                "ratio_lower_start + ratio_lower_step > ratio_lower_max) never adapts; give the "
                "lower range room or use `search_order: lower_first`"
            )
        self.search = BoundSearch(lower, upper, target, search_order, contribution, clip_ratio_c)
        settings = (lower, upper, target, search_order, contribution, clip_ratio_c, loss_agg_mode)
        self.sync = ContributionSync(repr(settings), bool(sync_across_dp))
        self.sync_across_dp = bool(sync_across_dp)
        self.clip_ratio_c = clip_ratio_c
        self.loss_agg_mode = loss_agg_mode

    def __call__(  # type: ignore
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        dp_group=None,
        **kwargs,
    ) -> Tuple[torch.Tensor, Dict]:
        """Choose this micro-batch's clip pair (over the group) and return the clipped loss.

        What fails in the inputs is raised only after this rank joined the group's
        all-reduce, so that every rank raises in this same call and none is left waiting.
        """
        group = self.sync.group_for(dp_group)
        try:
            ratio, log_ratio, advantages, sums = self._search_inputs(
                logprob, old_logprob, action_mask, advantages
            )
            error = None
        except Exception as caught:
            sums, error = None, caught
        choice = self.search.decide(self.sync.reduce(sums, group, error))
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
        shapes = [tuple(t.shape) for t in (logprob, old_logprob, action_mask, advantages)]
        if len(set(shapes)) != 1:
            raise ValueError(
                "BAPO: logprob, old_logprob, action_mask and advantages must share one shape, "
                f"got {shapes}"
            )
        dtypes = [t.dtype for t in (logprob, old_logprob, advantages)]
        if not all(dtype.is_floating_point for dtype in dtypes):
            raise ValueError(
                f"BAPO: logprob, old_logprob and advantages must be floating point, got {dtypes}"
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
        weight = None
        if self.search.contribution == "gradient":
            weight = self._gradient_weights(raw_log_ratio.detach(), action_mask)
        finite = torch.isfinite(checked)
        sums = self.search.local_sums(ratio, advantages, action_mask, finite, weight)
        return ratio, log_ratio, advantages, sums

    def _gradient_weights(self, raw_log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each token's factor in dL/dlogp besides |A| r: d aggregate_loss / d its loss.

        The per-call normaliser included, rho summed over ranks is the share of the update
        that data-parallel averaging applies. 0 past the log-ratio clamp (a flat loss).
        """
        probe = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
        weight = torch.func.grad(lambda x: aggregate_loss(x, mask, self.loss_agg_mode))(probe)
        return weight.masked_fill(raw_log_ratio.abs() > LOG_RATIO_CLAMP, 0.0)

    def _clipped_loss(self, ratio, advantages, mask, low: float, high: float):
        """The clipped loss and metrics of PPOPolicyLossFn, with explicit bounds."""
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
        """The constructor's defaults: the paper's Sec. 5.1 settings, token-mean, synced."""
        parameters = inspect.signature(cls.__init__).parameters
        return {key: p.default for key, p in parameters.items() if key not in ("self", "backend")}
