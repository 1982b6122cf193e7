"""Faults: configurations, inputs and precisions where BAPO must fail clearly or stay exact.

Each test covers a class of input, not one value: far-away points and tiny gaps for memory,
every input tensor and every non-finite value for masked tokens, several fractional masks and
several half-precision types. Expected values come from Trinity's ``PPOPolicyLossFn``, from
autograd on the per-token loss written here, or from Eq. 8 written here, never from the code
under test.
"""

import math
import subprocess
import sys
import textwrap
from decimal import Decimal

import numpy as np
import pytest
import torch

from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn


def _call(fn, logprob, old, mask, adv):
    return fn(logprob=logprob, old_logprob=old, action_mask=mask, advantages=adv)


def _batch(seed, n=4096, spread=0.5, dtype=torch.float32, adv_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=gen) * 3 - 0.1
    logprob = old + spread * torch.randn(n, generator=gen)
    adv = torch.randn(n, generator=gen)
    return logprob.to(dtype), old.to(dtype), adv.to(adv_dtype or dtype)


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
    import json

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
    logprob, old, adv = _batch(1)
    mask = torch.ones_like(logprob)
    loss, m = _call(BAPOPolicyLossFn(**kwargs), logprob, old, mask, adv)
    low, high = m["bapo_clip_low"], m["bapo_clip_high"]
    ppo = PPOPolicyLossFn(clip_range_low=1 - low, clip_range_high=high - 1, clip_ratio_c=3.0)
    ppo_loss, _ = _call(ppo, logprob, old, mask, adv)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(ppo_loss.item(), rel=1e-6)


# --------------------------------------------------------------------------- absurd configs

ULP_ABOVE_06 = math.nextafter(0.6, 1.0)
ULP_ABOVE_12 = math.nextafter(1.2, 2.0)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(ratio_lower_start=1e-310), "ratio_lower_start"),  # subnormal
        (dict(ratio_lower_start=5e-324), "ratio_lower_start"),
        (dict(ratio_lower_start=1e-40, ratio_lower_max=1e-40), "ratio_lower_start"),
        (dict(ratio_upper_start=1e300, ratio_upper_max=1e300), "ratio_upper_start"),
        (dict(ratio_upper_max=1e300), "ratio_upper_max"),
        (dict(ratio_upper_max=3.5e38), "ratio_upper_max"),  # past the largest float32
        (dict(ratio_lower_max=ULP_ABOVE_06, ratio_lower_step=1e-17), "ratio_lower_step"),
        (dict(ratio_upper_max=ULP_ABOVE_12, ratio_upper_step=1e-18), "ratio_upper_step"),
        (dict(ratio_lower_max=0.6 + 4e-16, ratio_lower_step=3e-17), "ratio_lower_step"),
        (dict(ratio_upper_step=1e-300), "ratio_upper_step"),
    ],
)
def test_absurd_configs_raise_value_error_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError) as info:
        BAPOPolicyLossFn(**kwargs)
    assert f"`{name}`" in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "convert",
    [
        np.float64,
        np.float32,
        np.float16,
        lambda x: torch.tensor(x).item(),
        lambda x: torch.tensor(x, dtype=torch.float64),  # a 0-d tensor
        lambda x: Decimal(repr(x)),
    ],
)
def test_any_real_number_is_accepted_and_converted(convert):
    """Numpy scalars, 0-d tensors and Decimals configure the loss as their float values do."""
    values = dict(
        ratio_lower_start=0.6,
        ratio_lower_max=0.9,
        ratio_lower_step=0.02,
        ratio_upper_start=1.2,
        ratio_upper_max=3.0,
        ratio_upper_step=0.05,
        positive_contribution_target=0.45,
        clip_ratio_c=3.0,
    )
    converted = BAPOPolicyLossFn(**{k: convert(v) for k, v in values.items()})
    plain = BAPOPolicyLossFn(**{k: float(convert(v)) for k, v in values.items()})
    assert converted.search.lower == plain.search.lower
    assert converted.search.upper == plain.search.upper
    logprob, old, adv = _batch(2)
    mask = torch.ones_like(logprob)
    assert _call(converted, logprob, old, mask, adv)[1] == _call(plain, logprob, old, mask, adv)[1]
    assert BAPOPolicyLossFn(ratio_upper_start=np.int64(1), ratio_upper_max=np.int32(2))


@pytest.mark.parametrize("flag", [np.bool_(True), np.bool_(False)])
def test_numpy_booleans_set_the_sync_flag(flag):
    assert BAPOPolicyLossFn(sync_across_dp=flag).sync.enabled is bool(flag)


# --------------------------------------------------------------------------- masked tokens


@pytest.mark.parametrize("field", ["logprob", "old_logprob", "advantages"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("contribution", ["surrogate", "gradient"])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_masked_nonfinite_values_touch_neither_loss_nor_gradient(
    field, bad, contribution, loss_agg_mode
):
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 16, generator=gen) * 3 - 0.1
    batch = {
        "logprob": old + 0.5 * torch.randn(4, 16, generator=gen),
        "old_logprob": old,
        "advantages": torch.randn(4, 16, generator=gen),
    }
    mask = (torch.rand(4, 16, generator=gen) < 0.7).float()
    mask[:, 0] = 1
    fn = BAPOPolicyLossFn(contribution=contribution, loss_agg_mode=loss_agg_mode)
    results = []
    for filler in (0.0, bad):
        tensors = {k: v.clone() for k, v in batch.items()}
        tensors[field] = torch.where(mask.bool(), tensors[field], filler)
        tensors["logprob"].requires_grad_(True)
        loss, m = fn(action_mask=mask, **tensors)
        loss.backward()
        results.append((loss.detach(), tensors["logprob"].grad, m))
    (clean_loss, clean_grad, clean_m), (loss, grad, m) = results
    assert torch.equal(loss, clean_loss) and torch.equal(grad, clean_grad)
    assert (grad[mask == 0] == 0).all() and (grad[mask == 1] != 0).any()
    assert m == clean_m and m["bapo_nonfinite_tokens"] == 0


# --------------------------------------------------------------------------- fractional masks


def _fractional_mask(seed, kind):
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform_half":
        return torch.full((4096,), 0.5)
    if kind == "uniform_tenth":
        return torch.full((4096,), 0.1)
    mask = torch.rand(4096, generator=gen)
    return torch.where(mask < 0.2, 0.0, mask)  # mixed weights, some tokens out


@pytest.mark.parametrize("kind", ["uniform_half", "uniform_tenth", "mixed"])
def test_fractional_mask_clip_fractions_equal_ppo(kind):
    logprob, old, adv = _batch(4)
    mask = _fractional_mask(4, kind)
    ppo = PPOPolicyLossFn(clip_range_low=0.2, clip_range_high=0.28, clip_ratio_c=3.0)
    bapo = BAPOPolicyLossFn(
        ratio_lower_start=0.8, ratio_lower_max=0.8, ratio_upper_start=1.28, ratio_upper_max=1.28
    )
    (ppo_loss, ppo_m), (loss, m) = (_call(f, logprob, old, mask, adv) for f in (ppo, bapo))
    assert loss.item() == pytest.approx(ppo_loss.item(), rel=1e-6)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        assert m[key] == pytest.approx(ppo_m[key], rel=1e-6, abs=1e-9), key
    assert 0 < m["pg_clipfrac"] < 1


@pytest.mark.parametrize("kind", ["uniform_half", "mixed"])
@pytest.mark.parametrize("contribution", ["surrogate", "gradient"])
def test_fractional_mask_weighs_tokens_as_the_loss_does(kind, contribution):
    """Weigh each token by its mask in rho.

    rho at a pair: Eq. 8 with each token weighted by its mask, or the share of autograd's
    gradient of the mask-weighted token sum.
    """
    logprob, old, adv = (t.double() for t in _batch(5))
    mask = _fractional_mask(5, kind).double()
    low, high = 0.8, 1.3
    lp = logprob.clone().requires_grad_(True)
    ratio = torch.exp(lp - old)
    if contribution == "surrogate":
        r = ratio.detach()
        pos = (mask * adv * torch.clamp(r, max=high))[adv > 0].sum()
        neg = (mask * -adv * torch.clamp(r, min=low))[adv < 0].sum()
    else:
        per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, low, high))
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 3.0), per_token)
        (grad,) = torch.autograd.grad((per_token * mask).sum(), lp)
        pos, neg = grad.abs()[adv > 0].sum(), grad.abs()[adv < 0].sum()
    fn = BAPOPolicyLossFn(
        ratio_lower_start=low,
        ratio_lower_max=low,
        ratio_upper_start=high,
        ratio_upper_max=high,
        contribution=contribution,
    )
    _, m = _call(fn, logprob, old, mask, adv)
    assert m["bapo_positive_contribution"] == pytest.approx(float(pos / (pos + neg)), rel=1e-12)


# --------------------------------------------------------------------------- precisions


def _autograd_shares(logprob, old, adv, low, high, clip_ratio_c):
    """Return the share of each token's full gradient that autograd gives it, and |A| r.

    The share (1, 1/2 or 0) of |A| r comes from autograd in the inputs' own precision, with
    PPO's expressions; |A| r is in float64.
    """
    lp = logprob.clone().requires_grad_(True)
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, low, high))
    per_token = torch.where(adv < 0, torch.min(-adv * clip_ratio_c, per_token), per_token)
    (grad,) = torch.autograd.grad(per_token.sum(), lp)
    full = (adv * ratio.detach()).abs()
    share = torch.where(full == 0, 0.0, (grad.abs() / full).double())
    return torch.round(share * 2) / 2, (adv.double() * ratio.detach().double()).abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pair", [(0.6, 1.2), (0.8, 1.28), (0.9, 3.0), (0.75, 1.5)])
def test_gradient_contribution_matches_autograd_in_every_precision(dtype, pair):
    """Count ratios that round exactly onto a bound, as autograd does.

    In low precision, ratios often land exactly on a bound, where the inclusive clamp keeps
    their gradient. Advantages in float32, as GRPO computes them.
    """
    low, high = pair
    logprob, old, adv = _batch(6, n=20000, spread=0.4, dtype=dtype, adv_dtype=torch.float32)
    share, full = _autograd_shares(logprob, old, adv, low, high, 3.0)
    ratio = torch.exp(torch.clamp(logprob - old, -20.0, 20.0))
    on_high = (ratio == torch.tensor(high, dtype=dtype)) & (adv > 0)
    on_low = (ratio == torch.tensor(low, dtype=dtype)) & (adv < 0)
    assert dtype == torch.float32 or (on_high | on_low).sum() >= 3  # what the search missed
    pos, neg = (share * full)[adv > 0].sum(), (share * full)[adv < 0].sum()
    fn = BAPOPolicyLossFn(
        ratio_lower_start=low,
        ratio_lower_max=low,
        ratio_upper_start=high,
        ratio_upper_max=high,
        contribution="gradient",
    )
    _, m = _call(fn, logprob, old, torch.ones_like(logprob), adv)
    assert m["bapo_positive_contribution"] == pytest.approx(float(pos / (pos + neg)), rel=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gradient_contribution_with_half_precision_advantages(dtype):
    """Differ from autograd only on rare product ties.

    With the advantages in 16 bits too, the products A r and A c can round to one value though
    r and c differ; autograd then splits the gradient of such a token in half. That is the only
    difference left, and it is rare.
    """
    logprob, old, adv = _batch(7, n=20000, spread=0.4, dtype=dtype)
    share, full = _autograd_shares(logprob, old, adv, 0.6, 1.2, 3.0)
    ratio = torch.exp(torch.clamp(logprob - old, -20.0, 20.0)).double()
    bounds = [torch.tensor(b, dtype=dtype).double() for b in (0.6, 1.2, 3.0)]
    product_ties = (share == 0.5) & ~((ratio == bounds[0]) | (ratio == bounds[1]))
    product_ties &= ratio != bounds[2]
    assert product_ties.sum() < 10  # rare: under 1 in 2,000 tokens
    pos, neg = (share * full)[adv > 0].sum(), (share * full)[adv < 0].sum()
    fn = BAPOPolicyLossFn(
        ratio_lower_start=0.6,
        ratio_lower_max=0.6,
        ratio_upper_start=1.2,
        ratio_upper_max=1.2,
        contribution="gradient",
    )
    _, m = _call(fn, logprob, old, torch.ones_like(logprob), adv)
    slack = float((full * product_ties).sum() / (pos + neg))
    want = float(pos / (pos + neg))
    assert abs(m["bapo_positive_contribution"] - want) <= slack + 1e-9 * want
