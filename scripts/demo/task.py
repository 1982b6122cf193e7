"""A synthetic task with a verifiable reward: repeat the prompt's tokens.

A prompt is a few distinct content tokens followed by SEP. The response (at most
``RESPONSE_LEN`` tokens, ended early by EOS) earns

    reward = 0.5 * precision + 0.5 * coverage

where precision is the share of the ``RESPONSE_LEN`` slots holding a prompt token and coverage
is the share of distinct prompt tokens that appear in the response. A random policy scores about
0.25; the best score, 1, needs every prompt token and nothing else. Coverage keeps a collapsed
policy (one prompt token repeated) below the optimum, so the task rewards keeping some entropy,
while a 2-layer transformer can learn it with attention in a few hundred updates.
"""

from typing import List, Sequence, Tuple

import torch

PAD, SEP, EOS = 0, 1, 2
FIRST_CONTENT = 3
VOCAB_SIZE = 16
PROMPT_MIN, PROMPT_MAX = 3, 5  # content tokens per prompt
RESPONSE_LEN = 6  # longest response
PROMPT_WIDTH = PROMPT_MAX + 1  # content tokens + SEP, left-padded to this width


def sample_prompts(
    count: int, generator: torch.Generator, lengths: Tuple[int, int] = (PROMPT_MIN, PROMPT_MAX)
) -> List[List[int]]:
    """``count`` prompts of distinct content tokens (``lengths``: fewest, most), closed by SEP."""
    prompts = []
    n_content = VOCAB_SIZE - FIRST_CONTENT
    for _ in range(count):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=generator))
        tokens = torch.randperm(n_content, generator=generator)[:length] + FIRST_CONTENT
        prompts.append(tokens.tolist() + [SEP])
    return prompts


def left_pad(rows: List[List[int]], width: int):
    """Token rows left-padded to ``width``, with their attention mask."""
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


def reward(prompt: Sequence[int], response: Sequence[int]) -> float:
    """Score one response (its tokens up to and excluding EOS) against its prompt."""
    wanted = {t for t in prompt if t >= FIRST_CONTENT}
    body = []
    for token in response:
        if token == EOS:
            break
        body.append(token)
    hits = sum(1 for t in body if t in wanted)
    precision = hits / RESPONSE_LEN
    coverage = len(wanted & set(body)) / len(wanted)
    return 0.5 * precision + 0.5 * coverage


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's std plus eps.

    ``rewards`` lists the groups one after another (``group_size`` responses per prompt). The
    std is the unbiased one, as Trinity's GRPO advantage uses; a group with equal rewards
    gets zero advantage.
    """
    groups = rewards.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + eps)).reshape(-1)
