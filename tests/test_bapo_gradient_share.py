"""Under ``contribution: gradient``, rho is autograd's positive share of the loss BAPO returns.

The oracle is the gradient of BAPO's own returned loss with respect to the log-probs: P and N
are the sums of |dL/dlogp| over the tokens with A > 0 and A < 0, and BAPO must report
P / (P + N) at the pair it chose. Covered: every aggregation mode (with sequences of unequal
length), log-ratios past the +-20 clamp on either side, a dual clip that no 16-bit type holds
exactly, integer and fractional masks. With 16-bit advantages the products A r and A c can
round to one value though r != c, where autograd splits the gradient in half; the search does
not, and the difference is bounded by those tokens' weight (the documented residue).

The per-candidate sums are also checked against a float64 oracle that adds up each candidate's
own tokens, with one token a thousand billion billion times larger than the rest.
"""

import math

import pytest
import torch

from trinity.algorithm.policy_loss_fn.bapo_policy_loss import LOSS_AGG_MODES, BAPOPolicyLossFn

PAPER_GRADIENT = dict(contribution="gradient")


def autograd_share(fn, logprob, old, mask, adv):
    """(BAPO's metrics, autograd's P / (P + N)) for one call, in float32."""
    leaf = logprob.detach().clone().requires_grad_(True)
    loss, metrics = fn(logprob=leaf, old_logprob=old, action_mask=mask, advantages=adv)
    (grad,) = torch.autograd.grad(loss, leaf)
    weight = grad.double().abs()
    positive, negative = weight[adv > 0].sum(), weight[adv < 0].sum()
    return metrics, float(positive / (positive + negative))


def autograd_fractions_16_bit(fn, logprob, old, adv):
    """(BAPO's metrics, autograd's P / (P + N), the weight share of tokens autograd halved).

    A 16-bit gradient is itself rounded, so autograd only says which part of each token's
    |A| r (1, 1/2 or 0) its loss term passes on; the sums are then taken in float64. One row,
    all live, token-mean: every token's aggregation weight is the same.
    """
    mask = torch.ones_like(adv, dtype=torch.float32)
    leaf = logprob.detach().clone().requires_grad_(True)
    loss, metrics = fn(logprob=leaf, old_logprob=old, action_mask=mask, advantages=adv)
    (grad,) = torch.autograd.grad(loss, leaf)
    ratio = torch.exp(torch.clamp(logprob - old, -20.0, 20.0))
    full = (adv.double() * ratio.double()).abs()
    fraction = torch.round(2 * grad.double().abs() * mask.sum() / full) / 2
    positive, negative = (fraction * full)[adv > 0].sum(), (fraction * full)[adv < 0].sum()
    halved = full[fraction == 0.5].sum() / (positive + negative)
    return metrics, float(positive / (positive + negative)), float(halved)


def sequences(lengths, signs, seed=0, spread=0.4):
    """Right-padded rows of the given lengths; each row's advantage has the row's sign."""
    gen = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    old = -torch.rand(rows, width, generator=gen) * 2 - 0.1
    logprob = old + spread * torch.randn(rows, width, generator=gen)
    magnitude = torch.rand(rows, width, generator=gen) + 0.2
    return logprob, old, mask, torch.tensor(signs, dtype=torch.float32)[:, None] * magnitude


def mixed(n=6000, seed=1, dtype=torch.float32, adv_dtype=torch.float32, spread=0.4):
    """One long row of tokens with both signs and ratios over every range."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(1, n, generator=gen) * 3 - 0.1
    logprob = old + spread * torch.randn(1, n, generator=gen)
    adv = torch.randn(1, n, generator=gen)
    return logprob.to(dtype), old.to(dtype), torch.ones(1, n), adv.to(adv_dtype)


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("ranges", [{}, dict(ratio_lower_max=0.6, ratio_upper_max=1.2)])
def test_every_aggregation_mode(loss_agg_mode, ranges):
    """4 short positive and 4 long negative sequences: per-sequence weights matter."""
    batch = sequences([4] * 4 + [64] * 4, [1] * 4 + [-1] * 4)
    fn = BAPOPolicyLossFn(loss_agg_mode=loss_agg_mode, **PAPER_GRADIENT, **ranges)
    metrics, share = autograd_share(fn, *batch)
    assert metrics["bapo_positive_contribution"] == pytest.approx(share, rel=1e-6)


def test_seq_mean_token_mean_stops_where_the_start_pair_already_meets_the_target():
    """A plain token sum sees 4 x 4 positive against 4 x 64 negative tokens; the loss does not."""
    batch = sequences([4] * 4 + [64] * 4, [1] * 4 + [-1] * 4, spread=0.05)
    fn = BAPOPolicyLossFn(loss_agg_mode="seq-mean-token-mean", **PAPER_GRADIENT)
    metrics, share = autograd_share(fn, *batch)
    assert share > 0.4 and metrics["bapo_search_steps"] == 0
    assert metrics["bapo_positive_contribution"] == pytest.approx(share, rel=1e-6)


@pytest.mark.parametrize(
    "sign, log_ratio, ranges",
    [
        (-1.0, 25.0, dict(clip_ratio_c=None)),  # a negative token far above the clamp
        (-1.0, -25.0, {}),  # far below it
        (1.0, 25.0, dict(ratio_upper_start=3e38, ratio_upper_max=3e38)),  # nothing clips it
        (1.0, -25.0, {}),
    ],
)
def test_tokens_past_the_log_ratio_clamp_carry_no_gradient(sign, log_ratio, ranges):
    logprob, old, mask, adv = mixed(2000, seed=3)
    logprob[0, 7] = old[0, 7] + log_ratio
    adv[0, 7] = sign * (0.01 if sign < 0 else 1.0)
    fn = BAPOPolicyLossFn(**PAPER_GRADIENT, **ranges)
    metrics, share = autograd_share(fn, logprob, old, mask, adv)
    assert metrics["bapo_positive_contribution"] == pytest.approx(share, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("clip_ratio_c", [1.1, 1.3, 2.7])
def test_dual_clip_not_representable_in_16_bits(dtype, clip_ratio_c):
    """16-bit log-probs, float32 advantages: -A C is compared in float32, as the loss does."""
    logprob, old, _, adv = mixed(20000, seed=4, dtype=dtype, spread=0.3)
    fn = BAPOPolicyLossFn(clip_ratio_c=clip_ratio_c, **PAPER_GRADIENT)
    metrics, share, halved = autograd_fractions_16_bit(fn, logprob, old, adv)
    assert metrics["bapo_positive_contribution"] == pytest.approx(share, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("clip_ratio_c", [1.1, 3.0])
def test_16_bit_advantages_differ_only_by_the_product_tie_residue(dtype, clip_ratio_c):
    """Advantages in 16 bits too: the gap is at most the weight of the tokens autograd halved."""
    logprob, old, _, adv = mixed(20000, seed=5, dtype=dtype, adv_dtype=dtype, spread=0.3)
    fn = BAPOPolicyLossFn(clip_ratio_c=clip_ratio_c, **PAPER_GRADIENT)
    metrics, share, halved = autograd_fractions_16_bit(fn, logprob, old, adv)
    assert abs(metrics["bapo_positive_contribution"] - share) <= halved + 1e-9


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_integer_masks_weigh_their_tokens(dtype):
    """Mask values of 2 count twice in the loss, and so in the search."""
    logprob, old, _, adv = mixed(3000, seed=6)
    mask = torch.ones_like(adv, dtype=dtype)
    mask[0, :1500:3] = 2
    mask[0, 1::7] = 0
    metrics, share = autograd_share(BAPOPolicyLossFn(**PAPER_GRADIENT), logprob, old, mask, adv)
    assert metrics["bapo_positive_contribution"] == pytest.approx(share, rel=1e-6)


def test_integer_mask_equals_the_same_float_mask():
    logprob, old, _, adv = mixed(3000, seed=7)
    mask = torch.ones_like(adv, dtype=torch.int64)
    mask[0, adv[0] > 0.5] = 2
    for contribution in ("surrogate", "gradient"):
        fn = BAPOPolicyLossFn(contribution=contribution)
        _, as_int = fn(logprob=logprob, old_logprob=old, action_mask=mask, advantages=adv)
        _, as_float = fn(logprob=logprob, old_logprob=old, action_mask=mask.float(), advantages=adv)
        assert as_int["bapo_positive_contribution"] == as_float["bapo_positive_contribution"]


def test_nan_mask_value_at_a_live_token_is_reported():
    logprob, old, mask, adv = mixed(500, seed=8)
    mask[0, 10] = math.nan
    fn = BAPOPolicyLossFn(ratio_lower_start=0.7)
    _, metrics = fn(logprob=logprob, old_logprob=old, action_mask=mask, advantages=adv)
    assert metrics["bapo_nonfinite_tokens"] == 1
    assert (metrics["bapo_clip_low"], metrics["bapo_clip_high"]) == (0.7, 1.2)


# --------------------------------------------------------------------------- per-candidate sums


def candidate_sums_oracle(ratio, adv, lower, upper, contribution, clip_ratio_c):
    """P per upper and N per lower candidate, each the float64 sum of that candidate's terms."""
    tokens = list(zip(ratio.double().reshape(-1).tolist(), adv.double().reshape(-1).tolist()))
    positive, negative = [], []
    for c_high in upper:
        if contribution == "surrogate":
            terms = [a * min(r, c_high) for r, a in tokens if a > 0]
        else:
            terms = [a * r for r, a in tokens if a > 0 and r <= c_high]
        positive.append(math.fsum(terms))
    for c_low in lower:
        if contribution == "surrogate":
            terms = [-a * max(r, c_low) for r, a in tokens if a < 0]
        else:
            terms = [-a * r for r, a in tokens if a < 0 and c_low <= r < clip_ratio_c]
        negative.append(math.fsum(terms))
    return positive, negative


@pytest.mark.parametrize("contribution", ["surrogate", "gradient"])
@pytest.mark.parametrize("huge", [None, 1e19, 1e30, -1e19, -1e30])
def test_each_candidate_sums_only_its_own_tokens(contribution, huge):
    """One token of |A| = 1e19 or 1e30 beside tokens of order 1, clipped or floored."""
    gen = torch.Generator().manual_seed(9)
    ratio = torch.exp(0.5 * torch.randn(800, generator=gen, dtype=torch.float64))
    adv = torch.randn(800, generator=gen, dtype=torch.float64)
    if huge is not None:  # a positive one past every c_high, a negative one under every c_low
        ratio[0], adv[0] = (4.0 if huge > 0 else 0.3), huge
    fn = BAPOPolicyLossFn(contribution=contribution)
    search = fn.search
    sums = search.local_sums(ratio, adv, torch.ones_like(adv), torch.ones_like(adv).bool())
    positive, negative, _ = search.parts(sums.tolist())
    want_p, want_n = candidate_sums_oracle(
        ratio, adv, search.lower, search.upper, contribution, 3.0
    )
    assert positive == pytest.approx(want_p, rel=1e-12)
    assert negative == pytest.approx(want_n, rel=1e-12)
