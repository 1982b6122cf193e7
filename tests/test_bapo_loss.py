"""BAPOPolicyLossFn in one process: edge cases, PPO equivalence, arguments, metrics, faults.

Expected values come from the definitions in the README (rho = P / (P + N), rho = 1 where
nothing contributes, Algorithm 1's loop condition), from Trinity's own ``PPOPolicyLossFn``, or
from the same call on clean inputs, never from the code under test. Faults cover classes of
input: far points and tiny gaps for memory, every input and every non-finite value for masks.
"""

import json
import math
import subprocess
import sys
import textwrap
from decimal import Decimal

import numpy as np
import pytest
import torch

import bapo_inputs as inputs
from bapo_inputs import BOTH, PAPER_START, RANGE_ARGS, batch, call, chosen, mask_values, point
from scripts.harness.launch import REPO
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import LOSS_AGG_MODES, BAPOPolicyLossFn
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn


@pytest.mark.parametrize("order, contribution", BOTH)
@pytest.mark.parametrize(
    "sign, target, rho",
    [(1.0, 0.4, 1.0), (1.0, 1.0, 1.0), (-1.0, 0.0, 0.0)],
    ids=["all_positive", "all_positive_target_1", "all_negative_target_0"],
)
def test_start_pair_is_kept_when_it_meets_the_target(order, contribution, sign, target, rho):
    logprob, old, mask, adv = batch((4, 24), spread=0.5 if sign > 0 else 0.01)
    fn = BAPOPolicyLossFn(
        positive_contribution_target=target, search_order=order, contribution=contribution
    )
    _, m = call(fn, logprob, old, mask, sign * (adv.abs() + 0.1))
    assert chosen(m) == PAPER_START and m["bapo_search_steps"] == 0
    assert m["bapo_positive_contribution"] == rho and m["bapo_target_met"] == 1.0


@pytest.mark.parametrize("nothing", ["empty_mask", "zero_advantages"])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("order, contribution", BOTH)
def test_no_contribution_gives_rho_one_zero_loss_and_zero_gradient(
    order, contribution, loss_agg_mode, nothing
):
    """P + N == 0, with no live token or with every advantage 0: rho is 1 by definition."""
    logprob, old, mask, adv = batch((4, 24), spread=0.5)
    if nothing == "empty_mask":
        mask = torch.zeros_like(mask)
    else:
        adv = torch.zeros_like(adv)
    logprob.requires_grad_(True)
    fn = BAPOPolicyLossFn(
        search_order=order, contribution=contribution, loss_agg_mode=loss_agg_mode
    )
    loss, m = call(fn, logprob, old, mask, adv)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == 0.0
    assert torch.isfinite(logprob.grad).all() and (logprob.grad == 0).all()
    assert chosen(m) == PAPER_START and m["bapo_search_steps"] == 0
    assert m["bapo_positive_contribution"] == 1.0 and m["bapo_target_met"] == 1.0
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize(
    "lower", [(0.8, 0.8, 0.05), (0.8, 0.84, 0.05)], ids=["point", "narrower_than_a_step"]
)
def test_lower_range_without_room_is_refused_under_algorithm1(lower):
    """Algorithm 1's loop needs room in the LOWER range: c_high alone would never move.

    The constructor says so and what to do; the authors' order adapts the same ranges, and
    both ranges collapsed (PPO's fixed clipping) stay accepted.
    """
    frozen = dict(zip(RANGE_ARGS[:3], lower))
    with pytest.raises(ValueError, match="never adapts") as raised:
        BAPOPolicyLossFn(search_order="upper_first", **frozen)
    assert "give the lower range room" in str(raised.value) and "lower_first" in str(raised.value)
    logprob, old, mask, adv = batch((4, 24), spread=0.01)
    adv = -adv.abs() - 0.1  # target unreachable
    _, m = call(BAPOPolicyLossFn(search_order="lower_first", **frozen), logprob, old, mask, adv)
    capped = lower[0] != lower[1]  # the authors' order caps its last step at the maximum
    assert chosen(m) == (lower[1], 3.0) and m["bapo_search_steps"] == 36 + capped
    fixed = BAPOPolicyLossFn(search_order="upper_first", **point(0.8, 1.2))
    _, m = call(fixed, logprob, old, mask, adv)
    assert chosen(m) == (0.8, 1.2) and m["bapo_search_steps"] == 0


@pytest.mark.parametrize("mask_kind", ["ones", "half", "tenth", "mixed"])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)])
@pytest.mark.parametrize("order", ["upper_first", "lower_first"])
def test_point_ranges_equal_ppo(mask_kind, loss_agg_mode, eps_low, eps_high, order):
    """Rows of unequal length, the mask's values 1, 0.5, 0.1 or mixed fractions."""
    shape, lengths = (5, 20), [20, 13, 1, 7, 0]
    logprob, old, mask, adv = batch(shape, seed=3, spread=0.8, lengths=lengths)
    assert ((logprob - old).exp() > 3.0).any() and ((logprob - old).exp() < 0.5).any()
    mask = mask * mask_values(mask_kind, shape, seed=4)
    c_low, c_high = 1.0 - eps_low, 1.0 + eps_high

    ppo = PPOPolicyLossFn(
        clip_range_low=eps_low,
        clip_range_high=eps_high,
        clip_ratio_c=3.0,
        loss_agg_mode=loss_agg_mode,
    )
    bapo = BAPOPolicyLossFn(
        **point(c_low, c_high), clip_ratio_c=3.0, loss_agg_mode=loss_agg_mode, search_order=order
    )
    results = []
    for fn in (ppo, bapo):
        lp = logprob.clone().requires_grad_(True)
        loss, metrics = call(fn, lp, old, mask, adv)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    (ppo_loss, ppo_grad, ppo_m), (loss, grad, m) = results

    assert chosen(m) == (c_low, c_high) and m["bapo_search_steps"] == 0
    torch.testing.assert_close(loss, ppo_loss, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(grad, ppo_grad, rtol=1e-6, atol=1e-7)
    assert grad.abs().sum() > 0 and 0 < ppo_m["pg_clipfrac"] < 1  # a non-trivial case
    assert ppo_m["pg_clipfrac_lower"] > 0  # the dual clip is exercised
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "pg_loss"):
        assert m[key] == pytest.approx(ppo_m[key], rel=1e-6, abs=1e-9), key


ULP_ABOVE_06 = math.nextafter(0.6, 1.0)
ULP_ABOVE_12 = math.nextafter(1.2, 2.0)
LOWER = "a ratio in [1.18e-38, 1]"  # down to the smallest normal float32
UPPER = "a ratio in [1, 3.4e+38]"  # up to the largest float32
MANY = "at most 10000 distinct candidates"
FINE = dict(ratio_upper_start=1.0, ratio_upper_step=0.0001)  # candidates 1.0, 1.0001, 1.0002, ...
BAD_ARGUMENTS: list[tuple[dict, str, str]] = [
    (dict(ratio_lower_start=0.9, ratio_lower_max=0.8), "ratio_lower_max", ">= ratio_lower_start"),
    (dict(ratio_upper_start=2.0, ratio_upper_max=1.5), "ratio_upper_max", ">= ratio_upper_start"),
    (dict(ratio_lower_step=0.0), "ratio_lower_step", "> 0"),
    (dict(ratio_lower_step=-0.02), "ratio_lower_step", "> 0"),
    (dict(ratio_upper_step=0.0), "ratio_upper_step", "> 0"),
    (dict(ratio_upper_step=-0.05), "ratio_upper_step", "> 0"),
    (dict(ratio_lower_start=0.0), "ratio_lower_start", LOWER),
    (dict(ratio_lower_start=-0.1), "ratio_lower_start", LOWER),
    (dict(ratio_lower_max=1.1), "ratio_lower_max", LOWER),
    (dict(ratio_lower_start=1e-310), "ratio_lower_start", LOWER),  # subnormal
    (dict(ratio_lower_start=1e-40, ratio_lower_max=1e-40), "ratio_lower_start", LOWER),
    (dict(ratio_upper_start=0.95), "ratio_upper_start", UPPER),
    (dict(ratio_upper_start=1e300, ratio_upper_max=1e300), "ratio_upper_start", UPPER),
    (dict(ratio_upper_max=3.5e38), "ratio_upper_max", UPPER),  # past the largest float32
    (dict(positive_contribution_target=-0.1), "positive_contribution_target", "[0, 1]"),
    (dict(positive_contribution_target=1.5), "positive_contribution_target", "[0, 1]"),
    (dict(search_order="upper"), "search_order", "upper_first"),
    (dict(contribution="loss"), "contribution", "surrogate"),
    (dict(clip_ratio_c=1.0), "clip_ratio_c", "> 1"),
    (dict(clip_ratio_c=0.5), "clip_ratio_c", "> 1"),
    (dict(loss_agg_mode="mean"), "loss_agg_mode", "token-mean"),
    (dict(ratio_upper_step=1e-5), "ratio_upper_step", MANY),
    (dict(ratio_upper_step=1e-300), "ratio_upper_step", MANY),
    (dict(FINE, ratio_upper_max=2.0), "ratio_upper_step", MANY),  # 10001 up to 2.0: one too many
    # 10000 grid points plus the capped maximum the authors' order appends: 10001
    (dict(FINE, ratio_upper_max=1.99995, search_order="lower_first"), "ratio_upper_step", MANY),
    (dict(ratio_lower_max=ULP_ABOVE_06, ratio_lower_step=1e-17), "ratio_lower_step", MANY),
    (dict(ratio_upper_max=ULP_ABOVE_12, ratio_upper_step=1e-18), "ratio_upper_step", MANY),
    (dict(ratio_lower_start=math.nan), "ratio_lower_start", LOWER),
    (dict(ratio_lower_step=math.nan), "ratio_lower_step", "> 0"),
    (dict(ratio_upper_max=math.inf), "ratio_upper_max", UPPER),
    (dict(positive_contribution_target=math.nan), "positive_contribution_target", "[0, 1]"),
    (dict(clip_ratio_c=math.inf), "clip_ratio_c", "> 1"),
    (dict(ratio_upper_max=10**400), "ratio_upper_max", UPPER),  # float() overflows
    (dict(ratio_lower_step="two"), "ratio_lower_step", "> 0"),
    (dict(ratio_lower_start=True), "ratio_lower_start", LOWER),  # a YAML `yes` is no number
    (dict(clip_ratio_c=[3.0]), "clip_ratio_c", "> 1"),
    (dict(sync_across_dp=1), "sync_across_dp", "true or false"),
    (dict(sync_across_dp="true"), "sync_across_dp", "true or false"),
]


@pytest.mark.parametrize(
    "kwargs, name, allowed",
    [
        pytest.param(*case, id=",".join(f"{k}={v}" for k, v in case[0].items()))
        for case in BAD_ARGUMENTS
    ],
)
def test_invalid_arguments_name_the_argument_and_range(kwargs, name, allowed):
    with pytest.raises(ValueError) as info:
        BAPOPolicyLossFn(**kwargs)
    message = str(info.value)
    assert f"`{name}`" in message and allowed in message, message


PAPER_LOWER = [round(0.6 + 0.02 * k, 2) for k in range(16)]  # 0.6, 0.62, ..., 0.9
PAPER_UPPER = [round(1.2 + 0.05 * k, 2) for k in range(37)]  # 1.2, 1.25, ..., 3.0
# Arguments at the edge of what is allowed, and the grids (lower, upper) each must build.
BOUNDARY_ARGUMENTS = [
    (point(1.0, 1.0), [1.0], [1.0]),  # both edges at 1: fixed clipping at r = 1
    (dict(point(0.8, 1.5), ratio_lower_step=0.0, ratio_upper_step=-1.0), [0.8], [1.5]),
    (dict(ratio_lower_start=0.8, ratio_lower_max=0.8, search_order="lower_first"), [0.8], None),
    (dict(ratio_upper_start=2.0, ratio_upper_max=2.0), None, [2.0]),
    (dict(FINE, ratio_upper_max=1.9999), None, [round(1 + k / 10**4, 4) for k in range(10**4)]),
    (
        dict(ratio_upper_start=np.int64(1), ratio_upper_max=np.int32(2)),
        None,
        [round(1 + 0.05 * k, 2) for k in range(21)],
    ),
    (
        dict(ratio_lower_step="0.05", ratio_upper_step=torch.tensor([0.6], dtype=torch.float64)),
        [round(0.6 + 0.05 * k, 2) for k in range(7)],
        [1.2, 1.8, 2.4, 3.0],
    ),
]


@pytest.mark.parametrize("kwargs, lower, upper", BOUNDARY_ARGUMENTS)
def test_boundary_arguments_build_their_grids(kwargs, lower, upper):
    """Each accepted edge builds the grid it names; None stands for the paper's grid.

    Strings and one-element tensors are numbers as ``float()`` reads them.
    """
    fn = BAPOPolicyLossFn(**kwargs)
    assert fn.search.lower == (PAPER_LOWER if lower is None else lower)
    assert fn.search.upper == (PAPER_UPPER if upper is None else upper)


@pytest.mark.parametrize("target", [0.0, 1, "0.5"])
@pytest.mark.parametrize("clip_ratio_c", [None, 1.0000001, "2"])
def test_target_and_dual_clip_at_their_edges_are_taken_as_written(target, clip_ratio_c):
    fn = BAPOPolicyLossFn(positive_contribution_target=target, clip_ratio_c=clip_ratio_c)
    assert fn.search.target == float(target)
    assert fn.clip_ratio_c == (None if clip_ratio_c is None else float(clip_ratio_c))


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
    values = dict(zip(RANGE_ARGS, (0.6, 0.9, 0.02, 1.2, 3.0, 0.05)))
    values.update(positive_contribution_target=0.45, clip_ratio_c=3.0)
    converted = BAPOPolicyLossFn(**{k: convert(v) for k, v in values.items()})
    plain = BAPOPolicyLossFn(**{k: float(convert(v)) for k, v in values.items()})
    assert converted.search.lower == plain.search.lower
    assert converted.search.upper == plain.search.upper
    data = batch((4096,), seed=2)
    assert call(converted, *data)[1] == call(plain, *data)[1]


@pytest.mark.parametrize("flag", [np.bool_(True), np.bool_(False)])
def test_numpy_booleans_set_the_sync_flag(flag):
    assert BAPOPolicyLossFn(sync_across_dp=flag).sync.enabled is bool(flag)


def test_mismatched_shapes_raise():
    logprob, old, mask, adv = batch((2, 5))
    with pytest.raises(ValueError, match="shape"):
        call(BAPOPolicyLossFn(), logprob, old, mask, adv[:, :4])
    with pytest.raises(ValueError, match="shape"):
        call(BAPOPolicyLossFn(), logprob, old[:1], mask, adv)


@pytest.mark.parametrize("order, contribution", BOTH)
def test_metrics_are_flat_documented_python_numbers(order, contribution):
    logprob, old, mask, adv = batch((4, 24), spread=0.3)
    _, m = call(
        BAPOPolicyLossFn(search_order=order, contribution=contribution), logprob, old, mask, adv
    )
    assert set(m) == inputs.METRIC_KEYS
    for key, value in m.items():
        assert type(value) in (float, int), (key, type(value))
    assert type(m["bapo_search_steps"]) is int and type(m["bapo_nonfinite_tokens"]) is int
    assert m["bapo_target_met"] in (0.0, 1.0)


# Configurations that construct, with points far from 1 and grids with tiny gaps. A search
# that sizes anything by (span of the grid) / (smallest gap) asks for gigabytes here.
FAR_AND_TINY = [
    dict(search_order="lower_first", ratio_lower_step=0.0333333333),  # capped last gap ~1e-10
    dict(search_order="lower_first", ratio_upper_step=0.0499999999999),
    dict(ratio_upper_start=1e8, ratio_upper_max=1e8),  # "no upper clip"
    dict(ratio_upper_start=3e38, ratio_upper_max=3e38),
    dict(ratio_lower_start=1e-9, ratio_lower_max=1e-9, search_order="lower_first"),
    dict(ratio_lower_start=1e-37, ratio_lower_max=1e-37, search_order="lower_first"),
    dict(ratio_lower_start=1e-30, ratio_lower_max=0.9, ratio_lower_step=0.3),
    dict(ratio_upper_start=1.0, ratio_upper_max=1e30, ratio_upper_step=1e27),
    dict(ratio_lower_start=0.5, ratio_lower_max=0.5 + 1e-12, ratio_lower_step=1e-13),
]

_MEMORY_PROBE = textwrap.dedent("""
    import json, resource, sys
    from scripts.harness.cases import bench_batch
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    def data_bytes():
        with open("/proc/self/status") as status:
            line = next(l for l in status if l.startswith("VmData:"))
        return int(line.split()[1]) * 1024

    # A runaway allocation fails here instead of taking the machine down.
    limit = data_bytes() + (1 << 30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    batch = bench_batch((64, 1024), seed=0, negative_share=0.5)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for kwargs in json.loads(sys.argv[1]):
        for contribution in ("surrogate", "gradient"):
            BAPOPolicyLossFn(contribution=contribution, **kwargs)(**batch)
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
        cwd=REPO,
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
    assert chosen(m) == inputs.PAPER_MAX and m["bapo_search_steps"] == inputs.PAPER_STEPS
