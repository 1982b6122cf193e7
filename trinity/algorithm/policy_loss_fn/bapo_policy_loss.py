"""BAPO (https://arxiv.org/abs/2510.18927): PPO clipping with ratio bounds chosen per call.

On stale data negative tokens dominate: c_low and c_high rise until positive ones carry rho0.
With ``search_scope: update`` the pair is chosen once per optimizer update instead, from a pass
over the update's micro-batches that the trainer runs first (``optimizer_update``).
"""

import math
from contextlib import contextmanager
from fractions import Fraction
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch
import torch.distributed as dist

from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn

LOG_RATIO_CLAMP = 20.0  # |log r| is clamped as PPOPolicyLossFn does
MAX_RATIO = math.exp(LOG_RATIO_CLAMP)  # no ratio exceeds it: a larger c_high would never clip
MAX_STEPS = 10_000  # per range: a call sums Eq. 8 at every candidate, so the grid is held
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def number(name: str, value, low: float, high: float) -> float:
    """``value`` as a float; a ``ValueError`` naming ``name`` unless it is a number in range."""
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and low <= value <= high):
        raise ValueError(f"BAPO: `{name}` must be a number in [{low}, {high}]: {value!r}")
    return float(value)


def candidates(name: str, start, maximum, step, low: float, high: float, cap: bool) -> List[float]:
    """The bounds ``start + k * step`` <= ``maximum`` of range ``name``: 0.6 + 15 * 0.02 is 0.9."""
    start = number(f"{name}_start", start, low, high)
    maximum = number(f"{name}_max", maximum, start, high)
    step = number(f"{name}_step", step, 0, math.inf)  # a point never uses its step
    if start == maximum:
        return [start]
    a, b, d = (Fraction(str(x)) for x in (start, maximum, step))
    if b - a > MAX_STEPS * d:  # a step of 0 too, which never reaches the max
        raise ValueError(f"BAPO: `{name}_step` {step} makes over {MAX_STEPS} steps to {maximum}")
    grid = [float(a + k * d) for k in range((b - a) // d + 1)]
    grid += [maximum] if cap and grid[-1] < maximum else []  # the authors' min(c + d, b)
    if len(set(grid)) < len(grid):  # the walk would raise a bound to itself
        raise ValueError(f"BAPO: `{name}_step` {step} is finer than floats in [{start}, {maximum}]")
    return grid


def below(ratio: torch.Tensor, grid: List[float], capped: bool) -> torch.Tensor:
    """How many bounds of the grid lie below each r, as searchsorted counts: by step, a cap apart.

    For bounds of a few decimals, no ratio of float32 or a narrower dtype lies within float64's
    rounding of one without being it: the count is exact (a float64 one may count a tie's way).
    """
    count = ratio.sub(grid[0]).mul_(1 / (grid[1] - grid[0]) if len(grid) > 1 else 1.0).ceil_()
    count = count.clamp_(0, len(grid) - capped)
    return count.add_(ratio > grid[-1]) if capped else count


def _at_most(sums: torch.Tensor) -> torch.Tensor:  # per c_k: over the tokens with r <= c_k
    return sums.cumsum(0)[:-1]


def _above(sums: torch.Tensor) -> torch.Tensor:  # per c_k: over the tokens with r > c_k
    return sums.flip(0).cumsum(0).flip(0)[1:]


class BAPOPolicyLossFn(PolicyLossFn):
    """PPO-clip loss whose ratio bounds are searched at every call (Algorithm 1)."""

    _runtime_keys = {"dp_group"}  # passed by the trainer beside the batch, not read from it

    def __init__(
        self,
        backend: str = "verl",
        ratio_lower_start: float = 0.6,  # a-, the first c_low tried
        ratio_lower_max: float = 0.9,  # b-, the highest c_low
        ratio_lower_step: float = 0.02,  # delta2, the step of c_low
        ratio_upper_start: float = 1.2,  # a+, the first c_high tried
        ratio_upper_max: float = 3.0,  # b+, the highest c_high
        ratio_upper_step: float = 0.05,  # delta1, the step of c_high
        positive_contribution_target: float = 0.4,  # rho0 (Eq. 8), Sec. 5.1's; authors' README: 0.5
        search_order: str = "upper_first",  # Algorithm 1; lower_first: the authors' code
        clip_ratio_c: float = 3.0,  # C, PPO's dual clip for A < 0
        loss_agg_mode: str = "token-mean",
        sync_across_dp: bool = True,  # choose over the dp_group that the trainer passes
        search_scope: str = "micro_batch",  # update: one pair per optimizer update
    ) -> None:
        """Check every argument a config can hold, each refused with a ValueError naming it."""
        super().__init__(backend=backend)
        if not isinstance(sync_across_dp, bool):  # a quoted 'false' from YAML would sync
            raise ValueError(f"BAPO: `sync_across_dp` must be true or false: {sync_across_dp!r}")
        if search_order not in ("upper_first", "lower_first"):
            raise ValueError("BAPO: `search_order` must be upper_first or lower_first")
        if loss_agg_mode not in AGG_MODES:
            raise ValueError(f"BAPO: `loss_agg_mode` must be one of {', '.join(AGG_MODES)}")
        self.target = number("positive_contribution_target", positive_contribution_target, 0, 1)
        if number("clip_ratio_c", clip_ratio_c, 1, math.inf) == 1:  # PPO's dual clip needs C > 1
            raise ValueError("BAPO: `clip_ratio_c` must be > 1")
        self.capped = search_order == "lower_first"  # the authors' loops cap the last bound
        lower = (ratio_lower_start, ratio_lower_max, ratio_lower_step, 0.0, 1.0)
        upper = (ratio_upper_start, ratio_upper_max, ratio_upper_step, 1.0, MAX_RATIO)
        self.lower = candidates("ratio_lower", *lower, cap=self.capped)
        self.upper = candidates("ratio_upper", *upper, cap=self.capped)
        if not self.capped and len(self.lower) == 1 and len(self.upper) > 1:  # c_high would stay
            raise ValueError("BAPO: upper_first needs `ratio_lower_max` room; or use lower_first")
        lows, highs = range(len(self.lower)), range(len(self.upper))  # (i, j): (c_low, c_high)
        high_first = [(0, j) for j in highs] + [(i, highs[-1]) for i in lows[1:]]  # Algorithm 1
        low_first = [(i, 0) for i in lows] + [(lows[-1], j) for j in highs[1:]]  # authors' code
        self.path = low_first if self.capped else high_first
        self.sync_across_dp = sync_across_dp
        self.ppo_args: Dict[str, Any] = dict(clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode)
        if search_scope not in ("micro_batch", "update"):
            raise ValueError("BAPO: `search_scope` must be micro_batch or update")
        self.per_update = search_scope == "update"
        self._pass: Optional[dict] = None  # while the pass runs: its summed Eq. 8 and group
        self._fixed: Optional[Tuple[int, int, float]] = None  # the update's pair and rho

    def __call__(  # type: ignore
        self, logprob, old_logprob, action_mask, advantages, dp_group=None, **kwargs
    ) -> Tuple[torch.Tensor, Dict]:
        """The clip pair chosen over the dp_group, and PPO's loss and metrics at that pair."""
        group = dp_group if self.sync_across_dp and dist.is_initialized() else None
        if self._pass is not None:
            return self._observe(logprob, old_logprob, action_mask, advantages, group)
        if self.per_update and self._fixed is None:
            raise RuntimeError(
                "BAPO: `search_scope: update` needs the trainer's pass over each optimizer "
                "update's data (Trinity's verl engine worker runs it); none ran for this call"
            )
        log_r, advantages, c, sums = self._prepare(logprob, old_logprob, action_mask, advantages)
        if group is not None and self._fixed is None:  # the fixed pair needs no collective
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)  # Eq. 8 on the ranks' union
        i, j, rho = self._fixed or self._search(sums.tolist())
        eps = dict(clip_range_low=1 - c[i], clip_range_high=c[len(self.lower) + j] - 1)  # PPO's
        ppo = PPOPolicyLossFn(backend=self.backend, **eps, **self.ppo_args)
        # PPO reads logprob - old_logprob alone: the masked log-ratio against an old one of 0
        pg_loss, metrics = ppo(log_r, log_r.new_zeros(()), action_mask, advantages)
        return pg_loss, {
            "bapo_clip_low": self.lower[i],
            "bapo_clip_high": self.upper[j],
            "bapo_positive_contribution": rho,
            "bapo_target_met": float(rho >= self.target),
            "bapo_search_steps": i + j,
            **metrics,
        }

    @contextmanager
    def optimizer_update(self, data, run_pass: Callable):
        """Around one optimizer update on ``data`` (Trinity's verl worker enters it).

        Under ``search_scope: update``, ``run_pass()`` (the engine's no-grad forward over the
        update's micro-batches through this loss) sums Eq. 8 over them, the pair is fixed by one
        all-reduce and holds for the update's training calls; it is released after, whatever
        happens. Under ``micro_batch`` nothing runs.
        """
        if not self.per_update:
            yield
            return
        self._pass, self._fixed = {"sums": None, "group": None}, None
        try:
            run_pass()
            self._end_pass()
            yield
        finally:
            self._pass = self._fixed = None

    def _observe(self, logprob, old_logprob, action_mask, advantages, group):
        """Add one micro-batch's sums to the pass's; its loss is a zero the pass does not use."""
        state = cast(dict, self._pass)
        sums = self._prepare(logprob, old_logprob, action_mask, advantages)[-1]
        state.update(group=group, sums=sums if state["sums"] is None else state["sums"] + sums)
        return logprob.new_zeros(()), {}

    def _end_pass(self) -> None:
        """Fix the update's pair from the pass: one all-reduce over the group its calls got."""
        state, self._pass = cast(dict, self._pass), None
        if state["sums"] is None:
            raise RuntimeError("BAPO: the pass over the optimizer update saw no micro-batch")
        if state["group"] is not None:
            dist.all_reduce(state["sums"], op=dist.ReduceOp.SUM, group=state["group"])
        self._fixed = self._search(state["sums"].tolist())

    def _prepare(self, logprob, old_logprob, action_mask, advantages):
        """Log-ratio and advantages for PPO (masked tokens zeroed), bounds c, Eq. 8's P and N."""
        advantages = torch.where(action_mask.bool(), advantages, 0.0)
        log_r = torch.where(action_mask.bool(), logprob - old_logprob, 0.0)
        ratio = torch.exp(torch.clamp(log_r.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        a, r = advantages.detach().reshape(-1).double(), ratio.reshape(-1).double()
        c = torch.tensor(self.lower + self.upper, dtype=ratio.dtype).tolist()  # as PPO clamps
        lows, half = len(self.lower), len(c) + 1  # c[:lows]: the c_low candidates
        # A token's bucket k, in its sign's half: the exact bounds below r; PPO clamps at c, in r's
        # dtype: no r lies between. A tie r = c_k may go either way; a NaN A or r: P's first, NaN.
        bucket = below(r, self.lower, self.capped).add_(below(r, self.upper, self.capped))
        bucket = bucket.add_(a.sign().neg_().clamp_(min=0), alpha=half).nan_to_num_().long()
        weight = a.abs()
        sums = [a.new_zeros(2 * half).index_add_(0, bucket, v) for v in (weight * r, weight)]
        (pos_ar, neg_ar), (pos_a, neg_a) = (v.view(2, half) for v in sums)  # by A's sign
        # Eq. 8 at each bound: P = sum_{A>0} A min(r, c_high), N = sum_{A<0} |A| max(r, c_low)
        positive = _at_most(pos_ar)[lows:] + r.new_tensor(c[lows:]) * _above(pos_a)[lows:]
        negative = _above(neg_ar)[:lows] + r.new_tensor(c[:lows]) * _at_most(neg_a)[:lows]
        return log_r, advantages, c, torch.cat([positive, negative])  # synced by .tolist()

    def _search(self, sums: List[float]) -> Tuple[int, int, float]:
        """Indices of (c_low, c_high) and rho there: the path's first pair with rho not < rho0."""
        positive, negative = sums[: len(self.upper)], sums[len(self.upper) :]

        def rho(i: int, j: int) -> float:  # Eq. 8; 1 where no token counts
            total = positive[j] + negative[i]
            return 1.0 if total == 0 else positive[j] / total

        # A NaN rho (a NaN on any rank) is not < rho0: every rank keeps the start pair.
        i, j = next((pair for pair in self.path if not rho(*pair) < self.target), self.path[-1])
        return i, j, rho(i, j)

    @classmethod
    def default_args(cls) -> Dict:
        """Return the paper's Sec. 5.1 settings, token-mean, synchronised."""
        return {
            "ratio_lower_start": 0.6,
            "ratio_lower_max": 0.9,
            "ratio_lower_step": 0.02,
            "ratio_upper_start": 1.2,
            "ratio_upper_max": 3.0,
            "ratio_upper_step": 0.05,
            "positive_contribution_target": 0.4,
            "search_order": "upper_first",
            "clip_ratio_c": 3.0,
            "loss_agg_mode": "token-mean",
            "sync_across_dp": True,
            "search_scope": "micro_batch",
        }
