"""Causal LMs built in code, nothing downloaded: the tiny Llama, its sampler, Qwen2, OLMo-2."""

from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

from scripts.harness.tasks import EOS, MAX_POSITIONS, PAD, RESPONSE_LEN, VOCAB_SIZE


def build_model(seed: int, hidden: int = 64) -> LlamaForCausalLM:
    """A fresh random 2-layer Llama; the same ``seed`` gives the same weights."""
    # 4 heads with as many key-value heads, and untied embeddings: the defaults
    shape: Dict[str, Any] = dict(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4
    )
    tokens: Dict[str, Any] = dict(pad_token_id=PAD, bos_token_id=None, eos_token_id=EOS)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, num_hidden_layers=2, **shape, **tokens)
    config.max_position_embeddings, config._attn_implementation = MAX_POSITIONS, "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def build_qwen2(shape: Dict[str, Any], dtype: torch.dtype, device: Any) -> PreTrainedModel:
    """A random Qwen2 causal LM of ``shape`` (``Qwen2Config`` arguments)."""
    return build_random(Qwen2Config(**shape), dtype, device)


def build_random(config: PretrainedConfig, dtype: torch.dtype, device: Any) -> PreTrainedModel:
    """A random causal LM of ``config``, seed 0, on ``device``.

    Its weights are made on ``device``, so a 0.5B model needs no float32 copy in host memory.
    """
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype=dtype)  # type: ignore[call-arg]  # mypy misreads transformers' `to`


def save_model(model: PreTrainedModel, folder: Path) -> Path:
    """Write a model as a Hugging Face folder the engine can load (rank 0, then a barrier)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(str(folder), safe_serialization=True)
    if dist.is_initialized():
        dist.barrier()
    return folder


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so left padding does not shift them."""
    return (attention_mask.cumsum(dim=1) - 1).clamp(min=0)


@torch.no_grad()
def sample_responses(model, prompts, prompt_mask, generator, goal=None, response_len=RESPONSE_LEN):
    """Right-padded responses, mask, log-probs (as an inference engine reports them), entropy.

    Temperature 1; a response ends at its first EOS, or once it holds all its ``goal`` tokens.
    """
    batch = prompts.shape[0]
    ids, mask = prompts, prompt_mask
    responses = torch.full((batch, response_len), PAD, dtype=torch.long)
    response_mask = torch.zeros((batch, response_len), dtype=torch.long)
    sampled_lp = torch.zeros((batch, response_len))
    entropy = torch.zeros((batch, response_len))
    alive = torch.ones(batch, dtype=torch.bool)
    seen = torch.zeros((batch, VOCAB_SIZE), dtype=torch.bool)
    for t in range(response_len):
        positions = position_ids_for(mask)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        log_probs = F.log_softmax(out.logits[:, -1].float(), dim=-1)
        token = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(1)
        sampled_lp[:, t] = log_probs.gather(1, token[:, None]).squeeze(1) * alive
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
    return responses, response_mask, sampled_lp, entropy
