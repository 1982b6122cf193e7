"""A verifiable task on which wrong answers are long: list the prompt's tokens, then stop.

A prompt is 2 to 4 distinct content tokens followed by SEP. A response is at most
``RESPONSE_LEN`` tokens and ends with its first EOS. Its reward is

    reward = |distinct prompt tokens in the body| / max(len(body), k)      (k = prompt size)

where the body is the response before EOS; a response that reaches the length limit without
EOS is truncated and scores 0, as truncated reasoning does in verifiable-reward training. The
best answer, 1, is every prompt token once (any order) and then EOS, at most 5 tokens. So the
answers that fail most are the ones that ramble on to the limit (10 tokens): under GRPO their
negative advantages are carried by about twice as many tokens as the positive ones, the
imbalance the BAPO paper (arXiv 2510.18927, Sec. 3) names.
"""

from typing import List, Sequence

import torch

PAD, SEP, EOS = 0, 1, 2
FIRST_CONTENT = 3
VOCAB_SIZE = 16
PROMPT_MIN, PROMPT_MAX = 2, 4  # content tokens per prompt
RESPONSE_LEN = 10  # the length limit
PROMPT_WIDTH = PROMPT_MAX + 1  # content tokens + SEP, left-padded to this width


def sample_prompts(count: int, generator: torch.Generator) -> List[List[int]]:
    """``count`` prompts of distinct content tokens, each closed by SEP."""
    prompts = []
    n_content = VOCAB_SIZE - FIRST_CONTENT
    for _ in range(count):
        length = int(torch.randint(PROMPT_MIN, PROMPT_MAX + 1, (1,), generator=generator))
        tokens = torch.randperm(n_content, generator=generator)[:length] + FIRST_CONTENT
        prompts.append(tokens.tolist() + [SEP])
    return prompts


def reward(prompt: Sequence[int], response: Sequence[int]) -> float:
    """Score one response against its prompt (0 when it never emits EOS)."""
    response = list(response)
    if EOS not in response:
        return 0.0
    body = response[: response.index(EOS)]
    wanted = {t for t in prompt if t >= FIRST_CONTENT}
    return len(wanted & set(body)) / max(len(body), len(wanted))


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, over the group's (unbiased) std + eps."""
    groups = rewards.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + eps)).reshape(-1)
