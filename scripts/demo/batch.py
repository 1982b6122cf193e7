"""Lay a rank's rollout out as Trinity's trainer hands it to the actor.

Trinity's ``VERLTrainer._update_actor`` converts the left/right-padded batch with its own
``left_right_2_no_padding``: ``input_ids`` and ``position_ids`` become jagged tensors holding
only the real tokens, ``loss_mask`` copies ``response_mask``, and ``max_seq_len`` /
``max_response_len`` / ``indices`` ride along as non-tensor data. We call that function itself.
It packs with flash-attention's ``unpad_input``, which a CPU-only install lacks, so
``use_torch_unpad_input`` gives it the same packing written in plain torch.
"""

import torch
from tensordict import TensorDict

from demo.policy import position_ids_for


def torch_unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor):
    """``flash_attn.bert_padding.unpad_input``'s first four results, in plain torch.

    The kept rows of ``hidden_states`` (batch x seq x ...) in row-major order, their flat
    indices, the cumulative sequence lengths starting at 0, and the longest length.
    """
    lengths = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(lengths.max())


def use_torch_unpad_input() -> None:
    """Point Trinity's ``left_right_2_no_padding`` at ``torch_unpad_input`` (CPU, no flash-attn)."""
    import trinity.trainer.verl.monkey_patch as trinity_patch

    trinity_patch.unpad_input = torch_unpad_input


def rollout_tensordict(
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
) -> TensorDict:
    """The padded batch as Trinity's trainer holds it, converted by Trinity to no-padding form."""
    from trinity.trainer.verl.monkey_patch import left_right_2_no_padding

    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    data = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids_for(attention_mask),
            "response_mask": response_mask,
            "old_log_probs": old_log_probs,
            "advantages": advantages,
        },
        batch_size=[prompts.shape[0]],
    )
    use_torch_unpad_input()
    return left_right_2_no_padding(data)
