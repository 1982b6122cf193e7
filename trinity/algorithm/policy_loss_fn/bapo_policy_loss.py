"""BAPO (https://arxiv.org/abs/2510.18927): PPO clipping with ratio bounds chosen per call.

On stale data negative-advantage tokens dominate the update: BAPO raises c_low and c_high inside
movable ranges until positive tokens carry a share rho0 of the loss (Eq. 8), over the dp_group.
With ``search_scope: update`` the pair is chosen once per optimizer update instead, from a pass
over the update's micro-batches that the trainer runs first (``optimizer_update``).
"""

import math
import numbers
from contextlib import contextmanager
from fractions import Fraction
from typing import Callable, Dict, List, Optional, Tuple, cast

import numpy as np
import torch
import torch.distributed as dist

from trinity.algorithm.key_mapper import ALL_MAPPERS
from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn
from trinity.algorithm.utils import aggregate_loss, masked_mean

LOG_RATIO_CLAMP = 20.0  # |log r| is clamped as PPOPolicyLossFn does
MAX_CANDIDATES = 10_000  # per range: a call sums Eq. 8 at every candidate, so the grid is held
FLOAT32_MAX = torch.finfo(torch.float32).max  # the largest bound torch.clamp takes for float32
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def number(name: str, value, low: float, high: float) -> float:
    """``value`` as a float; a ``ValueError`` naming ``name`` unless it is a number in range."""
    if isinstance(value, np.floating):  # as it prints: np.float32(0.02) is 0.0199999995 as a float
        value = float(str(value))
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and low <= cast(float, value) <= high):
        raise ValueError(f"BAPO: `{name}` must be a number in [{low}, {high}]: {value!r}")
    return float(value)


def candidates(name: str, start, maximum, step, low: float, high: float, cap: bool) -> List[float]:
    """The bounds ``start + k * step`` <= ``maximum`` of range ``name``, in decimal arithmetic."""
    # 0.6 + 15 * 0.02 is 0.9 here, not 0.8999...; ``cap``: the authors' min(c + step, max) end
    start = number(f"{name}_start", start, low, high)
    maximum = number(f"{name}_max", maximum, start, high)
    if start == maximum:  # a point: its step is never used, but a typo in it is still refused
        number(f"{name}_step", step, -math.inf, math.inf)
        return [start]
    a, b, d = (Fraction(str(x)) for x in (start, maximum, number(f"{name}_step", step, 0, high)))
    if not (d > 0 and (b - a) // d + 1 + (cap and (b - a) % d != 0) <= MAX_CANDIDATES):
        raise ValueError(f"BAPO: `{name}_step` must be > 0, for {MAX_CANDIDATES} bounds at most")
    grid = [float(a + k * d) for k in range((b - a) // d + 1)]
    return grid + [maximum] if cap and grid[-1] < maximum else grid


def collective_device(group) -> Optional[str]:
    """Where ``group``'s all-reduce runs: the device of its backend for host-bound collectives."""
    return None if group is None else dist.distributed_c10d._get_object_coll_device(group)


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
        positive_contribution_target: float = 0.4,  # rho0, the share A > 0 must carry in Eq. 8
        search_order: str = "upper_first",  # Algorithm 1; lower_first: the authors' code
        clip_ratio_c: float = 3.0,  # C, PPO's dual clip for A < 0
        loss_agg_mode: str = "token-mean",
        sync_across_dp: bool = True,  # choose over the dp_group that the trainer passes
        search_scope: str = "micro_batch",  # update: one pair per optimizer update
    ) -> None:
        """Check every argument, so that a bad config fails before training starts.

        Where the literal loop would keep the start pair silently, upper_first refuses a lower
        range without room for a step beside a movable upper range: it could never adapt.
        """
        if not (isinstance(backend, str) and backend in ALL_MAPPERS):
            raise ValueError(f"BAPO: `backend` must be one of {list(ALL_MAPPERS)}: {backend!r}")
        super().__init__(backend=backend)
        if not isinstance(sync_across_dp, bool):  # a quoted 'false' from YAML would sync
            raise ValueError(f"BAPO: `sync_across_dp` must be true or false: {sync_across_dp!r}")
        if search_order not in ("upper_first", "lower_first"):
            raise ValueError("BAPO: `search_order` must be upper_first or lower_first")
        if loss_agg_mode not in AGG_MODES:
            raise ValueError(f"BAPO: `loss_agg_mode` must be one of {', '.join(AGG_MODES)}")
        self.target = number("positive_contribution_target", positive_contribution_target, 0, 1)
        self.clip_ratio_c = number("clip_ratio_c", clip_ratio_c, 1, FLOAT32_MAX)
        if self.clip_ratio_c == 1:
            raise ValueError("BAPO: `clip_ratio_c` must be > 1")
        self.upper_first = search_order == "upper_first"
        lower = (ratio_lower_start, ratio_lower_max, ratio_lower_step, 0.0, 1.0)
        upper = (ratio_upper_start, ratio_upper_max, ratio_upper_step, 1.0, FLOAT32_MAX)
        self.lower = candidates("ratio_lower", *lower, cap=not self.upper_first)
        self.upper = candidates("ratio_upper", *upper, cap=not self.upper_first)
        if self.upper_first and len(self.lower) == 1 and len(self.upper) > 1:
            raise ValueError(
                "BAPO: under `search_order: upper_first` c_high rises only while c_low has room for"
                " a step: give `ratio_lower_max` room for a `ratio_lower_step`, or use lower_first"
            )
        self.loss_agg_mode = loss_agg_mode
        self.sync_across_dp = sync_across_dp
        if search_scope not in ("micro_batch", "update"):
            raise ValueError("BAPO: `search_scope` must be micro_batch or update")
        self.per_update = search_scope == "update"
        self._pass: Optional[dict] = None  # while the pass runs: its summed Eq. 8, group, error
        self._fixed: Optional[Tuple[int, int, float]] = None  # the update's pair and rho

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

        A rank whose inputs fail (whatever they are) still joins the one all-reduce, with its
        failure flag set, on the device of the group's backend: every rank raises in this call,
        that rank its own error, the others a ``RuntimeError``.
        """
        group = dp_group if self.sync_across_dp and dist.is_initialized() else None
        if self._pass is not None:
            return self._observe(logprob, old_logprob, action_mask, advantages, group)
        if self.per_update and self._fixed is None:
            raise RuntimeError(
                "BAPO: `search_scope: update` needs the trainer's pass over each optimizer "
                "update's data (Trinity's verl engine worker runs it); none ran for this call"
            )
        if self._fixed is not None:  # the update's pair, agreed in its pass: no collective
            group = None
        device = collective_device(group)
        try:
            ratio, log_ratio, advantages, unclipped, bounds, sums = self._prepare(
                logprob, old_logprob, action_mask, advantages
            )
            sums = sums if device is None else sums.to(device)
        except Exception:
            self._join_failed(device, group)
            raise
        i, j, rho = self._fixed or self._decide(sums, group)
        low, high = bounds[0][i], bounds[1][j]
        pg_loss, metrics = self._clipped_loss(ratio, advantages, unclipped, action_mask, low, high)
        return pg_loss, {
            "bapo_clip_low": self.lower[i],
            "bapo_clip_high": self.upper[j],
            "bapo_positive_contribution": rho,
            "bapo_target_met": float(rho >= self.target),
            "bapo_search_steps": i + j,
            **metrics,
            "ppo_kl": masked_mean(-log_ratio, action_mask).detach().item(),
            "pg_loss": pg_loss.detach().item(),
        }

    def _decide(self, sums: torch.Tensor, group) -> Tuple[int, int, float]:
        """The pair and rho on ``sums`` summed over ``group``; raises if a rank's flag is set."""
        if group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        values = sums.tolist()
        if values[0] > 0:
            raise RuntimeError("BAPO: the policy loss failed on another rank of the dp_group")
        return self._search(values)

    def _join_failed(self, device, group) -> None:
        """Join the all-reduce that the other ranks of ``group`` make, with the failure flag set."""
        if device is not None:
            size = 1 + len(self.upper) + len(self.lower)
            failed = torch.zeros(size, dtype=torch.float64, device=device)
            failed[0] = 1.0
            dist.all_reduce(failed, op=dist.ReduceOp.SUM, group=group)

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
        self._pass, self._fixed = {"sums": None, "group": None, "error": None}, None
        try:
            run_pass()
            self._end_pass()
            yield
        finally:
            self._pass = self._fixed = None

    def _observe(self, logprob, old_logprob, action_mask, advantages, group):
        """Add one micro-batch's sums to the pass's; a failure is kept for ``_end_pass``.

        No rank raises here: the engine's collectives in the pass's later micro-batches must
        still meet on every rank. The loss returned, whatever the inputs, is a zero that the pass
        does not use.
        """
        state = cast(dict, self._pass)
        state.update(group=group, device=collective_device(group), seen=True)
        try:
            sums = self._prepare(logprob, old_logprob, action_mask, advantages)[-1]
            sums = sums if state["device"] is None else sums.to(state["device"])
            state["sums"] = sums if state["sums"] is None else state["sums"] + sums
        except Exception as error:
            state["error"] = state["error"] or error
        zero = logprob.new_zeros(()) if isinstance(logprob, torch.Tensor) else torch.zeros(())
        return zero, {}

    def _end_pass(self) -> None:
        """Fix the update's pair from the pass: one all-reduce over the group its calls got.

        A rank whose pass failed joins it with its failure flag set and raises its own error;
        the others raise a ``RuntimeError``, as in a failing call under ``micro_batch``.
        """
        state, self._pass = cast(dict, self._pass), None
        if "seen" not in state:
            raise RuntimeError("BAPO: the pass over the optimizer update saw no micro-batch")
        if state["error"] is not None:
            self._join_failed(state["device"], state["group"])
            raise state["error"]
        self._fixed = self._decide(state["sums"], state["group"])

    def _prepare(self, logprob, old_logprob, action_mask, advantages):
        """Ratio, log-ratio, advantages, unclipped loss, bounds, ``[0, P..., N...]`` in float64."""
        # Eq. 8 at every candidate: P = sum_{A>0} A min(r, c_high), N = sum_{A<0} |A| max(r,
        # c_low); slot 0 is the failure flag. Masked tokens are zeroed first: no NaN there counts.
        masked = action_mask == 0
        advantages = advantages.masked_fill(masked, 0.0)
        log_ratio = (logprob - old_logprob).masked_fill(masked, 0.0)
        log_ratio = torch.clamp(log_ratio, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        unclipped = -advantages * ratio
        r, a = ratio.detach().reshape(-1).double(), advantages.detach().reshape(-1).double()
        # The bounds as torch.clamp compares them with ``ratio``; one past the dtype's largest
        # finite value clips as that value (torch.clamp refuses it: overflow).
        top = torch.finfo(ratio.dtype).max
        lower, upper = ([min(c, top) for c in grid] for grid in (self.lower, self.upper))
        bounds = [torch.tensor(grid, dtype=ratio.dtype).tolist() for grid in (lower, upper)]
        # A token weighs in P only where A > 0 and in N only where A < 0: elsewhere its ratio
        # (inf in float16 past log r = 11.09) is replaced, since 0 * inf would make a sum NaN.
        positive, negative = a.clamp(min=0), -a.clamp(max=0)
        r_positive, r_negative = torch.where(a > 0, r, 0.0), torch.where(a < 0, r, 0.0)
        clamped = torch.empty_like(r)  # one buffer for every candidate: no allocation per bound
        sums = [a.new_zeros(())]
        sums += [positive @ torch.clamp(r_positive, max=c, out=clamped) for c in bounds[1]]
        sums += [negative @ torch.clamp(r_negative, min=c, out=clamped) for c in bounds[0]]
        return ratio, log_ratio, advantages, unclipped, bounds, torch.stack(sums)

    def _search(self, sums: List[float]) -> Tuple[int, int, float]:
        """Indices of (c_low, c_high) and rho there: the path's first pair with rho not < rho0."""
        # Algorithm 1 raises c_high to b+, then c_low to b-; the authors' code c_low, then c_high.
        # A NaN rho (a NaN on some rank) is not < rho0: every rank keeps the start pair.
        n_lower, n_upper = len(self.lower), len(self.upper)
        positive, negative = sums[1 : 1 + n_upper], sums[1 + n_upper :]

        def rho(i: int, j: int) -> float:
            total = positive[j] + negative[i]
            return 1.0 if total == 0 else positive[j] / total

        if self.upper_first:
            path = [(0, j) for j in range(n_upper)] + [(i, n_upper - 1) for i in range(1, n_lower)]
        else:
            path = [(i, 0) for i in range(n_lower)] + [(n_lower - 1, j) for j in range(1, n_upper)]
        i, j = next((pair for pair in path if not rho(*pair) < self.target), path[-1])
        return i, j, rho(i, j)

    def _clipped_loss(self, ratio, advantages, unclipped, mask, low: float, high: float):
        """The clipped loss of PPOPolicyLossFn and its clip fractions, at bounds (low, high)."""
        clipped = -advantages * torch.clamp(ratio, low, high)
        losses = torch.maximum(unclipped, clipped)
        metrics = {"pg_clipfrac": masked_mean(torch.gt(clipped, unclipped).float(), mask).item()}
        dual = -advantages * self.clip_ratio_c
        negative = advantages < 0
        dual_clipped = (torch.gt(losses, dual) & negative).float()
        metrics["pg_clipfrac_lower"] = masked_mean(dual_clipped, mask).item()
        losses = torch.where(negative, torch.min(dual, losses), losses)
        return aggregate_loss(losses, mask, loss_agg_mode=self.loss_agg_mode), metrics

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
