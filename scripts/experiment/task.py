"""A verifiable task on which wrong answers are long: list the prompt's tokens, then stop.

A prompt is 2 to 4 distinct content tokens followed by SEP. A response is at most
``RESPONSE_LEN`` tokens and ends with its first EOS. Its reward is

    reward = |distinct prompt tokens in the body| / max(len(body), k)      (k = prompt size)

where the body is the response before EOS; a response that reaches the length limit without
EOS is truncated and scores 0, as truncated reasoning does in verifiable-reward training. The
best answer, 1, is every prompt token once (any order) and then EOS, at most 5 tokens. So the
answers that fail most are the ones that ramble on to the limit (10 tokens): under GRPO their
negative advantages are carried by about twice as many tokens as the positive ones, the
imbalance the BAPO paper (arXiv 2510.18927, Sec. 3) names. This is the ``stop`` task.

The ``cover`` task was added after the ``stop`` study showed that its failures stop running
long (see the README): the environment ends a response as soon as it holds every prompt token,
as a verifier ends an agent's episode once the goal is reached, and scores it
``k / len(response)``; a response that ends at EOS or at the limit without covering the prompt
scores 0. So every success is short by construction and a failure is as long as the policy
keeps going, which is the limit unless it learns to emit EOS, which never pays.
"""

from typing import Sequence

import torch

# The demo's vocabulary (its prompt maker, sampler and model serve here too), re-exported.
from demo.task import EOS, FIRST_CONTENT, PAD, SEP, VOCAB_SIZE  # noqa: F401

PROMPT_MIN, PROMPT_MAX = 2, 4  # content tokens per prompt
RESPONSE_LEN = 10  # the length limit
PROMPT_WIDTH = PROMPT_MAX + 1  # content tokens + SEP, left-padded to this width
MAX_POSITIONS = PROMPT_WIDTH + RESPONSE_LEN  # the model's positions


def reward(prompt: Sequence[int], response: Sequence[int]) -> float:
    """Score one response against its prompt (0 when it never emits EOS)."""
    response = list(response)
    if EOS not in response:
        return 0.0
    body = response[: response.index(EOS)]
    wanted = {t for t in prompt if t >= FIRST_CONTENT}
    return len(wanted & set(body)) / max(len(body), len(wanted))


def reward_cover(prompt: Sequence[int], response: Sequence[int]) -> float:
    """``cover`` task: k / length when the response holds every prompt token, else 0."""
    response = list(response)
    wanted = {t for t in prompt if t >= FIRST_CONTENT}
    if EOS in response or not wanted <= set(response):
        return 0.0
    return len(wanted) / len(response)


REWARDS = {"stop": reward, "cover": reward_cover}


def goal_tokens(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """One row per prompt: which vocabulary entries the ``cover`` task wants to see."""
    goal = torch.zeros((len(rows), VOCAB_SIZE), dtype=torch.bool)
    for i, row in enumerate(rows):
        goal[i, [t for t in row if t >= FIRST_CONTENT]] = True
    return goal
