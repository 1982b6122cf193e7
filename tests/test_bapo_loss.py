"""BAPOPolicyLossFn in one process: edge cases, PPO equivalence, bad input, metrics.

Expected values come from the definitions in the README (rho = P / (P + N), rho = 1 where
nothing contributes, Algorithm 1's loop condition) and from Trinity's own
``PPOPolicyLossFn``, never from the code under test.
"""

import math

import pytest
import torch

from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn

PAPER_START = (0.6, 1.2)  # (a-, a+) of the default, paper Sec. 5.1 grid
PAPER_MAX = (0.9, 3.0)  # (b-, b+)
PAPER_STEPS = 36 + 15  # (3.0 - 1.2) / 0.05 upper steps, then (0.9 - 0.6) / 0.02 lower steps
METRIC_KEYS = {
    "bapo_clip_low",
    "bapo_clip_high",
    "bapo_positive_contribution",
    "bapo_target_met",
    "bapo_search_steps",
    "bapo_nonfinite_tokens",
    "pg_clipfrac",
    "pg_clipfrac_lower",
    "ppo_kl",
    "pg_loss",
}
BOTH = [(o, c) for o in ("upper_first", "lower_first") for c in ("surrogate", "gradient")]


def _batch(seed=0, shape=(4, 24), spread=0.05, adv=None, dtype=torch.float32):
    """Ratios near 1 (inside every candidate pair) unless ``spread`` is large."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=gen, dtype=dtype) * 3 - 0.1
    logprob = old + spread * torch.randn(shape, generator=gen, dtype=dtype)
    if adv is None:
        adv = torch.randn(shape, generator=gen, dtype=dtype)
    return logprob, old, torch.ones(shape, dtype=dtype), adv


def _call(fn, logprob, old, mask, adv):
    return fn(logprob=logprob, old_logprob=old, action_mask=mask, advantages=adv)


def _pair(metrics):
    return metrics["bapo_clip_low"], metrics["bapo_clip_high"]


# --------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("order, contribution", BOTH)
def test_all_positive_advantages_keep_start_bounds(order, contribution):
    logprob, old, mask, _ = _batch(spread=0.5)
    adv = torch.rand(mask.shape) + 0.1
    _, m = _call(
        BAPOPolicyLossFn(search_order=order, contribution=contribution), logprob, old, mask, adv
    )
    assert _pair(m) == PAPER_START and m["bapo_search_steps"] == 0
    assert m["bapo_positive_contribution"] == 1.0 and m["bapo_target_met"] == 1.0


@pytest.mark.parametrize("order, contribution", BOTH)
def test_all_negative_advantages_saturate_both_bounds(order, contribution):
    # Ratios in (0.95, 1.05): every negative token carries weight under both definitions.
    logprob, old, mask, _ = _batch(spread=0.01)
    adv = -torch.rand(mask.shape) - 0.1
    assert ((logprob - old).exp() - 1).abs().max() < 0.05
    _, m = _call(
        BAPOPolicyLossFn(search_order=order, contribution=contribution), logprob, old, mask, adv
    )
    assert _pair(m) == PAPER_MAX and m["bapo_search_steps"] == PAPER_STEPS
    assert m["bapo_positive_contribution"] == 0.0 and m["bapo_target_met"] == 0.0


@pytest.mark.parametrize("order, contribution", BOTH)
def test_all_zero_advantages_have_rho_one(order, contribution):
    logprob, old, mask, _ = _batch(spread=0.5)
    loss, m = _call(
        BAPOPolicyLossFn(search_order=order, contribution=contribution),
        logprob,
        old,
        mask,
        torch.zeros(mask.shape),
    )
    assert _pair(m) == PAPER_START and m["bapo_search_steps"] == 0
    assert m["bapo_positive_contribution"] == 1.0  # P + N == 0: rho is 1 by definition
    assert loss.item() == 0.0


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("order, contribution", BOTH)
def test_empty_mask_gives_zero_loss_and_finite_gradient(order, contribution, loss_agg_mode):
    logprob, old, mask, adv = _batch(spread=0.5)
    logprob.requires_grad_(True)
    fn = BAPOPolicyLossFn(
        search_order=order, contribution=contribution, loss_agg_mode=loss_agg_mode
    )
    loss, m = _call(fn, logprob, old, torch.zeros_like(mask), adv)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == 0.0
    assert torch.isfinite(logprob.grad).all() and (logprob.grad == 0).all()
    assert _pair(m) == PAPER_START and m["bapo_search_steps"] == 0
    assert m["bapo_positive_contribution"] == 1.0
    assert all(math.isfinite(v) for v in m.values())


def test_point_lower_range_freezes_upper_bound_under_algorithm1():
    """Algorithm 1's loop needs room in the LOWER range, so c_high never moves (quirk)."""
    logprob, old, mask, _ = _batch(spread=0.01)
    adv = -torch.rand(mask.shape) - 0.1  # target unreachable
    point = dict(ratio_lower_start=0.8, ratio_lower_max=0.8)
    _, m = _call(BAPOPolicyLossFn(search_order="upper_first", **point), logprob, old, mask, adv)
    assert _pair(m) == (0.8, 1.2) and m["bapo_search_steps"] == 0
    assert m["bapo_target_met"] == 0.0
    # Contrast: the authors' order has its own loop for c_high and runs it to the end.
    _, m = _call(BAPOPolicyLossFn(search_order="lower_first", **point), logprob, old, mask, adv)
    assert _pair(m) == (0.8, 3.0) and m["bapo_search_steps"] == 36


@pytest.mark.parametrize("order, contribution", BOTH)
def test_target_zero_keeps_start_bounds(order, contribution):
    logprob, old, mask, _ = _batch(spread=0.01)
    adv = -torch.rand(mask.shape) - 0.1  # rho == 0, still >= a target of 0
    fn = BAPOPolicyLossFn(
        positive_contribution_target=0.0, search_order=order, contribution=contribution
    )
    _, m = _call(fn, logprob, old, mask, adv)
    assert _pair(m) == PAPER_START and m["bapo_search_steps"] == 0
    assert m["bapo_target_met"] == 1.0


@pytest.mark.parametrize("order, contribution", BOTH)
def test_target_one(order, contribution):
    """Reach rho = 1 only when no negative token contributes."""
    logprob, old, mask, adv = _batch(spread=0.01)  # mixed signs, ratios near 1
    fn = BAPOPolicyLossFn(
        positive_contribution_target=1.0, search_order=order, contribution=contribution
    )
    _, m = _call(fn, logprob, old, mask, adv)
    assert _pair(m) == PAPER_MAX and m["bapo_search_steps"] == PAPER_STEPS
    assert m["bapo_target_met"] == 0.0 and 0.0 < m["bapo_positive_contribution"] < 1.0
    _, m = _call(fn, logprob, old, mask, adv.abs())
    assert _pair(m) == PAPER_START and m["bapo_target_met"] == 1.0


# --------------------------------------------------------------------------- PPO equivalence


@pytest.mark.parametrize(
    "loss_agg_mode",
    ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
)
@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)])
@pytest.mark.parametrize("order", ["upper_first", "lower_first"])
def test_point_ranges_equal_ppo(loss_agg_mode, eps_low, eps_high, order):
    logprob, old, _, adv = _batch(seed=3, shape=(5, 20), spread=0.8)  # ratios up to > 3
    assert ((logprob - old).exp() > 3.0).any() and ((logprob - old).exp() < 0.5).any()
    lengths = torch.tensor([20, 13, 1, 7, 0])
    mask = (torch.arange(20)[None, :] < lengths[:, None]).float()
    c_low, c_high = 1.0 - eps_low, 1.0 + eps_high

    ppo = PPOPolicyLossFn(
        clip_range_low=eps_low,
        clip_range_high=eps_high,
        clip_ratio_c=3.0,
        loss_agg_mode=loss_agg_mode,
    )
    bapo = BAPOPolicyLossFn(
        ratio_lower_start=c_low,
        ratio_lower_max=c_low,
        ratio_upper_start=c_high,
        ratio_upper_max=c_high,
        clip_ratio_c=3.0,
        loss_agg_mode=loss_agg_mode,
        search_order=order,
    )
    results = []
    for fn in (ppo, bapo):
        lp = logprob.clone().requires_grad_(True)
        loss, metrics = _call(fn, lp, old, mask, adv)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    (ppo_loss, ppo_grad, ppo_m), (loss, grad, m) = results

    assert _pair(m) == (c_low, c_high) and m["bapo_search_steps"] == 0
    torch.testing.assert_close(loss, ppo_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ppo_grad, rtol=1e-6, atol=1e-7)
    assert grad.abs().sum() > 0 and 0 < ppo_m["pg_clipfrac"] < 1  # a non-trivial case
    assert ppo_m["pg_clipfrac_lower"] > 0  # the dual clip is exercised
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "pg_loss"):
        assert m[key] == pytest.approx(ppo_m[key], rel=1e-6, abs=1e-7), key


# --------------------------------------------------------------------------- bad input


def _ids(cases):
    """Readable test ids: the offending keyword arguments."""
    return [
        pytest.param(*case, id=",".join(f"{k}={v}" for k, v in case[0].items())) for case in cases
    ]


@pytest.mark.parametrize(
    "kwargs, name, allowed",
    _ids(
        [
            (
                dict(ratio_lower_start=0.9, ratio_lower_max=0.8),
                "ratio_lower_start",
                "<= ratio_lower_max",
            ),
            (
                dict(ratio_upper_start=2.0, ratio_upper_max=1.5),
                "ratio_upper_start",
                "<= ratio_upper_max",
            ),
            (dict(ratio_lower_step=0.0), "ratio_lower_step", "> 0"),
            (dict(ratio_lower_step=-0.02), "ratio_lower_step", "> 0"),
            (dict(ratio_upper_step=0.0), "ratio_upper_step", "> 0"),
            (dict(ratio_upper_step=-0.05), "ratio_upper_step", "> 0"),
            (dict(ratio_lower_start=0.0), "ratio_lower_start", "(0, 1]"),
            (dict(ratio_lower_start=-0.1), "ratio_lower_start", "(0, 1]"),
            (dict(ratio_lower_max=1.1), "ratio_lower_max", "(0, 1]"),
            (dict(ratio_upper_start=0.95), "ratio_upper_start", ">= 1"),
            (dict(ratio_upper_start=0.5, ratio_upper_max=0.9), "ratio_upper_start", ">= 1"),
            (dict(positive_contribution_target=-0.1), "positive_contribution_target", "[0, 1]"),
            (dict(positive_contribution_target=1.5), "positive_contribution_target", "[0, 1]"),
            (dict(search_order="upper"), "search_order", "upper_first"),
            (dict(contribution="loss"), "contribution", "surrogate"),
            (dict(clip_ratio_c=1.0), "clip_ratio_c", "> 1"),
            (dict(clip_ratio_c=0.5), "clip_ratio_c", "> 1"),
            (dict(loss_agg_mode="mean"), "loss_agg_mode", "token-mean"),
            (dict(ratio_upper_step=1e-5), "ratio_upper_step", "10000 candidates"),
            (dict(ratio_lower_step=1e-6), "ratio_lower_step", "10000 candidates"),
            # 10001 candidates (1.0, 1.0001, ..., 2.0): one too many
            (
                dict(ratio_upper_start=1.0, ratio_upper_max=2.0, ratio_upper_step=0.0001),
                "ratio_upper_step",
                "10000 candidates",
            ),
            # 10000 grid points plus the capped maximum the authors' order appends: 10001
            (
                dict(
                    ratio_upper_start=1.0,
                    ratio_upper_max=1.99995,
                    ratio_upper_step=0.0001,
                    search_order="lower_first",
                ),
                "ratio_upper_step",
                "10000 candidates",
            ),
            (dict(ratio_lower_start=math.nan), "ratio_lower_start", "finite"),
            (dict(ratio_lower_max=math.nan), "ratio_lower_max", "finite"),
            (dict(ratio_lower_step=math.nan), "ratio_lower_step", "finite"),
            (dict(ratio_upper_start=math.nan), "ratio_upper_start", "finite"),
            (dict(ratio_upper_max=math.inf), "ratio_upper_max", "finite"),
            (dict(ratio_upper_step=math.nan), "ratio_upper_step", "finite"),
            (dict(positive_contribution_target=math.nan), "positive_contribution_target", "finite"),
            (dict(clip_ratio_c=math.nan), "clip_ratio_c", "finite"),
            (dict(ratio_upper_max=10**400), "ratio_upper_max", "finite"),  # float() overflows
            (dict(ratio_lower_step="0.02"), "ratio_lower_step", "a real number"),
            (dict(ratio_lower_start=True), "ratio_lower_start", "a real number"),
            (dict(clip_ratio_c=torch.tensor([3.0])), "clip_ratio_c", "0-d tensor"),
            (dict(sync_across_dp=1), "sync_across_dp", "a boolean"),
            (dict(sync_across_dp="true"), "sync_across_dp", "a boolean"),
        ]
    ),
)
def test_invalid_arguments_name_the_argument_and_range(kwargs, name, allowed):
    with pytest.raises(ValueError) as info:
        BAPOPolicyLossFn(**kwargs)
    message = str(info.value)
    assert name in message and allowed in message, message


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(ratio_lower_start=1.0, ratio_lower_max=1.0, ratio_upper_start=1.0),  # edges valid
        dict(ratio_lower_start=0.8, ratio_lower_max=0.8, ratio_lower_step=0.0),  # point: any step
        dict(ratio_upper_start=2.0, ratio_upper_max=2.0, ratio_upper_step=-1.0),
        dict(positive_contribution_target=0.0),
        dict(positive_contribution_target=1),
        dict(clip_ratio_c=None),
        # exactly 10000 candidates (1.0, 1.0001, ..., 1.9999): still allowed
        dict(ratio_upper_start=1.0, ratio_upper_max=1.9999, ratio_upper_step=0.0001),
    ],
)
def test_boundary_arguments_are_accepted(kwargs):
    BAPOPolicyLossFn(**kwargs)


def test_mismatched_shapes_raise():
    logprob, old, mask, adv = _batch(shape=(2, 5))
    with pytest.raises(ValueError, match="shape"):
        _call(BAPOPolicyLossFn(), logprob, old, mask, adv[:, :4])
    with pytest.raises(ValueError, match="shape"):
        _call(BAPOPolicyLossFn(), logprob, old[:1], mask, adv)


def _negative_batch():
    """All-negative advantages: a finite batch would search to (0.9, 3.0)."""
    logprob, old, mask, _ = _batch(spread=0.01)
    return logprob, old, mask, -torch.rand(mask.shape) - 0.1


@pytest.mark.parametrize("order, contribution", BOTH)
def test_nonfinite_unmasked_tokens_keep_start_bounds(order, contribution):
    logprob, old, mask, adv = _negative_batch()
    logprob[0, 0] = math.nan
    logprob[1, 2] = math.inf
    old[2, 3] = -math.inf
    adv[3, 4] = math.nan
    logprob[3, 4] = math.nan  # same token as above: counted once
    _, m = _call(
        BAPOPolicyLossFn(search_order=order, contribution=contribution), logprob, old, mask, adv
    )
    assert m["bapo_nonfinite_tokens"] == 4
    assert _pair(m) == PAPER_START and m["bapo_search_steps"] == 0


@pytest.mark.parametrize("order, contribution", BOTH)
def test_nonfinite_masked_tokens_are_ignored(order, contribution):
    logprob, old, mask, adv = _negative_batch()
    mask[0, -3:] = 0
    logprob[0, -1], old[0, -2], adv[0, -3] = math.nan, math.inf, math.nan
    fn = BAPOPolicyLossFn(search_order=order, contribution=contribution)
    logprob.requires_grad_(True)
    loss, m = _call(fn, logprob, old, mask, adv)
    loss.backward()
    # Gradient on live tokens stays finite. (A NaN *advantage* on a masked token still gives
    # a NaN gradient at that masked place, exactly as PPOPolicyLossFn does: not checked here.)
    assert torch.isfinite(logprob.grad[mask.bool()]).all()
    assert m["bapo_nonfinite_tokens"] == 0
    assert _pair(m) == PAPER_MAX and m["bapo_search_steps"] == PAPER_STEPS
    assert torch.isfinite(loss)
    # The same as with finite junk in those masked places.
    clean = [t.detach().clone() for t in (logprob, old, adv)]
    for t in clean:
        t[0, -3:] = 0.0
    clean_loss, clean_m = _call(fn, clean[0], clean[1], mask, clean[2])
    assert loss.item() == clean_loss.item() and m == clean_m


# --------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("order, contribution", BOTH)
def test_metrics_are_flat_documented_python_numbers(order, contribution):
    logprob, old, mask, adv = _batch(spread=0.3)
    _, m = _call(
        BAPOPolicyLossFn(search_order=order, contribution=contribution), logprob, old, mask, adv
    )
    assert set(m) == METRIC_KEYS
    for key, value in m.items():
        assert type(value) in (float, int), (key, type(value))
    assert type(m["bapo_search_steps"]) is int and type(m["bapo_nonfinite_tokens"]) is int
    assert m["bapo_target_met"] in (0.0, 1.0)
