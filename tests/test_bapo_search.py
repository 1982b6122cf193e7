"""BAPO's bound search against independent oracles (single process).

Random cases must choose the same pair, steps and rho as the literal transcription in
``tests/oracle.py`` (Algorithm 1, or the authors' loops for ``lower_first``); the paper grid
reaches its exact ends; bounds meet 16-bit ratios as ``torch.clamp`` compares them.
"""

import math
import random
from collections import Counter
from fractions import Fraction

import pytest
import torch

from tests import oracle
from tests.inputs import (
    BATCH_KEYS,
    DTYPES,
    ORDERS,
    OVERFLOWS,
    PAPER_STEPS,
    RANGE_ARGS,
    batch,
    call,
    chosen,
    loss_kwargs,
    overflow_case,
    point,
)
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn, below, candidates

LOWER_STEPS = (0.01, 0.02, 0.025, 0.03, 0.04, 0.05, 0.07, 0.1, 0.15, 0.2)
UPPER_STEPS = (0.03, 0.05, 0.07, 0.1, 0.2, 0.25, 0.3, 0.5)
CASES_PER_ORDER = 100


def _random_tokens(rng: random.Random, gen: torch.Generator):
    """A float64 batch whose ratios spread over the candidate ranges.

    A few tokens have a log-ratio of exactly 0 (ratio exactly 1.0, which can sit on a
    candidate) and a few are beyond the +-20 clamp, so boundary and clamp handling are
    exercised against the oracle too.
    """
    n_seq, seq_len = rng.randint(2, 6), rng.randint(25, 50)
    shape = (n_seq, seq_len)
    old = -torch.rand(shape, generator=gen, dtype=torch.float64) * 5 - 0.01
    sigma, mu = rng.uniform(0.1, 1.0), rng.uniform(-0.3, 0.3)
    log_ratio = mu + sigma * torch.randn(shape, generator=gen, dtype=torch.float64)
    pick = torch.rand(shape, generator=gen)
    log_ratio = torch.where(pick < 0.03, torch.zeros_like(log_ratio), log_ratio)
    extreme = 25.0 * torch.sign(torch.randn(shape, generator=gen, dtype=torch.float64))
    log_ratio = torch.where(pick > 0.99, extreme, log_ratio)
    logprob = old + log_ratio
    logprob = torch.where(log_ratio == 0, old, logprob)  # exactly equal -> ratio exactly 1

    pos_frac = rng.choice([0.0, 1.0] + [rng.uniform(0.1, 0.9)] * 8)
    sign = torch.where(torch.rand(shape, generator=gen) < pos_frac, 1.0, -1.0).double()
    magnitude = torch.exp(0.5 * torch.randn(shape, generator=gen, dtype=torch.float64))
    advantages = sign * magnitude
    advantages[torch.rand(shape, generator=gen) < 0.05] = 0.0

    lengths = torch.randint(0, seq_len + 1, (n_seq,), generator=gen)
    lengths[0] = max(int(lengths[0]), 5)  # at least a few live tokens
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).float()
    return logprob, old, mask, advantages


def _random_range(rng, start, span, cap, steps):
    """(start, max, step) with two-decimal bounds, so that repr() gives the written value.

    Some ranges are points; steps come from a list, so some divide the span and some do not.
    """
    if rng.random() < 0.15:
        return start, start, rng.choice(steps)
    return start, round(rng.uniform(start, min(start + span, cap)), 2), rng.choice(steps)


def _exact(*values):
    return [Fraction(repr(value)) for value in values]


def _divides(start, maximum, step) -> bool:
    start, maximum, step = _exact(start, maximum, step)
    return (maximum - start) % step == 0


def _room(start, maximum, step) -> bool:
    """Whether one whole step fits in the range (Algorithm 1's loop condition)."""
    start, maximum, step = _exact(start, maximum, step)
    return start + step <= maximum


def _draw_target(rng, corners):
    """A target in [0, 1] around the corner shares, never a float hair away from one of them.

    A target equal to a share is a tie that summation order alone decides (the oracle adds
    token by token, the code by prefix sums), so such draws are redrawn.
    """
    while True:
        if rng.random() < 0.5:
            target = rng.uniform(min(corners) - 0.05, max(corners) + 0.05)
        else:  # above the start: the search has to move
            target = rng.uniform(corners[0], max(corners))
        target = min(1.0, max(0.0, target))
        if all(abs(target - c) > 1e-9 for c in corners) or target in (0.0, 1.0):
            return target


def _run_case(rng, gen, order):
    """One random case: (what the code chose, what the oracle chose, the case) as dicts."""
    logprob, old, mask, adv = _random_tokens(rng, gen)
    lo = _random_range(rng, round(rng.uniform(0.2, 1.0), 2), 0.8, 1.0, LOWER_STEPS)
    a_hi = 1.0 if rng.random() < 0.25 else round(rng.uniform(1.0, 2.0), 2)
    hi = _random_range(rng, a_hi, 2.0, math.inf, UPPER_STEPS)
    if order == "upper_first" and not _room(*lo) and _room(*hi):
        with pytest.raises(ValueError, match="room"):  # Algorithm 1 would stay put
            BAPOPolicyLossFn(**dict(zip(RANGE_ARGS, lo + hi)), search_order=order)
        hi = (hi[0], hi[0], hi[2])  # both points: fixed clipping, which Algorithm 1 accepts
    tokens = oracle.token_lists(logprob, old, mask, adv)
    # rho is monotone in each bound, so the corners span its range over the box. Targets drawn
    # over (and a little past) that span give every outcome: met at once, mid-path, never met.
    corners = [oracle.rho(tokens, c_lo, c_hi) for c_lo in lo[:2] for c_hi in hi[:2]]
    kwargs = dict(zip(RANGE_ARGS, lo + hi), positive_contribution_target=_draw_target(rng, corners))
    kwargs["search_order"] = order
    low, high, steps = oracle.search(tokens, kwargs)
    rho = oracle.rho(tokens, low, high)
    met = rho >= kwargs["positive_contribution_target"]
    expected = dict(clip_low=low, clip_high=high, steps=steps, rho=rho, met=met)
    _, m = call(BAPOPolicyLossFn(**kwargs), logprob, old, mask, adv)
    keys = ("clip_low", "clip_high", "search_steps", "positive_contribution", "target_met")
    got = dict(zip(expected, (m[f"bapo_{key}"] for key in keys)))
    on_edge = any(r in (lo[0], lo[1], hi[0], hi[1]) for r, a in tokens if a != 0)
    return got, expected, dict(kwargs, lower=lo, upper=hi, on_a_bound=on_edge)


def _tally(outcomes: Counter, shapes: Counter, expected, info) -> None:
    """Count what kind of case this was, so the test can show that every kind occurred."""
    moved_low = expected["clip_low"] > info["lower"][0]
    if expected["met"]:
        outcomes["met_at_start" if expected["steps"] == 0 else "met_mid_path"] += 1
    else:
        outcomes["never_met"] += 1
    outcomes["c_low_moved"] += moved_low
    outcomes["c_high_moved"] += expected["clip_high"] > info["upper"][0]
    outcomes["met_after_c_low_moved"] += expected["met"] and moved_low
    shapes["ratio_on_a_bound"] += info["on_a_bound"]  # r == 1.0 == a bound: a tie
    for name, (start, maximum, step) in (("lower", info["lower"]), ("upper", info["upper"])):
        if start == maximum:
            shapes[f"{name}_point"] += 1
        else:
            shapes[f"{name}_divides" if _divides(start, maximum, step) else f"{name}_odd"] += 1


@pytest.mark.parametrize("order", ORDERS)
def test_search_matches_literal_transcription(order):
    seed = {"upper_first": 100, "lower_first": 200}[order]
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    outcomes, shapes = Counter(), Counter()
    for case in range(CASES_PER_ORDER):
        got, expected, info = _run_case(rng, gen, order)
        assert got["rho"] == pytest.approx(expected["rho"], rel=1e-12, abs=1e-15), info
        assert {**got, "rho": 0} == {**expected, "rho": 0}, f"case {case}: {info}"
        _tally(outcomes, shapes, expected, info)
    # Not vacuous: every kind of outcome and of range occurred.
    for kind in ("met_at_start", "met_mid_path", "never_met", "c_low_moved", "c_high_moved"):
        assert outcomes[kind] >= 3, outcomes
    for kind in ("point", "divides", "odd"):
        assert shapes[f"lower_{kind}"] >= 2 and shapes[f"upper_{kind}"] >= 2, shapes
    assert shapes["ratio_on_a_bound"] >= 3, shapes
    if order == "upper_first":  # Eq. 8: raising c_low lowers rho, so that phase never helps
        assert outcomes["met_after_c_low_moved"] == 0, outcomes


@pytest.mark.parametrize(
    "name, start, maximum, step, length",
    [("ratio_lower", 0.6, 0.9, 0.02, 16), ("ratio_upper", 1.2, 3.0, 0.05, 37)],
)
def test_the_paper_grids_land_on_the_written_values(name, start, maximum, step, length):
    """0.6 + 15 x 0.02 is 0.9 and 1.2 + 36 x 0.05 is 3.0, as written, not their float sums."""
    naive = start
    while naive + step <= maximum:
        naive += step
    assert naive != maximum  # the float trap: a naive loop stops short of, or just under, it
    want = [float(Fraction(repr(start)) + k * Fraction(repr(step))) for k in range(length)]
    for cap in (False, True):  # the maximum is on the grid: the cap adds nothing
        assert candidates(name, start, maximum, step, 0.0, 10.0, cap) == want
    assert want[-1] == maximum and len(want) == length
    fn = BAPOPolicyLossFn()
    assert (fn.lower if name == "ratio_lower" else fn.upper) == want


def test_a_16_bit_ratio_meets_the_bounds_as_torch_clamp_rounds_them():
    """bfloat16 holds 1.2 as 1.203125: a ratio of exactly that is on the bound, not above it.

    The target lies between rho with the rounded bound and rho with 1.2 itself, so a search
    comparing against unrounded bounds would raise c_high where the loss clips nothing.
    """
    bf16 = torch.bfloat16
    ratio = torch.tensor([1.2, 1.0], dtype=bf16)
    assert ratio[0].item() == 1.203125
    logprob, old = ratio.log(), torch.zeros(2, dtype=bf16)
    adv, mask = torch.tensor([1.0, -1.0], dtype=bf16), torch.ones(2)
    tokens = list(zip(torch.exp(logprob - old).tolist(), adv.tolist()))  # as the loss sees them
    assert tokens[0] == (1.203125, 1.0)
    rounded = lambda bound: torch.tensor(float(bound), dtype=bf16).item()  # noqa: E731
    rho_rounded, rho_written = oracle.rho(tokens, rounded(0.6), rounded(1.2)), oracle.rho(
        tokens, 0.6, 1.2
    )
    target = (rho_rounded + rho_written) / 2
    assert rho_written < target < rho_rounded
    kwargs = dict(BAPOPolicyLossFn.default_args(), positive_contribution_target=target)
    want = oracle.search(tokens, kwargs, bound=rounded)
    _, m = call(BAPOPolicyLossFn(**kwargs), logprob, old, mask, adv)
    assert want == (0.6, 1.2, 0) != oracle.search(tokens, kwargs)
    assert (m["bapo_clip_low"], m["bapo_clip_high"], m["bapo_search_steps"]) == want
    assert m["bapo_positive_contribution"] == pytest.approx(rho_rounded, rel=1e-6)


def _ratios_on_and_beside(bounds: list, dtype: torch.dtype) -> tuple:
    """Log-probs (and zero old ones) of ratios on and beside each bound, in ``dtype``.

    The log of each bound and its neighbours in ``dtype``: ``exp`` takes some onto the bound as
    ``dtype`` rounds it, and others one representable step below or above it.
    """
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)  # positive floats order as ints
    logs = torch.tensor(bounds, dtype=torch.float64).log().to(dtype)
    logprob = torch.cat([(logs.view(bits) + k).view(dtype) for k in range(-4, 5)])
    return logprob, torch.zeros_like(logprob)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("grid", ["paper", "capped"])
def test_eq8_at_every_bound_is_the_sum_over_the_tokens_on_and_beside_the_bounds(dtype, grid):
    """P and N at every candidate, as ``_prepare`` buckets them, are Eq. 8 over the tokens.

    Each bound is rounded as ``torch.clamp`` rounds it. Ratios on a bound, and one step of their
    dtype beside it, are where a count of the bounds below r would be off by one. ``capped``:
    lower_first grids that end at a maximum off their step.
    """
    kwargs = {} if grid == "paper" else dict(search_order="lower_first", ratio_lower_step=0.07)
    fn = BAPOPolicyLossFn(**kwargs, ratio_upper_step=0.05 if grid == "paper" else 0.25)
    assert grid == "paper" or (fn.lower[-1] - fn.lower[-2] < 0.07 and fn.upper[-1] == 3.0)
    bound = oracle.rounded_to(DTYPES[dtype])
    logprob, old = _ratios_on_and_beside(fn.lower + fn.upper, DTYPES[dtype])
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(logprob.shape, generator=gen).to(DTYPES[dtype])
    adv[::7] = 0.0
    mask = torch.ones_like(adv)
    tokens = oracle.tokens_in(
        DTYPES[dtype], dict(logprob=logprob, old_logprob=old, advantages=adv, mask=mask)
    )
    on_a_bound = {bound(c) for c in fn.lower + fn.upper} & {r for r, a in tokens if a != 0}
    assert len(on_a_bound) >= len(fn.lower + fn.upper) / 2  # the ties are there
    positive = [sum(a * min(r, bound(c)) for r, a in tokens if a > 0) for c in fn.upper]
    negative = [sum(-a * max(r, bound(c)) for r, a in tokens if a < 0) for c in fn.lower]
    sums = fn._prepare(logprob, old, mask, adv)[-1].tolist()
    assert sums == pytest.approx(positive + negative, rel=1e-12)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "advantages, target, rho_below",
    [("all_negative", 0.4, 0.0), ("one_small_positive", 0.4, 0.4), ("mixed_signs", 1.0, 1.0)],
)
def test_paper_grid_reaches_exact_maxima_in_51_steps(order, advantages, target, rho_below):
    """All advantages negative (rho 0), all but one small one, or target 1 with mixed signs."""
    logprob, old, mask, adv = batch((4, 32), seed=7, spread=0.01)
    assert ((logprob - old).exp() - 1).abs().max() < 0.05
    if advantages != "mixed_signs":
        adv = -adv.abs() - 0.1
    if advantages == "one_small_positive":
        adv[0, 0] = 0.01
    fn = BAPOPolicyLossFn(positive_contribution_target=target, search_order=order)
    _, m = call(fn, logprob, old, mask, adv)
    assert m["bapo_clip_low"] == 0.9  # exactly, not 0.88 or 0.8999...
    assert m["bapo_clip_high"] == 3.0
    assert m["bapo_search_steps"] == PAPER_STEPS == 51
    assert m["bapo_target_met"] == 0.0
    rho = m["bapo_positive_contribution"]
    assert (rho == 0.0) if rho_below == 0.0 else (0.0 < rho < rho_below)


def test_half_precision_ratio_that_underflows_stays_on_its_side():
    """Keep a ratio that underflows in float16 on its own side.

    In float16, exp(-18) underflows to 0, which the signed axis could file with the other
    sign's tokens. The token must still count in N at c_low.
    """
    logprob = torch.tensor([[-1.0, -19.0, -1.2]])
    old = torch.full_like(logprob, -1.0)
    adv = torch.tensor([[1.0, -1.0, -0.2]])
    mask = torch.ones_like(logprob, dtype=torch.bool)
    want = oracle.rho(
        oracle.token_lists(logprob.double(), old.double(), mask, adv.double()), 0.6, 1.2
    )
    half = [t.half() for t in (logprob, old, adv)]
    assert torch.exp(half[0] - half[1])[0, 1] == 0  # the case really underflows
    _, metrics = call(BAPOPolicyLossFn(**point(0.6, 1.2)), half[0], half[1], mask, half[2])
    assert metrics["bapo_positive_contribution"] == pytest.approx(want, rel=1e-3)


def test_float16_overflow_on_a_positive_token_follows_eq8():
    """A log-ratio of 12 overflows float16: P = min(inf, c_high) = c_high, N = 3 max(1, c_low).

    rho = c_high / (c_high + 3) first reaches 0.4 at c_high = 2.0, after 16 raises of 0.05;
    a NaN from 0 * inf would keep the start pair instead.
    """
    logprob = torch.tensor([[12.0, 0.0, 0.0, 0.0]], dtype=torch.float16)
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0]], dtype=torch.float16)
    assert torch.isinf(logprob.exp()[0, 0])
    _, m = call(BAPOPolicyLossFn(), logprob, torch.zeros_like(logprob), torch.ones(1, 4), adv)
    assert chosen(m) == (0.6, 2.0, 16) and m["bapo_positive_contribution"] == 0.4


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", OVERFLOWS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_overflowing_ratios_of_each_sign_follow_eq8_in_every_dtype(dtype, kind, order):
    """Ratios of e^12 and e^20 (inf in float16) on tokens with A > 0, A = 0 and A < 0.

    The pair and rho equal the literal Algorithm 1 on the tokens as the loss sees them, in the
    dtype, with bounds rounded as torch.clamp rounds them.
    """
    data = overflow_case(kind, 0, dtype)
    kwargs = loss_kwargs("paper_upper" if order == "upper_first" else "paper_lower")
    tokens, bound = oracle.tokens_in(DTYPES[dtype], data), oracle.rounded_to(DTYPES[dtype])
    assert (dtype == "float16") == any(math.isinf(r) for r, _ in tokens)
    want = oracle.search(tokens, kwargs, bound=bound)
    _, m = call(BAPOPolicyLossFn(**kwargs), *(data[k] for k in BATCH_KEYS))
    assert chosen(m) == want and want != (0.6, 1.2, 0)
    rho = oracle.rho(tokens, *map(bound, want[:2]))
    assert m["bapo_positive_contribution"] == pytest.approx(rho, rel=1e-9, abs=0)


def _grids() -> list:
    """(grid, capped): the paper's, the authors', uneven, fine and random ones; capped too."""
    rng, found = random.Random(7), []
    settings = [(0.6, 0.9, 0.02), (1.2, 3.0, 0.05), (0.6, 0.8, 0.05), (0.4, 0.8, 0.07)]
    settings += [(1.2, 2.0, 0.25), (1.0, 2.0, 1e-4), (0.8, 0.8, 0.1)]
    for _ in range(40):
        start = round(rng.uniform(0.0, 0.9), rng.randint(1, 4))
        settings.append((start, round(rng.uniform(start, 1.0), 3), rng.choice(LOWER_STEPS)))
        start = round(rng.uniform(1.0, 5.0), rng.randint(1, 4))
        settings.append((start, round(rng.uniform(start, 9.0), 3), rng.choice(UPPER_STEPS)))
    for start, maximum, step in settings:
        high = 1.0 if maximum <= 1.0 else math.exp(20)
        for capped in (False, True):
            grid = candidates("r", start, maximum, step, 0.0 if high == 1.0 else 1.0, high, capped)
            found.append((grid, capped))
    return found


def test_below_counts_the_bounds_under_every_float32_ratio_as_searchsorted_does():
    """At each bound's float32 neighbours and a spread of others; ties (r on a bound) either way.

    Float64 ratios may miss by one, and only within a few of float64's steps of a bound.
    """
    for grid, capped in _grids():
        bounds = torch.tensor(grid, dtype=torch.float64)
        f32 = bounds.float()
        spread = torch.linspace(grid[0] - 1, grid[-1] + 1, 2001, dtype=torch.float32)
        near = [f32.nextafter(f32 - math.inf), f32, f32.nextafter(f32 + math.inf), spread]
        r = torch.cat(near).double()
        low, high = (torch.searchsorted(bounds, r, right=side) for side in (False, True))
        count = below(r, grid, capped).long()
        assert ((low <= count) & (count <= high)).all(), (grid[:3], capped)
        r64 = torch.cat([bounds.nextafter(bounds + s * math.inf) for s in (-1, 1)] + [r])
        off = below(r64, grid, capped).long() - torch.searchsorted(bounds, r64)
        missed = r64[off != 0, None]  # each within 4 of float64's steps of some bound
        assert (off.abs() <= 1).all(), grid[:3]
        step = 4 * bounds * torch.finfo(bounds.dtype).eps
        assert ((missed - bounds).abs() <= step).any(1).all(), grid[:3]
