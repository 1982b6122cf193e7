"""What every rank of the engine checks builds: the tiny model, the loss config, its batches.

Shared by the torchrun workers (``engine_checks.py``, ``engine_worker_checks.py``) so that all
ranks start from the same weights and each data-parallel rank gets its own, different data.
"""

import torch
from tensordict import TensorDict
from transformers import LlamaConfig, LlamaForCausalLM

from bapo_dist_common import loss_kwargs
from demo.batch import rollout_tensordict
from demo.loss import loss_config

VOCAB, PAD = 16, 0
PROMPT_WIDTH, RESPONSE_LEN = 6, 6
BATCH = 8  # sequences per data-parallel rank and step
STEPS = 2  # train_batch calls per phase
# Phases of one launch: sync_across_dp, a config of bapo_dist_common.CONFIGS, and whether the
# loss comes from the released losses.py (patch 0002 reverted). ``gradient`` stops the search at
# the first pair that meets the target, so pairs land inside the grid, not only at its corners.
PHASES = {
    "sync": (True, "paper_upper_gradient", False),
    "authors": (True, "yaml_lower_surrogate", False),
    "nosync": (False, "paper_upper_gradient", False),
    "released": (True, "paper_upper_gradient", True),
}
# Per data-parallel rank share of sequences with a positive advantage: rank 0 mostly positive,
# rank 1 mostly negative, so a rank that searched alone would pick another pair.
POSITIVE_SHARE = (0.75, 0.15, 0.5, 0.3)


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """A random 2-layer Llama small enough for a CPU test (the same on every rank)."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=PROMPT_WIDTH + RESPONSE_LEN,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def algo_config(sync: bool, config_name: str):
    """Trinity's AlgorithmConfig for BAPO with a named config, nothing else in the loss."""
    return loss_config("bapo", {**loss_kwargs(config_name), "sync_across_dp": sync})


def make_rank_batch(dp_rank: int, step: int) -> TensorDict:
    """One data-parallel rank's batch for one step, in verl's no-padding layout.

    Prompts are left-padded, responses right-padded, with lengths 2 to 4 on even ranks and 4 to
    6 on odd ones; every sequence has one advantage (GRPO-like) whose sign follows the rank's
    share; old log-probs spread so that the ratios to the model's log-probs cover both clip
    ranges.
    """
    gen = torch.Generator().manual_seed(1000 * dp_rank + step)
    low = 2 if dp_rank % 2 == 0 else 4  # odd ranks hold longer sequences, so more tokens
    prompt_len = torch.randint(low, low + 3, (BATCH,), generator=gen)
    response_len = torch.randint(low, low + 3, (BATCH,), generator=gen)
    columns = torch.arange(PROMPT_WIDTH)
    prompt_mask = (columns >= PROMPT_WIDTH - prompt_len[:, None]).long()
    response_mask = (torch.arange(RESPONSE_LEN) < response_len[:, None]).long()
    prompts = torch.randint(1, VOCAB, (BATCH, PROMPT_WIDTH), generator=gen) * prompt_mask
    responses = torch.randint(1, VOCAB, (BATCH, RESPONSE_LEN), generator=gen) * response_mask
    share = POSITIVE_SHARE[dp_rank % len(POSITIVE_SHARE)]
    sign = torch.where(torch.rand(BATCH, generator=gen) < share, 1.0, -1.0)
    advantages = (sign * (torch.rand(BATCH, generator=gen) + 0.2))[:, None] * response_mask
    old = -(torch.rand(BATCH, RESPONSE_LEN, generator=gen) * 2.5 + 1.5) * response_mask
    return rollout_tensordict(prompts, prompt_mask, responses, response_mask, old, advantages)
