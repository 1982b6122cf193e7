"""BAPOPolicyLossFn in one process: edge cases, PPO equivalence, arguments, metrics, faults.

Expected values come from the definitions in the README (rho = P / (P + N), rho = 1 where
nothing contributes, Algorithm 1's loop condition), from Trinity's own ``PPOPolicyLossFn``, or
from the same call on clean inputs, never from the code under test.
"""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from scripts.harness.launch import REPO
from tests import inputs, oracle
from tests.inputs import (
    AGG_MODES,
    ORDERS,
    PAPER_START,
    batch,
    call,
    chosen,
    loss_kwargs,
    mask_values,
    point,
)
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "sign, target, rho",
    [(1.0, 0.4, 1.0), (1.0, 1.0, 1.0), (-1.0, 0.0, 0.0)],
    ids=["all_positive", "all_positive_target_1", "all_negative_target_0"],
)
def test_start_pair_is_kept_when_it_meets_the_target(order, sign, target, rho):
    logprob, old, mask, adv = batch((4, 24), spread=0.5 if sign > 0 else 0.01)
    fn = BAPOPolicyLossFn(positive_contribution_target=target, search_order=order)
    _, m = call(fn, logprob, old, mask, sign * (adv.abs() + 0.1))
    assert chosen(m) == (*PAPER_START, 0)
    assert m["bapo_positive_contribution"] == rho and m["bapo_target_met"] == 1.0


@pytest.mark.parametrize("nothing", ["empty_mask", "zero_advantages"])
@pytest.mark.parametrize("loss_agg_mode", AGG_MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_no_contribution_gives_rho_one_zero_loss_and_zero_gradient(order, loss_agg_mode, nothing):
    """P + N == 0, with no live token or with every advantage 0: rho is 1 by definition."""
    logprob, old, mask, adv = batch((4, 24), spread=0.5)
    if nothing == "empty_mask":
        mask = torch.zeros_like(mask)
    else:
        adv = torch.zeros_like(adv)
    logprob.requires_grad_(True)
    fn = BAPOPolicyLossFn(search_order=order, loss_agg_mode=loss_agg_mode)
    loss, m = call(fn, logprob, old, mask, adv)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == 0.0
    assert torch.isfinite(logprob.grad).all() and (logprob.grad == 0).all()
    assert chosen(m) == (*PAPER_START, 0)
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
    frozen = dict(zip(inputs.RANGE_ARGS[:3], lower))
    with pytest.raises(ValueError, match="`ratio_lower_max` room") as raised:
        BAPOPolicyLossFn(search_order="upper_first", **frozen)
    assert "lower_first" in str(raised.value)
    logprob, old, mask, adv = batch((4, 24), spread=0.01)
    adv = -adv.abs() - 0.1  # target unreachable
    _, m = call(BAPOPolicyLossFn(search_order="lower_first", **frozen), logprob, old, mask, adv)
    capped = lower[0] != lower[1]  # the authors' order caps its last step at the maximum
    assert chosen(m) == (lower[1], 3.0, 36 + capped)
    _, m = call(BAPOPolicyLossFn(**point(0.8, 1.2)), logprob, old, mask, adv)
    assert chosen(m) == (0.8, 1.2, 0)


def forward_backward(fn, logprob, old, mask, adv):
    """(loss, gradient with respect to the log-probs, metrics) of one call."""
    lp = logprob.clone().requires_grad_(True)
    loss, metrics = call(fn, lp, old, mask, adv)
    loss.backward()
    return loss.detach(), lp.grad, metrics


@pytest.mark.parametrize("mask_kind", ["ones", "half", "tenth", "mixed"])
@pytest.mark.parametrize("loss_agg_mode", AGG_MODES)
@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)])
@pytest.mark.parametrize("order", ORDERS)
def test_point_ranges_equal_ppo(mask_kind, loss_agg_mode, eps_low, eps_high, order):
    """Rows of unequal length, the mask's values 1, 0.5, 0.1 or mixed fractions."""
    shape, lengths = (5, 20), [20, 13, 1, 7, 0]
    logprob, old, mask, adv = batch(shape, seed=3, spread=0.8, lengths=lengths)
    assert ((logprob - old).exp() > 3.0).any() and ((logprob - old).exp() < 0.5).any()
    mask = mask * mask_values(mask_kind, shape, seed=4)
    c_low, c_high = 1.0 - eps_low, 1.0 + eps_high
    ppo = PPOPolicyLossFn(
        clip_range_low=eps_low, clip_range_high=eps_high, loss_agg_mode=loss_agg_mode
    )
    bapo = BAPOPolicyLossFn(**point(c_low, c_high), loss_agg_mode=loss_agg_mode, search_order=order)
    ppo_loss, ppo_grad, ppo_m = forward_backward(ppo, logprob, old, mask, adv)
    loss, grad, m = forward_backward(bapo, logprob, old, mask, adv)
    assert chosen(m) == (c_low, c_high, 0)
    torch.testing.assert_close(loss, ppo_loss, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(grad, ppo_grad, rtol=1e-6, atol=1e-7)
    assert grad.abs().sum() > 0 and 0 < ppo_m["pg_clipfrac"] < 1  # a non-trivial case
    assert ppo_m["pg_clipfrac_lower"] > 0  # the dual clip is exercised
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "pg_loss"):
        assert m[key] == pytest.approx(ppo_m[key], rel=1e-6, abs=1e-9), key


FINE = dict(ratio_upper_start=1.0, ratio_upper_max=1.9999, ratio_upper_step=1e-4)
LOWER, UPPER, STEP, NUMBER = "[0.0, 1.0]", "[1.0, ", "makes over 10000 steps", "must be a number"
NEGATIVE = "must be a number in [0, inf]"  # a step below 0, refused as no number of its range
BAD_ARGUMENTS: list[tuple[dict, str, str]] = [
    (dict(ratio_lower_start=0.9, ratio_lower_max=0.8), "ratio_lower_max", "[0.9, 1.0]"),
    (dict(ratio_upper_start=2.0, ratio_upper_max=1.5), "ratio_upper_max", "[2.0, "),
    (dict(ratio_lower_start=-0.1), "ratio_lower_start", LOWER),
    (dict(ratio_lower_start=math.nan), "ratio_lower_start", LOWER),
    (dict(ratio_lower_max=1.1), "ratio_lower_max", "[0.6, 1.0]"),
    (dict(ratio_upper_start=0.95), "ratio_upper_start", UPPER),
    (dict(ratio_upper_max=math.inf), "ratio_upper_max", "[1.2, "),
    (dict(ratio_upper_max=10**500), "ratio_upper_max", "[1.2, "),
    (point(0.8, 1e9), "ratio_upper_start", UPPER),  # beyond exp(20), which no clamped ratio passes
    (dict(ratio_lower_step=0.0), "ratio_lower_step", STEP),  # never reaching the max
    (dict(ratio_lower_step=-0.02), "ratio_lower_step", NEGATIVE),
    (dict(ratio_lower_step=math.nan), "ratio_lower_step", NUMBER),
    (dict(ratio_upper_step=0.0), "ratio_upper_step", STEP),
    (dict(ratio_upper_step=True), "ratio_upper_step", NUMBER),
    (dict(ratio_upper_step=1e-5), "ratio_upper_step", STEP),
    (dict(ratio_upper_step=1e-300), "ratio_upper_step", STEP),
    (dict(FINE, ratio_upper_max=2.00005), "ratio_upper_step", STEP),  # 10,000.5 steps
    (dict(positive_contribution_target=-0.1), "positive_contribution_target", "[0, 1]"),
    (dict(positive_contribution_target=1.5), "positive_contribution_target", "[0, 1]"),
    (dict(positive_contribution_target=math.nan), "positive_contribution_target", "[0, 1]"),
    (dict(positive_contribution_target="0.4"), "positive_contribution_target", NUMBER),
    (dict(positive_contribution_target=None), "positive_contribution_target", NUMBER),
    (dict(ratio_lower_start=[0.6]), "ratio_lower_start", NUMBER),
    (dict(ratio_lower_max=False), "ratio_lower_max", NUMBER),
    (dict(search_order="upper"), "search_order", "upper_first"),
    (dict(clip_ratio_c=1.0), "clip_ratio_c", "> 1"),
    (dict(clip_ratio_c=0.5), "clip_ratio_c", "[1, "),
    (dict(clip_ratio_c=math.nan), "clip_ratio_c", "[1, "),
    (dict(clip_ratio_c=None), "clip_ratio_c", NUMBER),
    (dict(loss_agg_mode="mean"), "loss_agg_mode", "token-mean"),
    (dict(loss_agg_mode="token-sum"), "loss_agg_mode", "seq-mean-token-sum-norm"),
    (dict(sync_across_dp="false"), "sync_across_dp", "true or false"),
    (dict(sync_across_dp=1), "sync_across_dp", "true or false"),
    (dict(point(0.8, 1.5), ratio_lower_step="junk"), "ratio_lower_step", NUMBER),
    (dict(point(0.8, 1.5), ratio_upper_step=None), "ratio_upper_step", NUMBER),
    (dict(point(0.8, 1.5), ratio_upper_step=-1.0), "ratio_upper_step", NEGATIVE),  # a point too
    (dict(search_scope="step"), "search_scope", "micro_batch or update"),
    # grids whose candidates round to fewer floats than they count: refused, naming the range
    (
        dict(point(0.9, 1.5), ratio_lower_max=0.9000000000000002, ratio_lower_step=1e-18),
        "ratio_lower_step",
        "[0.9, 0.9000000000000002]",
    ),
    (
        dict(ratio_upper_start=1.0, ratio_upper_max=1.000000000000001, ratio_upper_step=1e-16),
        "ratio_upper_step",
        "[1.0, 1.000000000000001]",
    ),
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
    assert name in message and allowed in message, message
    assert allowed != STEP or NEGATIVE not in message, message  # a fine step is no negative one


PAPER_LOWER = [round(0.6 + 0.02 * k, 2) for k in range(16)]  # 0.6, 0.62, ..., 0.9
PAPER_UPPER = [round(1.2 + 0.05 * k, 2) for k in range(37)]  # 1.2, 1.25, ..., 3.0
FINE_CAPPED = [round(1 + k / 10**4, 4) for k in range(9999)] + [1.99985]
SEVENTHS = [0.6, 0.67, 0.74, 0.81, 0.88]  # 0.9 is no step of 0.07 from 0.6
# Arguments at the edge of what is allowed, and the grids (lower, upper) each must build.
BOUNDARY_ARGUMENTS = [
    (point(1.0, 1.0), [1.0], [1.0]),  # both edges at 1: fixed clipping at r = 1
    (dict(point(0.8, 1.5), ratio_lower_step=0.0, ratio_upper_step=0.0), [0.8], [1.5]),
    (dict(ratio_lower_start=0.8, ratio_lower_max=0.8, search_order="lower_first"), [0.8], None),
    (dict(ratio_upper_start=2.0, ratio_upper_max=2.0), None, [2.0]),
    (FINE, None, [round(1 + k / 10**4, 4) for k in range(10**4)]),  # 9,999 steps
    # 10,000 steps, the most allowed; 9,999.5 and lower_first's cap, which counts as no step
    (dict(FINE, ratio_upper_max=2.0), None, [round(1 + k / 10**4, 4) for k in range(10**4 + 1)]),
    (
        dict(FINE, ratio_upper_max=1.99995, search_order="lower_first"),
        None,
        [round(1 + k / 10**4, 4) for k in range(10**4)] + [1.99995],
    ),
    (dict(ratio_lower_step=0.07), SEVENTHS, None),
    (dict(ratio_lower_step=0.07, search_order="lower_first"), SEVENTHS + [0.9], None),  # capped
    # 9,999 steps of 1e-4 and lower_first's cap at 1.99985: 10,000 candidates, the most allowed
    (dict(FINE, ratio_upper_max=1.99985, search_order="lower_first"), None, FINE_CAPPED),
]


@pytest.mark.parametrize("kwargs, lower, upper", BOUNDARY_ARGUMENTS)
def test_boundary_arguments_build_their_grids(kwargs, lower, upper):
    """Each accepted edge builds the grid it names; None stands for the paper's grid."""
    fn = BAPOPolicyLossFn(**kwargs)
    assert fn.lower == (PAPER_LOWER if lower is None else lower)
    assert fn.upper == (PAPER_UPPER if upper is None else upper)


@pytest.mark.parametrize("order", ORDERS)
def test_metrics_are_flat_documented_python_numbers(order):
    logprob, old, mask, adv = batch((4, 24), spread=0.3)
    _, m = call(BAPOPolicyLossFn(search_order=order), logprob, old, mask, adv)
    assert set(m) == inputs.METRIC_KEYS
    for key, value in m.items():
        assert type(value) in (float, int), (key, type(value))
    assert type(m["bapo_search_steps"]) is int
    assert m["bapo_target_met"] in (0.0, 1.0)


class Untouchable:
    """A stand-in group that fails on any use: the loss must not look at it."""

    def __getattr__(self, name):
        """Refuse every attribute."""
        raise AssertionError(f"the dp_group was used: {name}")


@pytest.mark.parametrize("order", ORDERS)
def test_a_group_without_an_initialised_process_group_keeps_the_search_local(order):
    """torch.distributed is not initialised here: a dp_group passed changes nothing."""
    assert not torch.distributed.is_initialized()
    logprob, old, mask, adv = batch((4, 24), seed=5, spread=0.3)
    data = (logprob, old, mask, adv - 0.5)  # mostly negative: the search has to move
    alone = call(BAPOPolicyLossFn(search_order=order), *data)
    grouped = call(BAPOPolicyLossFn(search_order=order), *data, dp_group=Untouchable())
    assert chosen(alone[1])[2] > 0  # the search moved
    assert grouped[1] == alone[1] and torch.equal(grouped[0], alone[0])


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for one test."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("loss_agg_mode", AGG_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_mode_runs_as_ppo_does_and_repeats_itself(
    deterministic, loss_agg_mode, dtype
):
    """Forward and backward under deterministic algorithms; two runs give the same pair and loss."""
    logprob, old, mask, adv = batch((6, 32), seed=6, spread=0.4, dtype=dtype)
    data = (logprob, old, mask, adv - 0.5)  # mostly negative: the search has to move
    ppo = PPOPolicyLossFn(clip_range_low=0.2, clip_range_high=0.2, loss_agg_mode=loss_agg_mode)
    forward_backward(ppo, *data)  # PPO runs here, so BAPO must too
    for order in ORDERS:
        bapo = BAPOPolicyLossFn(search_order=order, loss_agg_mode=loss_agg_mode)
        (loss, grad, m), (again, grad_again, m_again) = (
            forward_backward(bapo, *data) for _ in range(2)
        )
        assert m["bapo_search_steps"] > 0 and m == m_again
        assert torch.equal(loss, again) and torch.equal(grad, grad_again)


# Configurations that construct, with points far from 1 and grids with tiny gaps. A search
# that sizes anything by (span of the grid) / (smallest gap) asks for gigabytes here.
FAR_AND_TINY = [
    dict(search_order="lower_first", ratio_lower_step=0.0333333333),  # capped last gap ~1e-10
    dict(search_order="lower_first", ratio_upper_step=0.0499999999999),
    dict(ratio_upper_start=1e8, ratio_upper_max=1e8),  # "no upper clip"
    dict(ratio_lower_start=1e-9, ratio_lower_max=1e-9, search_order="lower_first"),
    dict(ratio_lower_start=1e-37, ratio_lower_max=1e-37, search_order="lower_first"),
    dict(ratio_lower_start=1e-30, ratio_lower_max=0.9, ratio_lower_step=0.3),
    dict(ratio_upper_start=1.0, ratio_upper_max=4e8, ratio_upper_step=1e7),
    dict(ratio_lower_start=0.5, ratio_lower_max=0.5 + 1e-12, ratio_lower_step=1e-13),
]

_MEMORY_PROBE = textwrap.dedent("""
    import json, resource, sys
    from tests.inputs import batch
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    def data_bytes():
        with open("/proc/self/status") as status:
            line = next(l for l in status if l.startswith("VmData:"))
        return int(line.split()[1]) * 1024

    # A runaway allocation fails here instead of taking the machine down.
    limit = data_bytes() + (1 << 30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    logprob, old, mask, adv = batch((64, 1024), seed=0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for kwargs in json.loads(sys.argv[1]):
        BAPOPolicyLossFn(**kwargs)(
            logprob=logprob, old_logprob=old, action_mask=mask, advantages=adv
        )
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
    low, high, _ = chosen(m)
    ppo = PPOPolicyLossFn(clip_range_low=1 - low, clip_range_high=high - 1, clip_ratio_c=3.0)
    ppo_loss, _ = call(ppo, logprob, old, mask, adv)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(ppo_loss.item(), rel=1e-6)


@pytest.mark.parametrize("field", ["logprob", "old_logprob", "advantages"])
@pytest.mark.parametrize("order", ORDERS)
def test_a_nan_live_token_keeps_the_start_pair(order, field):
    """A NaN makes rho NaN, which fails ``rho < rho0``: the walk stays at the start pair."""
    logprob, old, mask, adv = batch((4, 24), spread=0.01)
    adv = -adv.abs() - 0.1  # all negative: finite, this batch would search to (0.9, 3.0)
    clean = call(BAPOPolicyLossFn(search_order=order), logprob, old, mask, adv)[1]
    assert chosen(clean) == (*inputs.PAPER_MAX, inputs.PAPER_STEPS)
    tensors = {"logprob": logprob, "old_logprob": old, "advantages": adv}
    tensors[field] = tensors[field].clone()
    tensors[field][1, 2] = math.nan
    _, m = BAPOPolicyLossFn(search_order=order)(action_mask=mask, **tensors)
    assert chosen(m) == (*PAPER_START, 0) and math.isnan(m["bapo_positive_contribution"])


@pytest.mark.parametrize("order", ORDERS)
def test_an_infinite_log_ratio_is_clamped_as_ppo_clamps_it(order):
    """+-inf log-probs give ratios exp(+-20): the search runs on them as the oracle does."""
    logprob, old, mask, adv = batch((4, 24), seed=2, spread=0.3)
    logprob[0, 0], old[1, 1] = math.inf, math.inf  # r = e^20 and r = e^-20
    kwargs = loss_kwargs("paper_upper" if order == "upper_first" else "paper_lower")
    _, m = call(BAPOPolicyLossFn(**kwargs), logprob, old, mask, adv)
    assert chosen(m) == oracle.search(oracle.token_lists(logprob, old, mask, adv), kwargs)
    assert math.isfinite(m["bapo_positive_contribution"]) and math.isfinite(m["pg_loss"])


@pytest.mark.parametrize(
    "fields",
    [("logprob",), ("old_logprob",), ("advantages",), ("logprob", "old_logprob", "advantages")],
    ids=["logprob", "old_logprob", "advantages", "all"],
)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    "order, loss_agg_mode",
    [
        ("upper_first", "token-mean"),
        ("lower_first", "token-mean"),
        ("upper_first", "seq-mean-token-mean"),
    ],
)
def test_masked_nonfinite_values_touch_neither_loss_nor_gradient(fields, bad, order, loss_agg_mode):
    """Target 1 is never met: the search must still run to the end of the grid."""
    logprob, old, _, adv = batch((4, 16), seed=3)
    mask = (mask_values("mixed", adv.shape, seed=3) > 0).float()
    fn = BAPOPolicyLossFn(
        positive_contribution_target=1.0, search_order=order, loss_agg_mode=loss_agg_mode
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
    assert m == clean_m
    assert chosen(m) == (*inputs.PAPER_MAX, inputs.PAPER_STEPS)


# Three micro-batches of one update, of their own shapes, lengths and log-ratio spreads
UPDATE_BATCHES = [
    batch((2, 7), seed=4, spread=0.6, lengths=[7, 4]),
    batch((3, 5), seed=5, spread=0.2),
    batch((1, 9), seed=6, spread=0.9, lengths=[6]),
]


def as_data(logprob, old, mask, adv) -> dict:
    """One micro-batch as the oracle takes it: lists under the names ``tokens_of`` reads."""
    tensors = dict(logprob=logprob, old_logprob=old, mask=mask, advantages=adv)
    return {key: value.tolist() for key, value in tensors.items()}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("target", [0.4, 0.55])
def test_update_scope_calls_take_the_oracle_pair_on_the_whole_update(order, target):
    """The pass's sums over three micro-batches: every call of the update at the union's pair.

    The update's pair, rho and each call's loss against the literal oracle on the concatenated
    tokens; released after the update, a call without a pass raises.
    """
    kwargs = loss_kwargs("paper_upper", search_order=order, positive_contribution_target=target)
    fn = BAPOPolicyLossFn(**dict(kwargs, search_scope="update"))
    datas = [as_data(*b) for b in UPDATE_BATCHES]
    union = oracle.union_tokens(datas)
    want = oracle.search(union, kwargs)
    seen = []
    with fn.optimizer_update(None, lambda: seen.extend(call(fn, *b) for b in UPDATE_BATCHES)):
        assert seen == [(0.0, {})] * len(UPDATE_BATCHES)
        per_call = [oracle.search(oracle.tokens_of(d), kwargs) for d in datas]
        assert any(pair != want for pair in per_call), "each micro-batch alone agrees: no test"
        for b, data in zip(UPDATE_BATCHES, datas):
            loss, metrics = call(fn, *b)
            assert chosen(metrics) == want
            rho = oracle.rho(union, *want[:2])
            assert metrics["bapo_positive_contribution"] == pytest.approx(rho)
            want_loss = oracle.token_mean(data, kwargs, *want[:2])
            assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    with pytest.raises(RuntimeError, match="search_scope: update"):
        call(fn, *UPDATE_BATCHES[0])


def test_update_scope_without_a_pass_raises_rather_than_deciding_per_call():
    with pytest.raises(RuntimeError, match="needs the trainer's pass"):
        call(BAPOPolicyLossFn(search_scope="update"), *UPDATE_BATCHES[0])


def test_update_scope_a_pass_that_sees_no_micro_batch_raises():
    """An engine that calls the loss on no micro-batch (a pipeline stage but the last) raises."""
    with pytest.raises(RuntimeError, match="saw no micro-batch"):
        with BAPOPolicyLossFn(search_scope="update").optimizer_update(None, lambda: None):
            pytest.fail("the update ran without a pair")


def test_micro_batch_scope_runs_no_pass():
    """Deciding per call, the loss leaves the pass it is handed uncalled."""
    entered = []
    with BAPOPolicyLossFn().optimizer_update(None, lambda: pytest.fail("a pass ran")):
        entered.append(True)
    assert entered == [True]
