"""The tiny causal LM: built from a config in code, sampled, and scored in verl's layout.

Same shape as the demo's model (a 2-layer Llama, vocabulary 16, random init, no download),
with positions for this task's longer responses.
"""

from typing import Tuple

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from experiment.task import EOS, PAD, PROMPT_WIDTH, RESPONSE_LEN, VOCAB_SIZE


def build_model(seed: int) -> LlamaForCausalLM:
    """A fresh random 2-layer Llama; the same ``seed`` gives the same weights."""
    # attn_implementation is a PretrainedConfig **kwargs key, unknown to the type stubs
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=PROMPT_WIDTH + RESPONSE_LEN,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=EOS,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so left padding does not shift them."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


def log_softmax_for(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Per-position next-token log-probabilities (float32)."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_for(attention_mask),
        use_cache=False,
    )
    return F.log_softmax(out.logits.float(), dim=-1)


@torch.no_grad()
def sample_responses(
    model, prompts: torch.Tensor, prompt_mask: torch.Tensor, generator: torch.Generator, goal=None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample up to RESPONSE_LEN tokens per row at temperature 1.

    Returns right-padded ``responses``, ``response_mask`` (a response includes its first EOS)
    and the entropy of the sampling distribution at every response position (masked to 0).
    With ``goal`` (rows x vocabulary, bool), a row also ends once it holds all its goal tokens.
    """
    batch = prompts.shape[0]
    ids, mask = prompts, prompt_mask
    responses = torch.full((batch, RESPONSE_LEN), PAD, dtype=torch.long)
    response_mask = torch.zeros((batch, RESPONSE_LEN), dtype=torch.long)
    entropy = torch.zeros((batch, RESPONSE_LEN))
    alive = torch.ones(batch, dtype=torch.bool)
    seen = torch.zeros((batch, VOCAB_SIZE), dtype=torch.bool)
    for t in range(RESPONSE_LEN):
        log_probs = log_softmax_for(model, ids, mask)[:, -1]
        token = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(1)
        entropy[:, t] = -(log_probs.exp() * log_probs).sum(-1) * alive
        token = torch.where(alive, token, torch.full_like(token, PAD))
        responses[:, t] = token
        response_mask[:, t] = alive.long()
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, alive.long()[:, None]], dim=1)
        alive = alive & (token != EOS)
        if goal is not None:
            seen[torch.arange(batch), token] = True
            alive = alive & ~(goal <= seen).all(dim=1)
    return responses, response_mask, entropy


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
