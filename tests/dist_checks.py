"""The checks of ``tests/test_bapo_distributed.py``, run on every rank of a 4-rank torchrun job.

Each check runs on the groups of the first 2, 3 and 4 ranks (the last one WORLD); ranks outside a
group skip it. A check returns what the loss computed and the data it used; the pytest driver
recomputes the single-process answer on the union of the members' data. Nothing expected lives
here.
"""

import sys
import time

import torch.distributed as dist

from tests.inputs import CASES, CONFIGS, DTYPES, OVERFLOWS, loss_kwargs, make_case, overflow_case
from tests.ranks import call_bapo, main, outcome
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
        return {"data": lists(data), "runs": runs}

    def run(group, size):
        cases = {(d, k): overflow_case(k, ctx.rank, d) for d in DTYPES for k in OVERFLOWS}
        return {f"{d} {k}": one(group, data) for (d, k), data in cases.items()}

    return by_size(ctx, run)


# Of eleven calls, those that fail on the group's last rank, and how (a meta tensor is on a
# device that no backend reduces on); the calls between and after are good.
BAD_CALLS = {1: "bool_advantages", 3: "short_old_logprob", 5: "none_logprob"}
BAD_CALLS.update({7: "list_advantages", 9: "meta_logprob"})


def bad_case(data: dict, kind: str) -> dict:
    """``data`` with the fault ``kind`` of ``BAD_CALLS``."""
    if kind == "bool_advantages":
        return {**data, "advantages": data["advantages"] > 0}
    if kind == "short_old_logprob":  # one response token fewer than the log-probs
        return {**data, "old_logprob": data["old_logprob"][:, :-1]}
    if kind == "list_advantages":
        return {**data, "advantages": data["advantages"].tolist()}
    return {**data, "logprob": None if kind == "none_logprob" else data["logprob"].to("meta")}


def check_failure(ctx) -> dict:
    """The last rank's inputs fail in the calls of ``BAD_CALLS``, before the all-reduce.

    Every rank records what each call returned or raised, and how long it took; the failing
    rank also records what the same bad input raises with no group. The good calls between and
    after show that the group's collectives stayed in step.
    """

    def run(group, size):
        data = make_case("mixed", ctx.rank, size)
        loss_fn = BAPOPolicyLossFn(**loss_kwargs("paper_upper"))
        calls, seconds, alone = [], [], {}
        for call in range(11):
            case = data
            if call in BAD_CALLS and ctx.rank == size - 1:
                case = bad_case(data, BAD_CALLS[call])
                alone[call] = outcome(lambda: call_bapo(ctx, loss_fn, case, None))
            start = time.monotonic()
            calls.append(outcome(lambda: call_bapo(ctx, loss_fn, case, group)))
            seconds.append(time.monotonic() - start)
        return {"data": lists(data), "calls": calls, "seconds": seconds, "alone": alone}

    return by_size(ctx, run)


CHECKS = {
    "oracle": check_oracle,
    "local": check_local,
    "nonfinite": check_nonfinite,
    "overflow": check_overflow,
    "failure": check_failure,  # last: before the fix of a hang, it ended the job
}

if __name__ == "__main__":
    sys.exit(main(CHECKS))
