"""What the tests feed BAPO: its settings by name, batch builders, and the ranks' cases."""

import torch

from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

RANGE_ARGS = [
    f"ratio_{side}_{part}" for side in ("lower", "upper") for part in ("start", "max", "step")
]
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ORDERS = ("upper_first", "lower_first")
PAPER_START, PAPER_MAX = (0.6, 1.2), (0.9, 3.0)  # (a-, a+) and (b-, b+) of the paper's Sec. 5.1
PAPER_STEPS = 36 + 15  # (3.0 - 1.2) / 0.05 upper steps, then (0.9 - 0.6) / 0.02 lower steps
BAPO_METRICS = [f"bapo_{k}" for k in ("clip_low", "clip_high", "positive_contribution")]
BAPO_METRICS += [f"bapo_{k}" for k in ("target_met", "search_steps")]
METRIC_KEYS = {*BAPO_METRICS, "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "pg_loss"}
BATCH_KEYS = ("logprob", "old_logprob", "mask", "advantages")  # the order of ``call``

# Named settings: the paper's grid in both orders, the authors' yaml, and their run script, whose
# 0.95 / 2.0 ends are reached only through the ``min(c + step, max)`` cap.
YAML: dict = dict(search_order="lower_first", positive_contribution_target=0.5, ratio_upper_max=2.0)
YAML.update(ratio_lower_max=0.8, ratio_lower_step=0.05)
SCRIPT = dict(YAML, positive_contribution_target=1 / 3, ratio_upper_step=0.3)
SCRIPT.update(ratio_lower_start=0.8, ratio_lower_max=0.95, ratio_lower_step=0.1)
CONFIGS: dict = {"paper_upper": {}, "paper_lower": dict(search_order="lower_first")}
CONFIGS.update(yaml_lower=YAML, script_lower=SCRIPT)


def loss_kwargs(name: str, **extra) -> dict:
    """Every BAPOPolicyLossFn argument of config ``name``, updated with ``extra``."""
    return {**BAPOPolicyLossFn.default_args(), **CONFIGS[name], **extra}


def point(low, high, **kwargs) -> dict:
    """Return BAPO's arguments with both ranges collapsed to the points ``low`` and ``high``."""
    bounds = dict(ratio_lower_start=low, ratio_lower_max=low)
    return dict(bounds, ratio_upper_start=high, ratio_upper_max=high, **kwargs)


def chosen(metrics) -> tuple:
    """The (c_low, c_high, steps) a call reports in its metrics."""
    keys = ("bapo_clip_low", "bapo_clip_high", "bapo_search_steps")
    low, high, steps = (metrics[key] for key in keys)
    return low, high, int(steps)


def call(fn, logprob, old, mask, adv, **kwargs):
    """Call a policy loss on one batch; return its loss and metrics."""
    return fn(logprob=logprob, old_logprob=old, action_mask=mask, advantages=adv, **kwargs)


def batch(shape, seed=0, spread=0.5, dtype=torch.float32, lengths=None):
    """Draw (logprob, old_logprob, mask, advantages): log-ratios and advantages from N(0, 1).

    The log-ratios are scaled by ``spread``; the float32 mask keeps every token live, or with
    ``lengths`` the first ``lengths[i]`` tokens of row i.
    """
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=gen) * 3 - 0.1
    logprob = old + spread * torch.randn(shape, generator=gen)
    adv = torch.randn(shape, generator=gen)
    mask = torch.ones(shape)
    if lengths is not None:
        mask = (torch.arange(shape[-1]) < torch.tensor(lengths)[:, None]).float()
    return logprob.to(dtype), old.to(dtype), mask, adv.to(dtype)


def mask_values(kind, shape, seed=0):
    """A float32 mask: ``ones``; ``half`` or ``tenth`` everywhere; ``mixed`` fractions, 20 % out."""
    drawn = torch.rand(shape, generator=torch.Generator().manual_seed(seed))
    if kind == "mixed":
        return torch.where(drawn < 0.2, 0.0, drawn)
    return torch.full(shape, {"ones": 1.0, "half": 0.5, "tenth": 0.1}[kind])


CASES = ("mixed", "one_empty", "signs")
POSITIVE_SHARE = (0.45, 0.2, 0.7, 0.3)  # per rank in the "mixed" case
LOG_RATIO_SHIFT = (0.1, -0.1, 0.25, 0.0)


def make_case(case: str, rank: int, world: int, seed: int = 0) -> dict:
    """One rank's padded float32 micro-batch for ``case``, its shape and sign mix its own.

    ``mixed``: both signs on every rank, in different proportions. ``one_empty``: the last
    rank's mask is all zero, over wild values (a rank leaking masked tokens is caught).
    ``signs``: rank 0 only positive advantages, rank 1 only negative. The int mask is zero
    beyond each row's length, as padding is.
    """
    gen = torch.Generator().manual_seed(seed * 10_000 + CASES.index(case) * 100 + rank)
    rows, width = 3 + rank, 6 + 3 * rank
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=gen)
    lengths[0] = width  # at least one row fills the padded width
    inside = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    mask = inside & (torch.rand(rows, width, generator=gen) > 0.15)
    share = POSITIVE_SHARE[rank % len(POSITIVE_SHARE)]
    if case == "signs" and rank < 2:
        share = 1.0 if rank == 0 else 0.0
    positive = torch.rand(rows, width, generator=gen) < share
    magnitude = torch.randn(rows, width, generator=gen).abs() + 0.05
    advantages = torch.where(positive, magnitude, -magnitude)
    old_logprob = -(torch.rand(rows, width, generator=gen) * 2.0 + 0.1)
    shift = LOG_RATIO_SHIFT[rank % len(LOG_RATIO_SHIFT)]
    log_ratio = torch.randn(rows, width, generator=gen) * 0.5 + shift
    if case == "one_empty" and rank == world - 1:
        mask = torch.zeros_like(mask)
        log_ratio = log_ratio * 10.0  # ratios far outside every range, all masked
        advantages = -advantages.abs() * 100.0
    return {
        "logprob": (old_logprob + log_ratio).float(),
        "old_logprob": old_logprob.float(),
        "advantages": advantages.float(),
        "mask": mask.to(torch.int64),
    }


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
OVERFLOWS = ("positive_and_zero", "negative")


def overflow_case(kind: str, rank: int, dtype: str) -> dict:
    """One rank's batch in ``dtype`` with log-ratios past float16's ``exp`` (11.09) and the clamp.

    ``positive_and_zero``: log-ratios 12 and 25 on a token with A > 0 and one with A = 0 (which
    rank 1 swaps); ``negative``: 12 on a token with A < 0 too. The other advantages lean
    negative, so the search moves; a masked token holds 30.
    """
    gen = torch.Generator().manual_seed(rank)
    log_ratio = torch.randn(2, 8, generator=gen) * 0.3
    advantages = torch.randn(2, 8, generator=gen) * 0.5 - 0.5
    log_ratio[0, :3] = torch.tensor([12.0, 25.0, 30.0])
    advantages[0, :2] = torch.tensor([2.0, 0.0] if rank % 2 == 0 else [0.0, 2.0])
    if kind == "negative":
        log_ratio[1, 0], advantages[1, 0] = 12.0, -0.5
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[0, 2] = 0
    old_logprob = -torch.rand(2, 8, generator=gen) - 0.1
    fields = {"logprob": old_logprob + log_ratio, "old_logprob": old_logprob}
    fields["advantages"] = advantages
    return {**{k: v.to(DTYPES[dtype]) for k, v in fields.items()}, "mask": mask}
