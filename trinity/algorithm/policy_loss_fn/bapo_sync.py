"""The torch.distributed side of BAPO: sum the per-candidate contributions over a DP group.

Kept apart from the pure search so that each can be tested alone. One all-reduce per loss call
carries every candidate's sums, so all ranks of the group walk identical numbers and pick the
same clip pair.
"""

import warnings

import torch
import torch.distributed as dist

from trinity.algorithm.policy_loss_fn.bapo_search import SYNC_LENGTH

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


def reduce_contribution_sums(sums: torch.Tensor, dp_group, enabled: bool) -> int:
    """All-reduce ``sums`` in place over ``dp_group``; return how many ranks it now sums.

    The group given is the group used: with none given nothing is reduced (never WORLD by
    default), and a warning says so once when several ranks are running. Every rank sends
    ``SYNC_LENGTH`` values whatever its grids, so ranks configured differently still meet in
    one collective, where the search's fingerprint exposes them.
    """
    if not enabled:
        return 1
    if dp_group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            _warn_missing_group_once()
        return 1
    if dist.get_rank(group=dp_group) < 0:
        raise RuntimeError(
            f"BAPO: global rank {dist.get_rank()} is not a member of the dp_group passed to the "
            "policy loss; pass the data-parallel group this rank belongs to"
        )
    ranks = dist.get_world_size(group=dp_group)
    if ranks > 1:
        padded = torch.nn.functional.pad(sums, (0, SYNC_LENGTH - sums.numel()))
        dist.all_reduce(padded, op=dist.ReduceOp.SUM, group=dp_group)
        sums.copy_(padded[: sums.numel()])
    return ranks
