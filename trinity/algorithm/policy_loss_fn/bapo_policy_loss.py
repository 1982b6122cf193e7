"""BAPO (https://arxiv.org/abs/2510.18927): PPO clipping with ratio bounds chosen per call.

On stale data negative-advantage tokens dominate the update. BAPO raises ``c_low`` / ``c_high``
inside movable ranges until positive tokens carry a share rho0 of the loss (Eq. 8); with
``sync_across_dp`` every data-parallel rank takes the pair chosen on the union of their tokens.
"""

import inspect
import math
from typing import Dict, Optional, Tuple

import torch

from trinity.algorithm.policy_loss_fn.bapo_search import bin_sums, candidate_grid, decide
from trinity.algorithm.policy_loss_fn.bapo_sync import all_reduce_bins
from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn
from trinity.algorithm.utils import aggregate_loss, masked_mean

LOG_RATIO_CLAMP = 20.0  # |log r| is clamped as PPOPolicyLossFn does


class BAPOPolicyLossFn(PolicyLossFn):
    """PPO-clip loss whose ratio bounds are searched at every call."""

    _runtime_keys = {"dp_group"}  # passed by the trainer beside the batch, not read from it

    def __init__(
        self,
        backend: str = "verl",
        ratio_lower_start: float = 0.6,
        ratio_lower_max: float = 0.9,
        ratio_lower_step: float = 0.02,
        ratio_upper_start: float = 1.2,
        ratio_upper_max: float = 3.0,
        ratio_upper_step: float = 0.05,
        positive_contribution_target: float = 0.4,
        search_order: str = "upper_first",
        clip_ratio_c: float = 3.0,
        loss_agg_mode: str = "token-mean",
        sync_across_dp: bool = True,
    ) -> None:
        """Check every argument here, so that a bad config fails before training starts.

        Args:
            backend: The training framework whose batch keys the loss reads.
            ratio_lower_start: a-, the first c_low tried.
            ratio_lower_max: b-, the highest c_low allowed.
            ratio_lower_step: delta2, the step of c_low.
            ratio_upper_start: a+, the first c_high tried.
            ratio_upper_max: b+, the highest c_high allowed.
            ratio_upper_step: delta1, the step of c_high.
            positive_contribution_target: rho0, the share of Eq. 8 that A > 0 must reach.
            search_order: ``upper_first`` (Algorithm 1) or ``lower_first`` (the authors' code).
            clip_ratio_c: PPO's dual clip for A < 0, > 1.
            loss_agg_mode: How token losses are aggregated, as ``algorithm.loss_agg_mode``.
            sync_across_dp: Sum the search over the ``dp_group`` the trainer passes.
        """
        super().__init__(backend=backend)
        if search_order not in ("upper_first", "lower_first"):
            raise ValueError("BAPO: `search_order` must be upper_first or lower_first")
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), loss_agg_mode)  # Trinity checks it
        if not isinstance(sync_across_dp, bool):
            raise ValueError(f"BAPO: `sync_across_dp` must be true or false: {sync_across_dp!r}")
        if not 0 <= positive_contribution_target <= 1:
            raise ValueError("BAPO: `positive_contribution_target` must be in [0, 1]")
        if clip_ratio_c is None or not clip_ratio_c > 1:
            raise ValueError(f"BAPO: `clip_ratio_c` must be > 1: {clip_ratio_c}")
        self.upper_first = search_order == "upper_first"  # else the authors' order
        lower = (ratio_lower_start, ratio_lower_max, ratio_lower_step, 0.0, 1.0)
        upper = (ratio_upper_start, ratio_upper_max, ratio_upper_step, 1.0, math.inf)
        self.lower = candidate_grid("ratio_lower", *lower, not self.upper_first)
        self.upper = candidate_grid("ratio_upper", *upper, not self.upper_first)
        if self.upper_first and len(self.lower) == 1 and len(self.upper) > 1:
            raise ValueError(
                "BAPO: under `search_order: upper_first` c_high rises only while c_low has room for"
                " a step: give `ratio_lower_max` room for a `ratio_lower_step`, or use lower_first"
            )
        self.target = positive_contribution_target
        self.clip_ratio_c = clip_ratio_c
        self.loss_agg_mode = loss_agg_mode
        self.sync_across_dp = sync_across_dp
        self._edges_key: Optional[tuple] = None  # the device and dtype ``bounds`` are for

    def __call__(  # type: ignore
        self,
        logprob: torch.Tensor,
        old_logprob: torch.Tensor,
        action_mask: torch.Tensor,
        advantages: torch.Tensor,
        dp_group=None,
        **kwargs,
    ) -> Tuple[torch.Tensor, Dict]:
        """Choose this call's clip pair (over the dp_group); return the clipped loss and metrics.

        Input errors are raised after the all-reduce, so that no rank of the group waits alone.
        """
        length = 2 * (len(self.lower) + len(self.upper)) + 6  # bin_sums's, fixed by the config
        try:
            ratio, log_ratio, adv, bins = self._prepare(
                logprob, old_logprob, action_mask, advantages
            )
            error = None
        except Exception as caught:
            bins, error = None, caught
        values = all_reduce_bins(bins, length, dp_group if self.sync_across_dp else None, error)
        i, j, share = decide(values, self.bounds, len(self.lower), self.target, self.upper_first)
        pg_loss, metrics = self._clipped_loss(ratio, adv, action_mask, i, j)
        return pg_loss, {
            "bapo_clip_low": self.lower[i],
            "bapo_clip_high": self.upper[j],
            "bapo_positive_contribution": share,
            "bapo_target_met": float(share >= self.target),
            "bapo_search_steps": i + j,
            "bapo_nonfinite_tokens": int(values[1]),
            **metrics,
            "ppo_kl": masked_mean(-log_ratio, action_mask).detach().item(),
            "pg_loss": pg_loss.detach().item(),
        }

    def _prepare(self, logprob, old_logprob, action_mask, advantages):
        """Return the ratio, log-ratio and advantages as the loss uses them, and the bins.

        Masked tokens are zeroed first, so that even a NaN there reaches neither loss nor gradient.
        """
        masked = action_mask == 0
        raw_log_ratio = (logprob - old_logprob).masked_fill(masked, 0.0)
        advantages = advantages.masked_fill(masked, 0.0)
        log_ratio = torch.clamp(raw_log_ratio, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        # NaN and +-inf survive the sum (inf - inf is NaN); a NaN mask value leaves a token live.
        checked = (raw_log_ratio + advantages + action_mask).detach()
        if self._edges_key != (ratio.device, ratio.dtype):  # once, not a host copy per call
            # the candidates as torch.clamp compares them (in bfloat16, 1.2 is 1.203125)
            rounded = torch.tensor(self.lower + self.upper, dtype=torch.float64).to(ratio.dtype)
            self.bounds = rounded.tolist()
            lower, upper = rounded.split([len(self.lower), len(self.upper)])
            self._edges = torch.cat([-lower.flip(0), lower.new_zeros(1), upper]).to(ratio.device)
            self._edges_key = (ratio.device, ratio.dtype)
        bins = bin_sums(ratio, advantages, ~masked, torch.isfinite(checked), self._edges)
        return ratio, log_ratio, advantages, bins

    def _clipped_loss(self, ratio, advantages, mask, i: int, j: int):
        """The clipped loss of PPOPolicyLossFn and its clip fractions, at candidate pair (i, j)."""
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, self.lower[i], self.upper[j])
        losses = torch.maximum(unclipped, clipped)
        metrics = {"pg_clipfrac": masked_mean(torch.gt(clipped, unclipped).float(), mask).item()}
        dual = -advantages * self.clip_ratio_c
        negative = advantages < 0
        dual_clipped = torch.gt(losses, dual) & negative
        metrics["pg_clipfrac_lower"] = masked_mean(dual_clipped.float(), mask).item()
        losses = torch.where(negative, torch.min(dual, losses), losses)
        return aggregate_loss(losses, mask, loss_agg_mode=self.loss_agg_mode), metrics

    @classmethod
    def default_args(cls) -> Dict:
        """Return the constructor's defaults: the paper's Sec. 5.1 settings, token-mean, synced."""
        parameters = inspect.signature(cls.__init__).parameters
        return {k: p.default for k, p in parameters.items() if k not in ("self", "backend")}
