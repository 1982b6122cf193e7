"""Test oracle: a literal, loop-by-loop transcription of BAPO's search (Algorithm 1, Eq. 8).

Deliberately naive and independent of the code under test: rho is recomputed from the tokens
for every candidate pair (plain Python over token lists), bounds move by exact rational steps,
and the two loops are written as the paper's Algorithm 1 and the authors' code state them.
"""

import math
from fractions import Fraction
from typing import List, Optional, Sequence, Tuple


def _exact(x: float) -> Fraction:
    # The decimal value as written in a config (0.02, not its binary neighbour).
    return Fraction(repr(float(x)))


def token_lists(logprob, old_logprob, mask, advantages, scale=1.0) -> List[Tuple]:
    """(ratio, advantage, inside, weight) of every unmasked token, ratio with the +-20 clamp.

    ``inside`` says the log-ratio lies within the clamp, where the loss still depends on logp.
    ``weight`` is the token's mask value times ``scale``, its factor in the aggregated loss
    under ``gradient`` (1 / its rank's token count for token-mean across ranks).
    """
    out = []
    flat = zip(
        logprob.reshape(-1).tolist(),
        old_logprob.reshape(-1).tolist(),
        mask.reshape(-1).tolist(),
        advantages.reshape(-1).tolist(),
    )
    for lp, old, m, a in flat:
        if m:
            log_ratio = lp - old
            ratio = math.exp(min(max(log_ratio, -20.0), 20.0))
            out.append((ratio, a, abs(log_ratio) <= 20.0, m * scale))
    return out


def rho(
    tokens: Sequence[Tuple],
    c_low: float,
    c_high: float,
    contribution: str,
    clip_ratio_c: Optional[float] = 3.0,
) -> float:
    """Positive share P / (P + N) at one pair, straight from the definitions."""
    pos = neg = 0.0
    for r, a, inside, weight in tokens:
        if contribution == "surrogate":
            if a > 0:
                pos += a * min(r, c_high)
            elif a < 0:
                neg += -a * max(r, c_low)
        elif not inside:  # gradient, past the log-ratio clamp: the loss is flat there
            continue
        else:  # gradient: weight |A| r while the loss still depends on logp
            # A ratio on a bound keeps its gradient (torch.clamp is inclusive); on the dual
            # clip, torch.min gives each side of the tie half of it.
            if a > 0 and r <= c_high:
                pos += weight * a * r
            elif a < 0 and r >= c_low:
                if clip_ratio_c is None or r < clip_ratio_c:
                    neg += -weight * a * r
                elif r == clip_ratio_c:
                    neg += -weight * a * r / 2
    return 1.0 if pos + neg == 0 else pos / (pos + neg)


def algorithm1(tokens, a_lo, b_lo, d_lo, a_hi, b_hi, d_hi, rho0, contribution, clip_ratio_c=3.0):
    """Paper Algorithm 1 (upper first). Returns (c_low, c_high, steps)."""
    c_low, c_high = _exact(a_lo), _exact(a_hi)
    b_lo, b_hi, d_lo, d_hi = _exact(b_lo), _exact(b_hi), _exact(d_lo), _exact(d_hi)
    steps = 0
    while (
        rho(tokens, float(c_low), float(c_high), contribution, clip_ratio_c) < rho0
        and c_low + d_lo <= b_lo
    ):
        if c_high + d_hi <= b_hi:
            c_high += d_hi
        else:
            c_low += d_lo
        steps += 1
    return float(c_low), float(c_high), steps


def authors_order(tokens, a_lo, b_lo, d_lo, a_hi, b_hi, d_hi, rho0, contribution, clip_ratio_c=3.0):
    """The authors' code: raise c_low (capped at b-) first, then c_high (capped at b+)."""
    c_low, c_high = _exact(a_lo), _exact(a_hi)
    b_lo, b_hi, d_lo, d_hi = _exact(b_lo), _exact(b_hi), _exact(d_lo), _exact(d_hi)
    steps = 0
    while (
        rho(tokens, float(c_low), float(c_high), contribution, clip_ratio_c) < rho0 and c_low < b_lo
    ):
        c_low = min(c_low + d_lo, b_lo)
        steps += 1
    while (
        rho(tokens, float(c_low), float(c_high), contribution, clip_ratio_c) < rho0
        and c_high < b_hi
    ):
        c_high = min(c_high + d_hi, b_hi)
        steps += 1
    return float(c_low), float(c_high), steps


def token_loss(ratio, adv, c_low, c_high, clip_ratio_c):
    """The README's per-token loss: -min(r A, clip(r) A), then PPO's dual clip where A < 0."""
    import torch

    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, c_low, c_high) * adv)
    if clip_ratio_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * clip_ratio_c), loss)
    return loss
