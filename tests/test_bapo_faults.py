"""Faults: first-call memory, far bounds and tiny grid gaps, non-finite values at any token.

Each test covers a class of input, not one value: far-away points and tiny gaps for memory,
every input tensor and every non-finite value for masked tokens. Expected values come from
Trinity's ``PPOPolicyLossFn`` or from the same call on clean inputs, never from the code under
test.
"""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from bapo_inputs import BOTH, PAPER_MAX, PAPER_START, PAPER_STEPS, batch, call, chosen, mask_values
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn

# --------------------------------------------------------------------------- memory

# Configurations that construct, with points far from 1 and grids with tiny gaps. A search
# that sizes anything by (span of the grid) / (smallest gap) asks for gigabytes here.
FAR_AND_TINY = [
    dict(search_order="lower_first", ratio_lower_step=0.0333333333),  # capped last gap ~1e-10
    dict(search_order="lower_first", ratio_upper_step=0.0499999999999),
    dict(ratio_upper_start=1e8, ratio_upper_max=1e8),  # "no upper clip"
    dict(ratio_upper_start=3e38, ratio_upper_max=3e38),
    dict(ratio_lower_start=1e-9, ratio_lower_max=1e-9),
    dict(ratio_lower_start=1e-37, ratio_lower_max=1e-37),
    dict(ratio_lower_start=1e-30, ratio_lower_max=0.9, ratio_lower_step=0.3),
    dict(ratio_upper_start=1.0, ratio_upper_max=1e30, ratio_upper_step=1e27),
    dict(ratio_lower_start=0.5, ratio_lower_max=0.5 + 1e-12, ratio_lower_step=1e-13),
]

_MEMORY_PROBE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    def data_bytes():
        with open("/proc/self/status") as status:
            line = next(l for l in status if l.startswith("VmData:"))
        return int(line.split()[1]) * 1024

    # A runaway allocation fails here instead of taking the machine down.
    limit = data_bytes() + (1 << 30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(64, 1024, generator=gen) * 3
    logprob = old + torch.randn(64, 1024, generator=gen)
    adv = torch.randn(64, 1024, generator=gen)
    mask = torch.ones(64, 1024)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for kwargs in json.loads(sys.argv[1]):
        for contribution in ("surrogate", "gradient"):
            fn = BAPOPolicyLossFn(contribution=contribution, **kwargs)
            fn(logprob=logprob, old_logprob=old, action_mask=mask, advantages=adv)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps({"grown_kib": grown}))
    """)


def test_first_call_memory_is_tokens_plus_candidates():
    """65,536 float32 tokens: a few token-sized float64 buffers, whatever the grid's gaps."""
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, json.dumps(FAR_AND_TINY)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown_mib = json.loads(proc.stdout.strip().splitlines()[-1])["grown_kib"] / 1024
    assert grown_mib < 64, f"peak RSS grew by {grown_mib:.0f} MiB for 0.25 MiB of input"


@pytest.mark.parametrize("kwargs", FAR_AND_TINY, ids=lambda kw: ",".join(map(str, kw.values())))
def test_far_points_and_tiny_gaps_clip_where_configured(kwargs):
    """Use the chosen pair in the loss: finite, and PPO's value at that pair."""
    logprob, old, mask, adv = batch((4096,), seed=1)
    loss, m = call(BAPOPolicyLossFn(**kwargs), logprob, old, mask, adv)
    low, high = chosen(m)
    ppo = PPOPolicyLossFn(clip_range_low=1 - low, clip_range_high=high - 1, clip_ratio_c=3.0)
    ppo_loss, _ = call(ppo, logprob, old, mask, adv)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(ppo_loss.item(), rel=1e-6)


# --------------------------------------------------------------------------- non-finite values


@pytest.mark.parametrize("order, contribution", BOTH)
def test_nonfinite_live_tokens_are_counted_and_keep_start_bounds(order, contribution):
    logprob, old, mask, adv = batch((4, 24), spread=0.01)
    adv = -adv.abs() - 0.1  # all negative: finite, this batch would search to (0.9, 3.0)
    logprob[0, 0] = math.nan
    logprob[1, 2] = math.inf
    old[2, 3] = -math.inf
    adv[3, 4] = math.nan
    logprob[3, 4] = math.nan  # same token as above: counted once
    mask[3, 5] = math.nan  # a NaN mask value leaves its token live (NaN != 0)
    fn = BAPOPolicyLossFn(search_order=order, contribution=contribution)
    _, m = call(fn, logprob, old, mask, adv)
    assert m["bapo_nonfinite_tokens"] == 5
    assert chosen(m) == PAPER_START and m["bapo_search_steps"] == 0


@pytest.mark.parametrize(
    "fields",
    [("logprob",), ("old_logprob",), ("advantages",), ("logprob", "old_logprob", "advantages")],
    ids=["logprob", "old_logprob", "advantages", "all"],
)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("contribution", ["surrogate", "gradient"])
@pytest.mark.parametrize(
    "order, loss_agg_mode",
    [
        ("upper_first", "token-mean"),
        ("lower_first", "token-mean"),
        ("upper_first", "seq-mean-token-mean"),
    ],
)
def test_masked_nonfinite_values_touch_neither_loss_nor_gradient(
    fields, bad, contribution, order, loss_agg_mode
):
    """Target 1 is never met: the search must still run to the end of the grid."""
    logprob, old, _, adv = batch((4, 16), seed=3)
    mask = (mask_values("mixed", adv.shape, seed=3) > 0).float()
    fn = BAPOPolicyLossFn(
        positive_contribution_target=1.0,
        search_order=order,
        contribution=contribution,
        loss_agg_mode=loss_agg_mode,
    )
    results = []
    for filler in (0.0, bad):
        tensors = {"logprob": logprob.clone(), "old_logprob": old, "advantages": adv}
        for field in fields:
            tensors[field] = torch.where(mask.bool(), tensors[field], filler)
        tensors["logprob"].requires_grad_(True)
        loss, m = fn(action_mask=mask, **tensors)
        loss.backward()
        results.append((loss.detach(), tensors["logprob"].grad, m))
    (clean_loss, clean_grad, clean_m), (loss, grad, m) = results
    assert torch.equal(loss, clean_loss) and torch.equal(grad, clean_grad)
    assert (grad[mask == 0] == 0).all() and (grad[mask == 1] != 0).any()
    assert m == clean_m and m["bapo_nonfinite_tokens"] == 0
    assert chosen(m) == PAPER_MAX and m["bapo_search_steps"] == PAPER_STEPS
