"""The tiny causal LM scored in verl's layout.

The model and its sampler are the demo's (``demo.policy``: a 2-layer Llama, vocabulary 16,
random init, no download), sized for this task's prompts and longer responses.
"""

import torch
import torch.nn.functional as F

from demo.policy import logits_for


def log_softmax_for(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Per-position next-token log-probabilities (float32)."""
    return F.log_softmax(logits_for(model, input_ids, attention_mask), dim=-1)


def packed_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Next-token log-probs in verl's no-padding layout: a jagged tensor of the real tokens.

    Entry j of a row is log p(token j+1 | tokens <= j); the row's last real position has no next
    token and gets 0, which verl's ``no_padding_2_padding`` never reads.
    """
    log_softmax = log_softmax_for(model, input_ids, attention_mask)
    next_ids = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    next_lp = log_softmax.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)
    real = attention_mask.bool()
    last_real = real & ~torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    values = next_lp.masked_fill(last_real, 0.0)[real]
    lengths = real.sum(dim=1)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
