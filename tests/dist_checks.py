"""The checks of ``tests/test_bapo_distributed.py``, run on every rank by the harness's DP worker.

Each check returns what the loss computed and the data it used; the pytest driver recomputes the
single-process answer on the union of the ranks' data and asserts. Nothing expected lives here.
"""

import gc
import os
import pickle
import warnings
from typing import Dict, List

import torch
import torch.distributed as dist

from scripts.harness.cases import PAPER
from scripts.harness.dp_worker import call_bapo, counted_call
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

# Search settings exercised by every check: both orders x both contribution definitions, on the
# paper's grid and on the authors' grids (their yaml, and their run script whose 0.95 / 2.0
# ends are reached only through the ``min(c + step, max)`` cap).
CONFIGS: Dict[str, Dict] = {
    "paper_upper_surrogate": dict(search_order="upper_first", contribution="surrogate"),
    "paper_upper_gradient": dict(search_order="upper_first", contribution="gradient"),
    "paper_lower_surrogate": dict(search_order="lower_first", contribution="surrogate"),
    "paper_lower_gradient": dict(search_order="lower_first", contribution="gradient"),
    "yaml_lower_surrogate": dict(  # starts and upper step as the paper's
        search_order="lower_first",
        contribution="surrogate",
        ratio_lower_max=0.8,
        ratio_lower_step=0.05,
        ratio_upper_max=2.0,
        positive_contribution_target=0.5,
    ),
    "script_lower_gradient": dict(
        search_order="lower_first",
        contribution="gradient",
        ratio_lower_start=0.8,
        ratio_lower_max=0.95,
        ratio_lower_step=0.1,
        ratio_upper_start=1.2,
        ratio_upper_max=2.0,
        ratio_upper_step=0.3,
        positive_contribution_target=1 / 3,
    ),
}


def loss_kwargs(name: str, **extra) -> Dict:
    """Full BAPOPolicyLossFn keyword arguments of one named config."""
    return {**PAPER, **CONFIGS[name], **extra}


CASES = ("mixed", "one_empty", "signs")

# Per-rank share of positive advantages in the "mixed" case (ranks beyond 4 reuse these).
_POSITIVE_SHARE = (0.45, 0.2, 0.7, 0.3)
_LOG_RATIO_SHIFT = (0.1, -0.1, 0.25, 0.0)


def _case_seed(seed: int, case: str, rank: int) -> int:
    return seed * 10_000 + CASES.index(case) * 100 + rank


def every_config(ctx, data, group, **extra) -> Dict[str, Dict]:
    """One call per config of a fresh loss (with ``extra`` arguments) on ``data``."""
    return {
        name: call_bapo(ctx, BAPOPolicyLossFn(**loss_kwargs(name, **extra)), data, group)
        for name in CONFIGS
    }


def make_case(case: str, rank: int, world: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """One rank's padded float32 micro-batch for ``case``, its shape and sign mix its own.

    ``mixed``: both signs on every rank, in different proportions. ``one_empty``: the last
    rank's mask is all zero, over wild values (a rank leaking masked tokens is caught).
    ``signs``: rank 0 only positive advantages, rank 1 only negative. With an int ``mask`` and
    the rows' ``response_len`` (the mask is zero beyond them, as padding is).
    """
    gen = torch.Generator().manual_seed(_case_seed(seed, case, rank))
    rows, width = 3 + rank, 6 + 3 * rank
    response_len = torch.randint(width // 2, width + 1, (rows,), generator=gen)
    response_len[0] = width  # at least one row fills the padded width
    inside = torch.arange(width).unsqueeze(0) < response_len.unsqueeze(1)
    mask = inside & (torch.rand(rows, width, generator=gen) > 0.15)

    share = _POSITIVE_SHARE[rank % len(_POSITIVE_SHARE)]
    if case == "signs" and rank < 2:
        share = 1.0 if rank == 0 else 0.0
    positive = torch.rand(rows, width, generator=gen) < share
    magnitude = torch.randn(rows, width, generator=gen).abs() + 0.05
    advantages = torch.where(positive, magnitude, -magnitude)

    old_logprob = -(torch.rand(rows, width, generator=gen) * 2.0 + 0.1)
    shift = _LOG_RATIO_SHIFT[rank % len(_LOG_RATIO_SHIFT)]
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
        "response_len": response_len,
    }


def case_to_lists(data: Dict[str, torch.Tensor]) -> Dict[str, List]:
    """JSON-friendly copy (floats survive the round trip exactly)."""
    return {key: value.tolist() for key, value in data.items()}


def check_group_none(ctx):
    """Sync on, no group, world > 1: one RuntimeWarning over two calls, and a local choice.

    The loss warns once, whatever the warning filters say.
    """
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    loss_fn = BAPOPolicyLossFn(**loss_kwargs("paper_upper_surrogate"))
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            calls.append(call_bapo(ctx, loss_fn, data, None))
    return {
        "data": case_to_lists(data),
        "calls": calls,
        "warnings": [{"category": w.category.__name__, "message": str(w.message)} for w in caught],
    }


def check_oracle(ctx):
    """Every case x config through BAPOPolicyLossFn with dp_group=WORLD.

    One loss per config serves every case, in order, so that the first case's calls are the
    first on the group and the later ones show what each call after it costs.
    """
    losses = {name: BAPOPolicyLossFn(**loss_kwargs(name)) for name in CONFIGS}
    out = {}
    for case in CASES:
        data = make_case(case, ctx.rank, ctx.world, ctx.seed)
        runs = {}
        for name, loss_fn in losses.items():
            runs[name] = call_bapo(ctx, loss_fn, data, dist.group.WORLD)
        out[case] = {"data": case_to_lists(data), "runs": runs}
    return out


def check_subgroup(ctx):
    """Group {0, 1} of a larger job, and a size-1 group {0}; other ranks never call the loss.

    ``new_group`` is collective over WORLD, so every rank creates both groups. The closing
    WORLD barrier (outside the counted region) shows that nobody was left waiting.
    """
    pair_group = dist.new_group([0, 1])
    solo_group = dist.new_group([0])
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    out = {"data": case_to_lists(data), "pair": {}, "solo": {}}
    if ctx.rank in (0, 1):
        out["pair"] = every_config(ctx, data, pair_group)
    if ctx.rank == 0:
        out["solo"] = every_config(ctx, data, solo_group)
    dist.barrier()
    out["passed_barrier"] = True
    return out


def check_sync_off(ctx):
    """sync_across_dp=False with dp_group=WORLD on the 'signs' case: every rank on its own."""
    data = make_case("signs", ctx.rank, ctx.world, ctx.seed)
    runs = every_config(ctx, data, dist.group.WORLD, sync_across_dp=False)
    return {"data": case_to_lists(data), "runs": runs}


# One setting changed on the last rank; "same" is the control where nothing differs.
MISMATCHES = {
    "same": {},
    "target": {"positive_contribution_target": 0.45},
    "search_order": {"search_order": "lower_first"},
    "contribution": {"contribution": "gradient"},
    "clip_ratio_c": {"clip_ratio_c": 2.0},
    "grid_same_length": {"ratio_upper_start": 1.25, "ratio_upper_max": 3.05},
    "grid_other_length": {"ratio_upper_max": 2.0},
    "loss_agg_mode": {"loss_agg_mode": "seq-mean-token-mean"},
}


def _outcome(call):
    """The call's metrics, or the type and message of what it raised."""
    try:
        return {"result": call()}
    except Exception as error:  # recorded for the driver, which decides what was expected
        return {"raised": type(error).__name__, "message": str(error)}


def check_mismatch(ctx):
    """Ranks configured differently meet in the one all-reduce; each variant is one call."""
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    out = {}
    for variant, change in MISMATCHES.items():
        kwargs = loss_kwargs("paper_upper_surrogate")
        if ctx.rank == ctx.world - 1:
            kwargs.update(change)
        loss_fn = BAPOPolicyLossFn(**kwargs)
        out[variant] = _outcome(lambda: call_bapo(ctx, loss_fn, data, dist.group.WORLD))
    dist.barrier()
    return out


def check_nonmember(ctx):
    """Rank 2 passes the group {0, 1}, which it does not belong to; 0 and 1 use it rightly."""
    pair_group = dist.new_group([0, 1])
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    loss_fn = BAPOPolicyLossFn(**loss_kwargs("paper_upper_surrogate"))
    out = _outcome(lambda: call_bapo(ctx, loss_fn, data, pair_group))
    dist.barrier()
    return out


# What the last rank passes in calls 1, 3 and 5 of seven, each failing before the collective.
BAD_INPUTS = ("short_advantages", "bool_advantages", "meta_logprob")


def _bad(data, kind):
    """One rank's case broken in one way: a shape, a dtype or a device."""
    if kind == "short_advantages":
        return {**data, "advantages": data["advantages"][:, :-1]}
    if kind == "bool_advantages":
        return {**data, "advantages": data["advantages"] > 0}
    return {**data, "logprob": data["logprob"].to("meta")}


def check_failure(ctx):
    """The last rank's inputs fail in calls 1, 3 and 5 of seven, one bad input kind each.

    Every rank records what each call returned or raised; the calls in between, where every
    rank's inputs are good, show that nobody's collectives were left out of step.
    """
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    loss_fn = BAPOPolicyLossFn(**loss_kwargs("paper_upper_surrogate"))
    calls = []
    for call in range(2 * len(BAD_INPUTS) + 1):
        case = data
        if call % 2 and ctx.rank == ctx.world - 1:
            case = _bad(data, BAD_INPUTS[call // 2])
        calls.append(_outcome(lambda: call_bapo(ctx, loss_fn, case, dist.group.WORLD)))
    dist.barrier()
    return {"data": case_to_lists(data), "calls": calls}


def check_copies(ctx):
    """After a good call, the last rank goes on with a pickled copy, then a loss built anew.

    The copy and the new loss keep nothing of the first; the group's settings check must not
    depend on what a loss object remembers, so every call pairs with the peers' (no hang).
    """
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    loss_fn = BAPOPolicyLossFn(**loss_kwargs("paper_upper_surrogate"))
    calls = [call_bapo(ctx, loss_fn, data, dist.group.WORLD)]
    if ctx.rank == ctx.world - 1:
        loss_fn = pickle.loads(pickle.dumps(loss_fn))
    calls.append(call_bapo(ctx, loss_fn, data, dist.group.WORLD))
    if ctx.rank == ctx.world - 1:
        loss_fn = BAPOPolicyLossFn(**loss_kwargs("paper_upper_surrogate"))
    calls.append(call_bapo(ctx, loss_fn, data, dist.group.WORLD))
    return {"data": case_to_lists(data), "calls": calls}


def check_groups(ctx):
    """Open file descriptors over 30 groups created, used by one call, and destroyed."""
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    loss_fn = BAPOPolicyLossFn(**loss_kwargs("paper_upper_surrogate"))
    counts = []
    for _ in range(30):
        group = dist.new_group(list(range(ctx.world)))
        call_bapo(ctx, loss_fn, data, group)
        dist.destroy_process_group(group)
        del group
        gc.collect()
        counts.append(len(os.listdir("/proc/self/fd")))
    return {"fds": counts}


NAN_UNMASKED = 2  # NaN log-probs placed on unmasked tokens of the last rank


def check_nonfinite(ctx):
    """Put NaN log-probs on the last rank only (two unmasked, one masked); others finite."""
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    if ctx.rank == ctx.world - 1:
        logprob, mask = data["logprob"].clone(), data["mask"].clone()
        logprob[0, 0] = logprob[0, 1] = float("nan")
        mask[0, 0] = mask[0, 1] = 1
        logprob[0, 2] = float("nan")
        mask[0, 2] = 0
        data = {**data, "logprob": logprob, "mask": mask}
    runs = every_config(ctx, data, dist.group.WORLD)
    return {"runs": runs, "expected_nonfinite": NAN_UNMASKED}


GRADIENT_CONFIGS = ("paper_upper_surrogate", "paper_lower_gradient")


def check_gradient(ctx):
    """Each rank's gradient (float64) with respect to its log-probs, with sync on and off.

    The driver compares it with the gradient of the token-mean over the union of the ranks.
    """
    data = make_case("mixed", ctx.rank, ctx.world, ctx.seed)
    case = ctx.put({k: v.double() if v.is_floating_point() else v for k, v in data.items()})
    runs: Dict[str, Dict] = {}
    for name in GRADIENT_CONFIGS:
        for sync in (True, False):
            leaf = case["logprob"].clone().requires_grad_(True)
            loss, record = counted_call(
                BAPOPolicyLossFn(**loss_kwargs(name, sync_across_dp=sync)),
                logprob=leaf,
                old_logprob=case["old_logprob"],
                action_mask=case["mask"],
                advantages=case["advantages"],
                dp_group=dist.group.WORLD,
            )
            loss.backward()
            record["grad"] = leaf.grad.cpu().tolist()
            runs.setdefault(name, {})["sync" if sync else "nosync"] = record
    return {"data": case_to_lists(data), "runs": runs}


CHECKS = {name[6:]: fn for name, fn in list(globals().items()) if name.startswith("check_")}
