"""The torch.distributed side of BAPO: sum the search's vector over the data-parallel group.

A call makes one all-reduce of ``[header | search sums]``: the header counts the ranks whose
inputs failed and carries the settings' fingerprint as 16-bit lanes and their squares, so every
rank reads alike whether settings differ (``n * sum(f^2) == sum(f)^2`` only if all agree). The
vectors' length is kept per process and live group (weakly), not per loss object, so a pickled
or new loss sends what its peers expect; where a rank's own length differs (a group's first
call, new grids), the group's length goes first, then with equal settings all ranks resize.
"""

import hashlib
import warnings
import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

FAILED = 0  # header: ranks whose inputs failed, then the fingerprint lanes, then their squares
LANES = 3  # of 16 bits: the sums of squares stay exact in float64 for up to 2**21 ranks
HEADER = 1 + 2 * LANES


def fingerprint(settings: str) -> List[int]:
    """The settings' sha256 as three 16-bit lanes."""
    digest = hashlib.sha256(settings.encode()).digest()
    return [int.from_bytes(digest[2 * k : 2 * k + 2], "big") for k in range(LANES)]


def _device(group) -> torch.device:
    """Where the group's backend reduces: host memory for gloo, else the current accelerator."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.accelerator.current_accelerator() or torch.device("cpu")


class ContributionSync:
    """Sums a rank's search vector over its dp_group, with the settings check in its header."""

    _lengths: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()  # per group

    def __init__(self, settings: str, enabled: bool):
        """Fingerprint the settings every rank must share; keep whether to synchronise."""
        self.lanes = fingerprint(settings)
        self.enabled = enabled
        self.warned = False  # about a missing group, once per loss
        self._headers: Dict[tuple, torch.Tensor] = {}

    def group_for(self, dp_group) -> Optional[object]:
        """The group to reduce over, or None where the search stays local.

        The group given is the group used: none means no reduction (never WORLD by default).
        """
        if not self.enabled:
            return None
        if dp_group is None:
            if not self.warned and dist.is_initialized() and dist.get_world_size() > 1:
                self.warned = True
                warnings.warn(
                    "BAPO: sync_across_dp is on but the trainer passed no dp_group to the loss; "
                    f"each of the {dist.get_world_size()} ranks chooses its own clip bounds",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None
        if dist.get_rank(group=dp_group) < 0:
            raise RuntimeError(
                f"BAPO: global rank {dist.get_rank()} is not a member of the dp_group passed to "
                "the policy loss; pass the data-parallel group this rank belongs to"
            )
        return dp_group if dist.get_world_size(group=dp_group) > 1 else None

    def reduce(self, sums, group, error: Optional[Exception] = None) -> List[float]:
        """The sums (a tensor, None on failure) over ``group`` (this rank's own without one).

        ``error``, what failed here before the collective, is re-raised after the all-reduce;
        the other ranks then raise a ``RuntimeError`` naming this rank.
        """
        if group is None:
            if error is not None:
                raise error
            return sums.tolist()
        device, length = _device(group), self._lengths.get(group, 0)
        moved = body = torch.zeros(length, dtype=torch.float64, device=device)
        try:
            if error is not None:
                raise error
            moved = sums.to(device, torch.float64)
            body = moved if len(moved) == length else body
        except Exception as caught:  # the peers are on their way to the all-reduce
            error = caught
        values = self._exchange(body, error, group, device)
        if len(moved) != length:  # no rank failed, all settings agree: all resize alike
            self._lengths[group] = len(moved)
            values = self._exchange(moved, None, group, device)
        return values[HEADER:]

    def _exchange(self, body: torch.Tensor, error, group, device) -> List[float]:
        """One all-reduce of ``[header | body]``; every rank raises if any failed or differs."""
        failed = error is not None
        key = (str(device), failed)  # built once: a copy from host memory would wait on the device
        if key not in self._headers:
            header = [float(failed), *self.lanes, *(lane * lane for lane in self.lanes)]
            self._headers[key] = torch.tensor(header, dtype=torch.float64, device=device)
        vector = torch.cat([self._headers[key], body])
        dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
        values, size = vector.tolist(), dist.get_world_size(group=group)
        sums, squares = values[1 : 1 + LANES], values[1 + LANES : HEADER]
        if values[FAILED] or any(size * int(q) != int(s) ** 2 for s, q in zip(sums, squares)):
            self._raise_on_every_rank(self._headers[key][: 1 + LANES], error, group)
        return values

    @staticmethod
    def _raise_on_every_rank(row: torch.Tensor, error, group) -> None:
        """All-gather each rank's ``row`` (failure flag, lanes), name the ranks, then raise."""
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(rows, row, group=group)
        if error is not None:
            raise error
        by_row: dict = {}
        for rank, theirs in zip(dist.get_process_group_ranks(group), rows):
            by_row.setdefault(tuple(int(x) for x in theirs.tolist()), []).append(rank)
        failed = [rank for key, ranks in by_row.items() if key[FAILED] for rank in ranks]
        if failed:
            raise RuntimeError(
                f"BAPO: the policy loss failed on global rank(s) {sorted(failed)} of the "
                "dp_group in this call (their own errors say why); every rank stops with them"
            )
        kinds = "; ".join(f"global ranks {ranks}: {key[1:]}" for key, ranks in by_row.items())
        raise RuntimeError(
            "BAPO: the policy loss settings (grids, target, search_order, contribution, "
            f"clip_ratio_c or loss_agg_mode) differ between the ranks of the dp_group ({kinds} "
            "as settings fingerprints); every data-parallel rank must use the same arguments"
        )
