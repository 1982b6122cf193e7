"""The test oracle: BAPO's search written out literally (Algorithm 1, Eq. 8), and its union use.

Deliberately naive and independent of the code under test: rho is recomputed from the tokens
for every candidate pair (plain Python over token lists), bounds move by exact rational steps,
and the two loops are written as the paper's Algorithm 1 and the authors' code state them. Run on
the concatenated tokens of several ranks, it says what one process would decide on their union.
"""

import math
from fractions import Fraction
from typing import Callable

import torch

from tests.inputs import RANGE_ARGS, chosen, loss_kwargs
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import LOG_RATIO_CLAMP


def token_lists(logprob, old_logprob, mask, advantages) -> list:
    """(ratio, advantage) of every live token, the ratio with PPO's clamp of the log-ratio."""
    out = []
    flat = (t.reshape(-1).tolist() for t in (logprob, old_logprob, mask, advantages))
    for lp, old, m, a in zip(*flat):
        if m:
            out.append((math.exp(min(max(lp - old, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)), a))
    return out


def rho(tokens, c_low: float, c_high: float) -> float:
    """Eq. 8's positive share P / (P + N) at one pair, straight from the definition."""
    pos = neg = 0.0
    for r, a in tokens:
        if a > 0:
            pos += a * min(r, c_high)
        elif a < 0:
            neg += -a * max(r, c_low)
    return 1.0 if pos + neg == 0 else pos / (pos + neg)


def _exact(*values):
    # The decimal values as written in a config (0.02, not its binary neighbour).
    return [Fraction(repr(float(x))) for x in values]


def algorithm1(tokens, a_lo, b_lo, d_lo, a_hi, b_hi, d_hi, rho0, bound=float):
    """Paper Algorithm 1 (upper first). Returns (c_low, c_high, steps).

    ``bound`` turns a candidate into the number the ratios are compared with.
    """
    c_low, b_lo, d_lo, c_high, b_hi, d_hi = _exact(a_lo, b_lo, d_lo, a_hi, b_hi, d_hi)
    steps = 0
    while rho(tokens, bound(c_low), bound(c_high)) < rho0 and c_low + d_lo <= b_lo:
        if c_high + d_hi <= b_hi:
            c_high += d_hi
        else:
            c_low += d_lo
        steps += 1
    return float(c_low), float(c_high), steps


def authors_order(tokens, a_lo, b_lo, d_lo, a_hi, b_hi, d_hi, rho0, bound=float):
    """The authors' code: raise c_low (capped at b-) first, then c_high (capped at b+)."""
    c_low, b_lo, d_lo, c_high, b_hi, d_hi = _exact(a_lo, b_lo, d_lo, a_hi, b_hi, d_hi)
    steps = 0
    while rho(tokens, bound(c_low), bound(c_high)) < rho0 and c_low < b_lo:
        c_low = min(c_low + d_lo, b_lo)
        steps += 1
    while rho(tokens, bound(c_low), bound(c_high)) < rho0 and c_high < b_hi:
        c_high = min(c_high + d_hi, b_hi)
        steps += 1
    return float(c_low), float(c_high), steps


def search(tokens, kwargs: dict, bound=float):
    """(c_low, c_high, steps) of the loop that ``kwargs``'s ``search_order`` names."""
    upper_first = kwargs["search_order"] == "upper_first"
    loop: Callable[..., tuple] = algorithm1 if upper_first else authors_order
    grid = [kwargs[name] for name in RANGE_ARGS]
    return loop(tokens, *grid, kwargs["positive_contribution_target"], bound)


def token_loss(ratio, adv, c_low, c_high, clip_ratio_c):
    """The README's per-token loss: -min(r A, clip(r) A), then PPO's dual clip where A < 0."""
    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, c_low, c_high) * adv)
    return torch.where(adv < 0, torch.minimum(loss, -adv * clip_ratio_c), loss)


def tokens_of(data) -> list:
    """The tokens of one rank's case, given as lists (``logprob``, ..., ``mask``)."""
    fields = ("logprob", "old_logprob", "mask", "advantages")
    return token_lists(*(torch.tensor(data[key]) for key in fields))


def union_tokens(datas) -> list:
    """Concatenated token lists of several ranks: what one process would see."""
    return [token for data in datas for token in tokens_of(data)]


def token_mean(data, kwargs, low, high) -> float:
    """Token-mean loss of one rank's case at a given pair (float64, from the lists)."""
    lp, old, adv = (
        torch.tensor(data[k]).double() for k in ("logprob", "old_logprob", "advantages")
    )
    ratio = torch.exp(torch.clamp(lp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    losses = token_loss(ratio, adv, low, high, kwargs["clip_ratio_c"])
    return float(losses[torch.tensor(data["mask"]).bool()].mean())


def compare_to_union(results, datas, name, **extra) -> list:
    """Every rank's choice, rho and loss against the oracle on the union (empty: all agree).

    ``extra``: arguments changed from config ``name``'s.
    """
    kwargs, union = loss_kwargs(name, **extra), union_tokens(datas)
    want = search(union, kwargs)
    want_rho = rho(union, *want[:2])
    problems = []
    for rank, (metrics, data) in enumerate(zip(results, datas)):
        where = f"{name} rank {rank}"
        if chosen(metrics) != want:
            problems.append(f"{where}: {chosen(metrics)} != union oracle {want}")
        got_rho = metrics["bapo_positive_contribution"]
        if not math.isclose(got_rho, want_rho, rel_tol=1e-5, abs_tol=1e-9):
            problems.append(f"{where}: rho {got_rho} != the union's {want_rho}")
        if any(map(any, data["mask"])):  # the loss used the union's pair on local tokens
            loss, want_loss = metrics["pg_loss"], token_mean(data, kwargs, *want[:2])
            if not math.isclose(loss, want_loss, rel_tol=1e-4, abs_tol=1e-6):
                problems.append(f"{where}: pg_loss {loss} != {want_loss} at the union pair")
    return problems


def locals_differ(datas, name) -> bool:
    """Whether some rank alone would choose another pair than the union (the data can tell)."""
    kwargs = loss_kwargs(name)
    union = search(union_tokens(datas), kwargs)[:2]
    return any(search(tokens_of(data), kwargs)[:2] != union for data in datas)


def pairs_by_call(calls_by_rank) -> list:
    """For each loss call, the (c_low, c_high) each rank chose; every rank made as many calls."""
    assert len({len(calls) for calls in calls_by_rank}) == 1, "ranks made different call counts"
    return [[chosen(c["metrics"])[:2] for c in calls] for calls in zip(*calls_by_rank)]


def tokens_in(dtype, data) -> list:
    """(ratio, advantage) of every live token, the ratio computed in ``dtype`` as a loss does.

    So float16's ``exp`` overflows to inf past a log-ratio of 11.09, where ``token_lists``
    computes in double precision.
    """
    lp, old, adv = (
        torch.as_tensor(data[k], dtype=dtype) for k in ("logprob", "old_logprob", "advantages")
    )
    ratio = torch.exp(torch.clamp(lp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    flat = (t.reshape(-1).tolist() for t in (ratio, adv, torch.as_tensor(data["mask"])))
    return [(r, a) for r, a, m in zip(*flat) if m]


def rounded_to(dtype) -> Callable[[float], float]:
    """A bound as ``torch.clamp`` meets a ratio of ``dtype``: rounded, capped at its largest."""
    top = torch.finfo(dtype).max
    return lambda bound: torch.tensor(min(float(bound), top), dtype=dtype).item()
