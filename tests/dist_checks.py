"""The checks of ``tests/test_bapo_distributed.py``, run on every rank of a 4-rank torchrun job.

Each check runs on the groups of the first 2, 3 and 4 ranks (the last one WORLD); ranks outside a
group skip it. A check returns what the loss computed and the data it used; the pytest driver
recomputes the single-process answer on the union of the members' data. Nothing expected lives
here.
"""

import sys

import torch.distributed as dist

from tests import oracle
from tests.inputs import CASES, CONFIGS, DTYPES, OVERFLOWS, loss_kwargs, make_case, overflow_case
from tests.ranks import call_bapo, main
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

SIZES = (2, 3, 4)
GROUPS: dict = {}  # size: the group of ranks 0 .. size - 1, created once by every rank


def lists(data: dict) -> dict:
    """A JSON-friendly copy of a case (floats survive the round trip exactly)."""
    return {key: value.tolist() for key, value in data.items()}


def every_config(ctx, data, group, **extra) -> dict:
    """One call of a new loss per config (with ``extra`` arguments) on ``data``."""
    return {
        name: call_bapo(ctx, BAPOPolicyLossFn(**loss_kwargs(name, **extra)), data, group)
        for name in CONFIGS
    }


def by_size(ctx, run) -> dict:
    """``run(group, size)`` on the members of each group; the WORLD barrier shows no one hung."""
    out = {}
    for size in SIZES:
        if size not in GROUPS:  # new_group is collective over WORLD: every rank creates it
            whole = size == ctx.world
            GROUPS[size] = dist.group.WORLD if whole else dist.new_group(list(range(size)))
        if ctx.rank < size:
            out[size] = run(GROUPS[size], size)
    dist.barrier()
    return out


def check_oracle(ctx) -> dict:
    """Every case x config; one new loss per config and group serves every case in turn."""

    def run(group, size):
        losses = {name: BAPOPolicyLossFn(**loss_kwargs(name)) for name in CONFIGS}
        out = {}
        for case in CASES:
            data = make_case(case, ctx.rank, size)
            runs = {name: call_bapo(ctx, fn, data, group) for name, fn in losses.items()}
            out[case] = {"data": lists(data), "runs": runs}
        return out

    return by_size(ctx, run)


def check_local(ctx) -> dict:
    """Sync off with dp_group=WORLD, sync on with no group, and rank 0 alone in a group {0}."""
    solo = dist.new_group([0])
    data = make_case("signs", ctx.rank, ctx.world)
    out = {
        "data": lists(data),
        "sync_off": every_config(ctx, data, dist.group.WORLD, sync_across_dp=False),
        "no_group": every_config(ctx, data, None),
    }
    if ctx.rank == 0:
        out["solo"] = every_config(ctx, data, solo)
    dist.barrier()
    return out


def check_nonfinite(ctx) -> dict:
    """Put NaN log-probs on two live tokens and a masked one of the last rank; then call clean.

    One loss per config makes both calls, so the clean call shows that nothing of the NaN stays.
    """

    def run(group, size):
        data = make_case("mixed", ctx.rank, size)
        if ctx.rank == 0:  # mostly negative advantages: the clean union moves the search
            data = {**data, "advantages": -data["advantages"].abs()}
        bad = data
        if ctx.rank == size - 1:
            logprob, mask = data["logprob"].clone(), data["mask"].clone()
            logprob[0, :3] = float("nan")
            mask[0, :2], mask[0, 2] = 1, 0
            bad = {**data, "logprob": logprob, "mask": mask}
        losses = {name: BAPOPolicyLossFn(**loss_kwargs(name)) for name in CONFIGS}
        calls = [
            {n: call_bapo(ctx, fn, case, group) for n, fn in losses.items()} for case in (bad, data)
        ]
        return {"data": lists(data), "nan": calls[0], "clean": calls[1]}

    return by_size(ctx, run)


def check_overflow(ctx) -> dict:
    """Log-ratios past float16's exp and the clamp, per dtype and kind, both paper orders."""

    def one(group, data) -> dict:
        runs = {
            name: call_bapo(ctx, BAPOPolicyLossFn(**loss_kwargs(name)), data, group)
            for name in ("paper_upper", "paper_lower")
        }
        # the tokens' ratios as this rank's numerics compute them (the launch pins MKL, whose
        # float32 exp can differ from the test process's by one ulp)
        tokens = oracle.tokens_in(data["logprob"].dtype, lists(data))
        return {"data": lists(data), "tokens": tokens, "runs": runs}

    def run(group, size):
        cases = {(d, k): overflow_case(k, ctx.rank, d) for d in DTYPES for k in OVERFLOWS}
        return {f"{d} {k}": one(group, data) for (d, k), data in cases.items()}

    return by_size(ctx, run)


CHECKS = {
    "oracle": check_oracle,
    "local": check_local,
    "nonfinite": check_nonfinite,
    "overflow": check_overflow,
}

if __name__ == "__main__":
    sys.exit(main(CHECKS))
