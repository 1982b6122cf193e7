"""Two verifiable tasks on which wrong answers are long, and GRPO's group advantages.

Failures run to the length limit, so negative advantages ride on more tokens than positive
ones: the imbalance BAPO's paper names (Sec. 3). docs/results.md states both tasks' rules.
"""

from typing import List, Optional, Sequence, Tuple

import torch

PAD, SEP, EOS = 0, 1, 2
FIRST_CONTENT = 3
VOCAB_SIZE = 16
PROMPT_MIN, PROMPT_MAX = 2, 4  # content tokens per prompt
RESPONSE_LEN = 10  # the length limit
PROMPT_WIDTH = PROMPT_MAX + 1  # content tokens + SEP, left-padded to this width
MAX_POSITIONS = PROMPT_WIDTH + RESPONSE_LEN  # the model's positions


def sample_prompts(count: int, generator: torch.Generator) -> List[List[int]]:
    """``count`` prompts of distinct content tokens, each closed by SEP."""
    prompts = []
    for _ in range(count):
        length = int(torch.randint(PROMPT_MIN, PROMPT_MAX + 1, (1,), generator=generator))
        tokens = torch.randperm(VOCAB_SIZE - FIRST_CONTENT, generator=generator)[:length]
        prompts.append((tokens + FIRST_CONTENT).tolist() + [SEP])
    return prompts


def left_pad(rows: List[List[int]], width: int = PROMPT_WIDTH) -> Tuple[torch.Tensor, ...]:
    """Token rows left-padded to ``width``, with their attention mask."""
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


def _wanted(prompt: Sequence[int]) -> set:
    return {t for t in prompt if t >= FIRST_CONTENT}


def reward_stop(prompt: Sequence[int], response: Sequence[int]) -> float:
    """``stop``: the listed prompt tokens over the body's length; 0 without EOS."""
    response = list(response)
    if EOS not in response:
        return 0.0
    body = response[: response.index(EOS)]
    return len(_wanted(prompt) & set(body)) / max(len(body), len(_wanted(prompt)))


def reward_cover(prompt: Sequence[int], response: Sequence[int]) -> float:
    """``cover``: k / length when the response holds every prompt token, else 0."""
    response = list(response)
    if EOS in response or not _wanted(prompt) <= set(response):
        return 0.0
    return len(_wanted(prompt)) / len(response)


def goal_tokens(task: str, rows: Sequence[Sequence[int]]) -> Optional[torch.Tensor]:
    """Under ``cover``, one row per prompt of the vocabulary entries that end it; else None."""
    if task != "cover":
        return None
    goal = torch.zeros((len(rows), VOCAB_SIZE), dtype=torch.bool)
    for i, row in enumerate(rows):
        goal[i, sorted(_wanted(row))] = True
    return goal


def scores(task: str, rows, responses: torch.Tensor, mask: torch.Tensor) -> List[float]:
    """The task's reward of every response (its tokens under the mask)."""
    lengths = mask.sum(dim=1).tolist()
    reward = {"stop": reward_stop, "cover": reward_cover}[task]
    return [reward(p, r[:n]) for p, r, n in zip(rows, responses.tolist(), lengths)]


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of consecutive groups: (reward - mean) / (unbiased std + eps), as Trinity."""
    groups = rewards.view(-1, group_size)
    mean, std = groups.mean(dim=1, keepdim=True), groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + eps)).reshape(-1)
