"""The torch.distributed side of BAPO: one all-reduce of the search's bins over the dp_group.

Every rank builds the loss from the one config Trinity hands all workers, so the vectors share
one layout, and their sum is the union's bins.
"""

from typing import List, Optional

import torch
import torch.distributed as dist


def all_reduce_bins(bins, length: int, group, error: Optional[Exception]) -> List[float]:
    """Sum ``bins`` over ``group`` (none, or one rank: this rank's own) and return them.

    ``error``, what failed here before the collective, is raised after it; the other ranks
    then raise a ``RuntimeError`` that says another rank's loss failed.
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return bins.tolist()
    gloo = dist.get_backend(group) == "gloo"
    device = torch.device("cpu") if gloo else torch.accelerator.current_accelerator()
    try:
        if error is not None:
            raise error
        vector = bins.to(device, torch.float64)
    except Exception as caught:  # the other ranks are on their way to the all-reduce
        error = caught
        vector = torch.zeros(length, dtype=torch.float64, device=device)
        vector[0] = 1.0
    dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=group)
    values = vector.tolist()
    if error is not None:
        raise error
    if values[0] > 0:
        raise RuntimeError(
            "BAPO: the policy loss failed on another rank of the dp_group in this call "
            "(that rank's error says why); every rank stops with it"
        )
    return values
