"""The torch.distributed side of BAPO: sum the per-candidate contributions over a DP group.

Kept apart from the pure search so that each can be tested alone. The first synchronised call
on a group all-gathers each rank's settings (a fingerprint and the two grid lengths), so that
ranks configured differently fail together instead of adding up unrelated sums. From then on
a call makes one all-reduce of the search's header and candidate sums, nothing more. A rank
whose own inputs failed still joins that all-reduce with a header that says so: every rank of
the group then raises in the same call, and no later call pairs with the wrong one.
"""

import warnings
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from trinity.algorithm.policy_loss_fn.bapo_search import FAILED

_warned_missing_group = False


def _warn_missing_group_once() -> None:
    global _warned_missing_group
    if not _warned_missing_group:
        _warned_missing_group = True
        warnings.warn(
            "BAPO: sync_across_dp is on but the trainer passed no dp_group while "
            f"torch.distributed runs {dist.get_world_size()} ranks; each rank will choose its "
            "own clip bounds. Pass the data-parallel group (TrinityPolicyLoss forwards the "
            "engine's dp_group) or set sync_across_dp: false to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )


def _gather(values: torch.Tensor, group) -> List[torch.Tensor]:
    """Every rank's copy of ``values``, in group-rank order."""
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(gathered, values, group=group)
    return gathered


class ContributionSync:
    """Sums a rank's search vector over its dp_group, checking the group's settings once."""

    def __init__(self, settings: Sequence[int], enabled: bool):
        """Keep the settings every rank must share, and whether to synchronise at all."""
        self.settings = list(settings)
        self.enabled = enabled
        self._checked: Dict[int, object] = {}  # id -> group; the reference keeps ids unique

    def __getstate__(self) -> Dict:
        """Pickle without the checked groups (process groups do not travel; Ray pickles us)."""
        return {**self.__dict__, "_checked": {}}

    def group_for(self, dp_group) -> Optional[object]:
        """The group to reduce over, or None where the search stays local.

        The group given is the group used: with none given nothing is reduced (never WORLD by
        default), and a warning says so once when several ranks are running.
        """
        if not self.enabled:
            return None
        if dp_group is None:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                _warn_missing_group_once()
            return None
        if dist.get_rank(group=dp_group) < 0:
            raise RuntimeError(
                f"BAPO: global rank {dist.get_rank()} is not a member of the dp_group passed to "
                "the policy loss; pass the data-parallel group this rank belongs to"
            )
        return dp_group if dist.get_world_size(group=dp_group) > 1 else None

    def reduce(self, sums: torch.Tensor, group) -> List[float]:
        """The sums over ``group`` (this rank's own with no group) as a list: one host transfer.

        Raises a ``RuntimeError`` naming the ranks whose inputs failed in this call, if any.
        """
        if group is not None:
            self._all_reduce(sums, group)
        values = sums.tolist()
        if group is not None and values[FAILED] > 0:
            failed = self._failed_ranks(group, False, sums.device)
            raise RuntimeError(
                f"BAPO: the policy loss failed on global rank(s) {failed} of the dp_group in "
                "this call (their own errors say why); every rank of the group stops with them"
            )
        return values

    def report_failure(self, failure: torch.Tensor, group) -> None:
        """Join this call's collectives for a rank whose inputs failed; its caller re-raises."""
        self._all_reduce(failure, group)
        self._failed_ranks(group, True, failure.device)

    def _all_reduce(self, sums: torch.Tensor, group) -> None:
        """Sum in place in one all-reduce, after the group's settings check on first use."""
        if id(group) not in self._checked:
            self._check_settings(group, sums.device)
            self._checked[id(group)] = group
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)

    @staticmethod
    def _failed_ranks(group, failed: bool, device) -> List[int]:
        """Global ranks that failed; only a failed call pays for this extra all-gather."""
        flag = torch.tensor([float(failed)], dtype=torch.float64, device=device)
        ranks = dist.get_process_group_ranks(group)
        return [rank for rank, theirs in zip(ranks, _gather(flag, group)) if theirs.item() > 0]

    def _check_settings(self, group, device) -> None:
        """All-gather each rank's settings once per group; raise on every rank if they differ."""
        mine = torch.tensor(self.settings, dtype=torch.int64, device=device)
        ranks = dist.get_process_group_ranks(group)
        by_setting: Dict[tuple, List[int]] = {}
        for rank, theirs in zip(ranks, _gather(mine, group)):
            by_setting.setdefault(tuple(theirs.tolist()), []).append(rank)
        if len(by_setting) > 1:
            kinds = "; ".join(
                f"global ranks {members}: fingerprint {key[0]:#x}, {key[1]} lower and {key[2]} "
                "upper candidates"
                for key, members in by_setting.items()
            )
            raise RuntimeError(
                "BAPO: the policy loss settings (candidate grids, positive_contribution_target, "
                "search_order, contribution or clip_ratio_c) differ between the ranks of the "
                f"dp_group ({kinds}); every data-parallel rank must use the same "
                "policy_loss_fn_args"
            )
