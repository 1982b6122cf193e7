"""The `dp_group` interface leaves every other loss as it was.

verl 0.8's engine calls `loss_fn(model_output, data, dp_group=...)`; the patched
`TrinityPolicyLoss` forwards it, and the patched metaclass hands it only to losses that declare
it in `_runtime_keys`. So every registered loss gives the same loss, gradient and metrics with
and without a group, and as called directly on padded tensors (the released behaviour). That the
group reaches the losses that declare it, the pull requests' own tests show. The batch is the
engine's: Trinity's padded layout, the log-probs flat over each sequence (response token j of a
sequence with prompt length p at p - 1 + j).
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from scripts.harness.engine import trinity_layout
from scripts.harness.variants import loss_config
from trinity.algorithm import POLICY_LOSS_FN
from trinity.trainer.verl.losses import TrinityPolicyLoss

PROMPT_LENS = [3, 1, 4, 2]
RESPONSE_LENS = [5, 3, 6, 2]
MASKED_INSIDE = [(0, 2), (2, 0), (2, 4)]  # response tokens excluded from the loss (tool output)
# The registry has no public listing of its lazily imported names; the mapping is the registry.
REGISTERED = sorted(POLICY_LOSS_FN._default_mapping)


def source(seed: int = 0):
    """The flat log-probs, the padded batch the engine passes, and the response log-probs."""
    gen = torch.Generator().manual_seed(seed)
    rows, width, p_width = len(RESPONSE_LENS), max(RESPONSE_LENS), max(PROMPT_LENS)
    valid = torch.arange(width) < torch.tensor(RESPONSE_LENS)[:, None]
    mask = valid.clone()
    for i, j in MASKED_INSIDE:
        mask[i, j] = False
    seq_lens = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    flat = -(torch.rand(sum(seq_lens), generator=gen) * 2.0 + 0.05)
    firsts = [sum(seq_lens[:i]) + PROMPT_LENS[i] - 1 for i in range(rows)]
    logprob = torch.zeros(rows, width)
    for i, first in enumerate(firsts):
        logprob[i, : RESPONSE_LENS[i]] = flat[first : first + RESPONSE_LENS[i]]
    noise = torch.randn(3, rows, width, generator=gen) * valid
    old, advantages = logprob + 0.4 * noise[0], noise[1]  # clipping active on both sides
    ref = logprob + 0.2 * noise[2]  # what DPO-style losses read
    prompt_mask = torch.arange(p_width).flip(0) < torch.tensor(PROMPT_LENS)[:, None]
    prompts = torch.randint(5, 1000, (rows, p_width), generator=gen) * prompt_mask
    responses = torch.randint(5, 1000, (rows, width), generator=gen) * valid
    data = trinity_layout(prompts, prompt_mask.long(), responses, valid.long(), old, advantages)
    data["response_mask"] = mask.long()  # holes; the losses take non-bool masks
    data["ref_log_prob"] = ref
    data["expert_mask"] = torch.tensor([False, True, False, True])  # what MIX-style losses read
    data["step"] = torch.full((rows,), 3, dtype=torch.long)
    direct = dict(old_log_probs=old, advantages=advantages, response_mask=mask, ref_log_prob=ref)
    direct.update(expert_mask=data["expert_mask"], step=data["step"])
    return flat, data, logprob, direct, firsts


def through_engine_loss(name, seed, **call_kwargs):
    """One call of the patched TrinityPolicyLoss: (loss, metrics, gradient of the flat input)."""
    flat, data, _, _, _ = source(seed)
    leaf = flat.clone().requires_grad_(True)
    offsets = torch.tensor([0] + list(torch.tensor(PROMPT_LENS) + torch.tensor(RESPONSE_LENS)))
    output = {"log_probs": torch.nested.nested_tensor_from_jagged(leaf, offsets.cumsum(0))}
    loss_fn = TrinityPolicyLoss(loss_config(name, POLICY_LOSS_FN.get(name).default_args()))
    loss, metrics = loss_fn(output, data, **call_kwargs)
    loss.backward()
    return loss.detach(), metrics, leaf.grad


def called_directly(name, seed):
    """The released behaviour: the loss on padded tensors, reported as TrinityPolicyLoss does."""
    flat, _, logprob, direct, firsts = source(seed)
    args = POLICY_LOSS_FN.get(name).default_args()
    leaf = logprob.clone().requires_grad_(True)
    loss, raw = POLICY_LOSS_FN.get(name)(backend="verl", **args)(logprob=leaf, **direct)
    loss.backward()
    metrics = {f"actor/{key}": value for key, value in raw.items()}
    metrics["final_loss"] = loss.item()
    grad = torch.zeros_like(flat)
    for i, first in enumerate(firsts):
        grad[first : first + RESPONSE_LENS[i]] = leaf.grad[i, : RESPONSE_LENS[i]]
    return loss.detach(), metrics, grad


@pytest.fixture(scope="module")
def dp_group(tmp_path_factory):
    """A one-rank gloo sub-group, distinct from WORLD; a group of one never waits."""
    owns_world = not dist.is_initialized()
    if owns_world:
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=30),
        )
    try:
        yield dist.new_group(ranks=[0], backend="gloo", timeout=timedelta(seconds=30))
    finally:
        if owns_world:
            dist.destroy_process_group()


@pytest.mark.parametrize("name", REGISTERED)
def test_same_result_with_and_without_dp_group(name, dp_group):
    assert "bapo" in REGISTERED and len(REGISTERED) == 16  # 0.6.0's 15 losses and BAPO
    assert "dp_group" not in POLICY_LOSS_FN.get(name)._select_keys
    loss, metrics, grad = called_directly(name, seed=0)
    assert grad.abs().sum() > 0, "the gradient check needs a non-zero gradient"
    for got in (through_engine_loss(name, 0), through_engine_loss(name, 0, dp_group=dp_group)):
        torch.testing.assert_close(got[0], loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got[2], grad, rtol=1e-6, atol=1e-7)
        assert got[1] == pytest.approx(metrics, rel=1e-6, abs=1e-7)
