"""Lay a rank's rollout out exactly as verl 0.8's engine hands it to the loss.

Trinity's trainer turns the left/right-padded batch into verl's no-padding layout with
``left_right_2_no_padding``: ``input_ids`` and ``position_ids`` become jagged tensors holding
only the real tokens, ``loss_mask`` copies ``response_mask``, and ``max_seq_len`` /
``max_response_len`` / ``indices`` ride along as non-tensor data; ``prompts``, ``responses``,
``attention_mask`` and the per-token fields stay padded. That function packs with flash-attn's
``unpad_input``, which does not exist on a CPU-only install, so ``to_no_padding`` below builds
the same fields with plain torch. The split into micro-batches is the engine's own
``prepare_micro_batches``.
"""

from typing import List

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.utils import prepare_micro_batches

from demo.policy import position_ids_for


def rollout_tensordict(
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
) -> TensorDict:
    """The padded batch as Trinity's trainer builds it, converted to verl's no-padding form."""
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    data = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids_for(attention_mask),
            "response_mask": response_mask,
            "old_log_probs": old_log_probs,
            "advantages": advantages,
        },
        batch_size=[prompts.shape[0]],
    )
    return to_no_padding(data)


def to_no_padding(data: TensorDict) -> TensorDict:
    """verl's no-padding fields, as ``left_right_2_no_padding`` makes them (see above)."""
    input_ids = data.pop("input_ids")
    mask = data["attention_mask"].bool()
    lengths = mask.sum(dim=1)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    tu.assign_non_tensor_data(data, "max_seq_len", input_ids.shape[1])
    tu.assign_non_tensor_data(data, "max_response_len", data["response_mask"].shape[1])
    tu.assign_non_tensor_data(data, "indices", torch.nonzero(mask.flatten()).flatten())
    data["input_ids"] = torch.nested.nested_tensor_from_jagged(input_ids[mask], offsets=offsets)
    positions = data["position_ids"][mask]
    data["position_ids"] = torch.nested.nested_tensor_from_jagged(positions, offsets=offsets)
    data["loss_mask"] = data["response_mask"]
    return data


def split_micro_batches(data: TensorDict, micro_batches: int, dp_group) -> List[TensorDict]:
    """The engine's split with a fixed micro-batch size (``use_dynamic_bsz=False``)."""
    size = len(data) // micro_batches
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=size)
    parts, _ = prepare_micro_batches(data=data, dp_group=dp_group, same_micro_num_in_dp=True)
    return parts


def padded_inputs(micro_batch: TensorDict):
    """The padded model inputs of a micro-batch (prompts left-, responses right-padded)."""
    input_ids = torch.cat([micro_batch["prompts"], micro_batch["responses"]], dim=1)
    return input_ids, micro_batch["attention_mask"]
