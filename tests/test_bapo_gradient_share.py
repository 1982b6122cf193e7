"""The sums behind rho, and rho under ``contribution: gradient`` as autograd's positive share.

Every autograd check of BAPO lives here, with two oracles, neither the code under test:
``autograd_share`` (P and N as sums of |dL/dlogp| of BAPO's own loss over A > 0 and A < 0, in
every aggregation mode, past the log-ratio clamp, in 16 and 32 bits, with any mask) and
``pair_sums`` (exact sums at one pair from Eq. 8, or from autograd on the README's loss).
"""

import math

import pytest
import torch

import bapo_reference as ref
from bapo_inputs import batch, call, chosen, mask_values, point
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import LOSS_AGG_MODES, BAPOPolicyLossFn
from trinity.algorithm.policy_loss_fn.bapo_search import BoundSearch
from trinity.algorithm.utils import aggregate_loss

GRADIENT = dict(contribution="gradient")


def autograd_share(fn, logprob, old, mask, adv):
    """Return BAPO's metrics, autograd's P / (P + N), and the weight of each token it halved.

    Autograd passes on a part (1, 1/2 or 0) of each token's |A| r w (w: its weight in Trinity's
    ``aggregate_loss``), the same for BAPO's loss and the README's at the chosen pair. The parts
    are read off the (rounded, in 16 bits) gradient, checked against it, and summed in float64.
    """
    probe = torch.ones_like(adv, dtype=torch.float64, requires_grad=True)
    (weight,) = torch.autograd.grad(aggregate_loss(probe, mask, fn.loss_agg_mode), probe)
    leaf = logprob.detach().clone().requires_grad_(True)
    loss, metrics = call(fn, leaf, old, mask, adv)
    ratio = torch.exp(torch.clamp(leaf - old, -20.0, 20.0))
    readme = ref.token_loss(ratio, adv, *chosen(metrics), fn.clip_ratio_c)
    scale = loss.new_tensor(1 / weight.max().item())  # keeps 16-bit gradients off underflow
    full = (adv.double() * ratio.detach().double()).abs() * weight * scale.double()
    resolution, parts = torch.finfo(logprob.dtype), []
    for total in (loss, aggregate_loss(readme, mask, fn.loss_agg_mode)):
        (grad,) = torch.autograd.grad(total, leaf, scale)
        part = torch.where(full > 0, torch.round(2 * grad.double().abs() / full) / 2, 0.0)
        torch.testing.assert_close(
            grad.double().abs(), part * full, rtol=8 * resolution.eps, atol=8 * resolution.tiny
        )
        parts.append(part)
    assert torch.equal(parts[0], parts[1])  # BAPO's loss passes on what the README's does
    positive, negative = (part * full)[adv > 0].sum(), (part * full)[adv < 0].sum()
    halved = torch.where(part == 0.5, full, 0.0) / (positive + negative)
    return metrics, float(positive / (positive + negative)), halved


def pair_sums(log_ratio, adv, mask, c_low, c_high, contribution, clip_ratio_c):
    """Return (P, N) at one pair, exact sums over the live tokens with A > 0 and with A < 0.

    ``surrogate``: Eq. 8 as printed. ``gradient``: |dL/dlogp| from autograd on the README's
    per-token loss. Each token weighs its mask value.
    """
    leaf = log_ratio.detach().clone().requires_grad_(True)
    ratio = torch.exp(leaf)
    if contribution == "surrogate":
        high, low = torch.clamp(ratio, max=c_high), torch.clamp(ratio, min=c_low)
        terms = torch.where(adv > 0, adv * high.double(), -adv * low.double())
    else:
        loss = ref.token_loss(ratio, adv, c_low, c_high, clip_ratio_c)
        (terms,) = torch.autograd.grad(loss.sum(), leaf)
    weighted = (terms.detach().double().abs() * mask.double()).reshape(-1).tolist()
    signs = adv.reshape(-1).tolist()
    positive = math.fsum(t for t, a in zip(weighted, signs) if a > 0)
    return positive, math.fsum(t for t, a in zip(weighted, signs) if a < 0)


def sequences(lengths, signs, spread=0.4):
    """Right-padded rows of the given lengths; each row's advantages have the row's sign."""
    logprob, old, mask, adv = batch((len(lengths), max(lengths)), spread=spread, lengths=lengths)
    return logprob, old, mask, torch.tensor(signs)[:, None] * (adv.abs() + 0.2)


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("ranges", [{}, point(0.6, 1.2)], ids=["paper_grid", "point"])
def test_share_equals_autograd_in_every_aggregation_mode(loss_agg_mode, ranges):
    """4 short positive and 4 long negative sequences: per-sequence weights matter."""
    data = sequences([4] * 4 + [64] * 4, [1] * 4 + [-1] * 4)
    fn = BAPOPolicyLossFn(loss_agg_mode=loss_agg_mode, **GRADIENT, **ranges)
    metrics, share, _ = autograd_share(fn, *data)
    assert metrics["bapo_positive_contribution"] == pytest.approx(share, rel=1e-6)


def test_seq_mean_token_mean_stops_where_the_start_pair_already_meets_the_target():
    """A plain token sum sees 4 x 4 positive against 4 x 64 negative tokens; the loss does not."""
    data = sequences([4] * 4 + [64] * 4, [1] * 4 + [-1] * 4, spread=0.05)
    fn = BAPOPolicyLossFn(loss_agg_mode="seq-mean-token-mean", **GRADIENT)
    metrics, share, _ = autograd_share(fn, *data)
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
    logprob, old, mask, adv = batch((1, 2000), seed=3, spread=0.4)
    logprob[0, 7] = old[0, 7] + log_ratio
    adv[0, 7] = sign * (0.01 if sign < 0 else 1.0)
    metrics, share, _ = autograd_share(
        BAPOPolicyLossFn(**GRADIENT, **ranges), logprob, old, mask, adv
    )
    assert metrics["bapo_positive_contribution"] == pytest.approx(share, rel=1e-6)


POINTS = [(0.6, 1.2), (0.8, 1.28), (0.9, 3.0), (0.75, 1.5)]
PRECISION_RANGES = {
    **{f"point_{lo}_{hi}": point(lo, hi) for lo, hi in POINTS},
    **{f"paper_grid_dual_clip_{c}": dict(clip_ratio_c=c) for c in (1.1, 1.3, 2.7)},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("name", PRECISION_RANGES)
def test_share_equals_autograd_in_every_precision(dtype, name):
    """Count ratios that round exactly onto a bound, and compare -A C in float32, as autograd does.

    Advantages in float32, as GRPO computes them. In low precision, ratios often land exactly on
    a bound, where the inclusive clamp keeps their gradient; no 16-bit type holds 1.1, 1.3 or 2.7.
    """
    logprob, old, mask, adv = batch(
        (1, 20000), seed=6, spread=0.4, dtype=dtype, adv_dtype=torch.float32
    )
    fn = BAPOPolicyLossFn(**GRADIENT, **PRECISION_RANGES[name])
    metrics, share, _ = autograd_share(fn, logprob, old, mask, adv)
    ratio = torch.exp(torch.clamp(logprob - old, -20.0, 20.0))
    low, high = (torch.tensor(bound, dtype=dtype) for bound in chosen(metrics))
    on_high, on_low = (ratio == high) & (adv > 0), (ratio == low) & (adv < 0)
    assert dtype == torch.float32 or (on_high | on_low).sum() >= 3  # a float64 test would miss
    assert metrics["bapo_positive_contribution"] == pytest.approx(share, rel=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "ranges, most_ties",
    [(point(0.6, 1.2), 10), (dict(clip_ratio_c=3.0), 10), (dict(clip_ratio_c=1.1), None)],
    ids=["point_0.6_1.2", "paper_grid_dual_clip_3.0", "paper_grid_dual_clip_1.1"],
)
def test_16_bit_advantages_differ_only_by_the_product_tie_residue(dtype, ranges, most_ties):
    """Differ from autograd by at most the weight of the product ties.

    With the advantages in 16 bits too, A r and A c can round to one value though r and c differ;
    autograd then halves such a token's gradient and the search does not. A ratio exactly on C
    is a true tie, which the search halves too. Where C is exact in 16 bits product ties are
    rare; C = 1.1 is not, and ratios on its 16-bit rounding often tie with it.
    """
    logprob, old, mask, adv = batch((1, 20000), seed=7, spread=0.4, dtype=dtype)
    fn = BAPOPolicyLossFn(**GRADIENT, **ranges)
    metrics, share, halved = autograd_share(fn, logprob, old, mask, adv)
    ratio = torch.exp(torch.clamp(logprob - old, -20.0, 20.0))
    ties = torch.where(ratio.double() == ranges.get("clip_ratio_c", 3.0), 0.0, halved)
    assert most_ties is None or (ties > 0).sum() < most_ties  # rare: under 1 in 2,000 tokens
    gap = abs(metrics["bapo_positive_contribution"] - share)
    assert gap <= float(ties.sum()) + 1e-9 * share


@pytest.mark.parametrize(
    "kind, mask_dtype",
    [("twos", torch.int64), ("twos", torch.int32), ("twos", torch.float32)]
    + [(kind, torch.float32) for kind in ("half", "tenth", "mixed")],
    ids=str,
)
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-6), (torch.float64, 1e-12)], ids=str)
@pytest.mark.parametrize("contribution", ["surrogate", "gradient"])
def test_mask_values_weigh_their_tokens_as_the_loss_does(
    kind, mask_dtype, dtype, rel, contribution
):
    """Weigh each token by its mask value (2 counts twice); an integer mask as its float copy."""
    logprob, old, _, adv = batch((4, 750), seed=5, dtype=dtype)
    mask = mask_values(kind, adv.shape, seed=5).to(mask_dtype)
    fn = BAPOPolicyLossFn(contribution=contribution)
    if contribution == "gradient":
        metrics, share, _ = autograd_share(fn, logprob, old, mask, adv)
        assert metrics["bapo_positive_contribution"] == pytest.approx(share, rel=rel)
    else:
        metrics = call(fn, logprob, old, mask, adv)[1]
    p, n = pair_sums(logprob - old, adv, mask, *chosen(metrics), contribution, 3.0)
    assert metrics["bapo_positive_contribution"] == pytest.approx(p / (p + n), rel=rel)
    assert call(fn, logprob, old, mask.float(), adv)[1] == metrics


@pytest.mark.parametrize("contribution", ["surrogate", "gradient"])
@pytest.mark.parametrize("clip_ratio_c", [3.0, 1.7, None])
@pytest.mark.parametrize("huge", [None, 1e19, 1e30, -1e19, -1e30])
def test_each_candidate_sums_only_its_own_tokens(contribution, clip_ratio_c, huge):
    """Equal the oracle at every pair, and leave the float64 inputs as they were.

    With or without one token of |A| = 1e19 or 1e30, positive past every c_high or negative
    under every c_low, beside tokens of order 1: a total minus a prefix would lose those.
    """
    logprob, old, _, adv = batch((6, 40), seed=11, spread=0.8, dtype=torch.float64)
    log_ratio, mask = logprob - old, mask_values("mixed", adv.shape, seed=11) > 0
    if huge is not None:
        log_ratio[0, 0], adv[0, 0], mask[0, 0] = math.log(5.0 if huge > 0 else 0.3), huge, True
    lower, upper = [0.5, 0.6, 0.75, 0.9, 1.0], [1.0, 1.2, 1.6, 2.5, 3.0, 4.0]
    ratio = torch.exp(log_ratio)
    edges = torch.tensor(lower + upper + [clip_ratio_c or 1.0], dtype=torch.float64)
    assert (ratio.reshape(-1, 1) - edges).abs().min() > 1e-9  # no exact ties with any bound
    assert (adv != 0).all()
    assert ratio[mask].max() > 4.0 and ratio[mask].min() < 0.5  # every candidate splits them

    search = BoundSearch(lower, upper, 0.4, "upper_first", contribution, clip_ratio_c)
    ratio_before, adv_before = ratio.clone(), adv.clone()
    sums = search.local_sums(ratio, adv, mask, torch.ones_like(mask))
    # The loss still needs its ratio after the search: no step of it may write into its inputs.
    assert torch.equal(ratio, ratio_before) and torch.equal(adv, adv_before)
    # laid out as [P per upper candidate | N per lower candidate | non-finite count]
    positive, negative, nonfinite = sums.tensor_split([len(upper), len(upper) + len(lower)])
    assert nonfinite.tolist() == [0.0]
    for i, c_low in enumerate(lower):
        for j, c_high in enumerate(upper):
            p, n = pair_sums(log_ratio, adv, mask, c_low, c_high, contribution, clip_ratio_c)
            assert positive[j] == pytest.approx(p, rel=1e-12), (c_low, c_high)
            assert negative[i] == pytest.approx(n, rel=1e-12), (c_low, c_high)
