"""What BAPO's single-process tests share: a batch builder, its masks, the paper grid's corners."""

import torch

from scripts.harness.cases import RANGE_ARGS  # noqa: F401  (the six range arguments, in order)

PAPER_START = (0.6, 1.2)  # (a-, a+) of the default, paper Sec. 5.1 grid
PAPER_MAX = (0.9, 3.0)  # (b-, b+)
PAPER_STEPS = 36 + 15  # (3.0 - 1.2) / 0.05 upper steps, then (0.9 - 0.6) / 0.02 lower steps
# The metrics BAPO documents: its own, then PPOPolicyLossFn's
BAPO_METRICS = [f"bapo_{k}" for k in ("clip_low", "clip_high", "positive_contribution")]
BAPO_METRICS += [f"bapo_{k}" for k in ("target_met", "search_steps", "nonfinite_tokens")]
METRIC_KEYS = {*BAPO_METRICS, "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "pg_loss"}
BOTH = [(o, c) for o in ("upper_first", "lower_first") for c in ("surrogate", "gradient")]


def batch(shape, seed=0, spread=0.5, dtype=torch.float32, adv_dtype=None, lengths=None):
    """Draw (logprob, old_logprob, mask, advantages): log-ratios and advantages from N(0, 1).

    Drawn in float32, the log-ratios scaled by ``spread``; then the log-probs are cast to
    ``dtype`` and the advantages to ``adv_dtype`` (``dtype`` when None). The float32 mask keeps
    every token live, or with ``lengths`` the first ``lengths[i]`` tokens of row i.
    """
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=gen) * 3 - 0.1
    logprob = old + spread * torch.randn(shape, generator=gen)
    adv = torch.randn(shape, generator=gen)
    mask = torch.ones(shape)
    if lengths is not None:
        mask = (torch.arange(shape[-1]) < torch.tensor(lengths)[:, None]).float()
    return logprob.to(dtype), old.to(dtype), mask, adv.to(adv_dtype or dtype)


def mask_values(kind, shape, seed=0):
    """Return a float32 mask of one kind of values.

    ``ones``; ``half`` and ``tenth``, every token at 0.5 or 0.1; ``mixed``, fractions with a
    fifth of the tokens out; ``twos``, 2 for 30 % of the tokens and 0 for 15 %, else 1.
    """
    drawn = torch.rand(shape, generator=torch.Generator().manual_seed(seed))
    if kind == "mixed":
        return torch.where(drawn < 0.2, 0.0, drawn)
    if kind == "twos":
        return torch.where(drawn < 0.3, 2.0, torch.where(drawn < 0.45, 0.0, 1.0))
    return torch.full(shape, {"ones": 1.0, "half": 0.5, "tenth": 0.1}[kind])


def point(low, high, **kwargs):
    """Return BAPO's arguments with both ranges collapsed to the points ``low`` and ``high``."""
    bounds = dict(ratio_lower_start=low, ratio_lower_max=low)
    return dict(bounds, ratio_upper_start=high, ratio_upper_max=high, **kwargs)


def chosen(metrics):
    """Return the (c_low, c_high) a call chose, from its metrics."""
    return metrics["bapo_clip_low"], metrics["bapo_clip_high"]


def call(fn, logprob, old, mask, adv):
    """Call a policy loss on one batch; return its loss and metrics."""
    return fn(logprob=logprob, old_logprob=old, action_mask=mask, advantages=adv)
