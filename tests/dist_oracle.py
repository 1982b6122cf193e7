"""The union oracle of the distributed and engine tests, and how they read the ranks' pairs.

The literal transcription in ``bapo_reference`` run on the concatenated token lists of several
ranks: what one process would decide on their union. Nothing expected comes from the code under
test.
"""

import functools
import math

import torch

import bapo_reference as ref
import dist_checks as common
from scripts.harness.cases import RANGE_ARGS


def tokens_of(data):
    """The tokens of one rank's JSON case, each weighing 1 / the rank's count (token-mean).

    Under ``gradient`` that is each token's factor in its rank's loss: the union's rho is then
    the share of the update that data-parallel averaging applies.
    """
    fields = ("logprob", "old_logprob", "mask", "advantages")
    count = sum(map(sum, data["mask"]))
    return ref.token_lists(*(torch.tensor(data[key]) for key in fields), 1 / max(count, 1))


def union_tokens(datas):
    """Concatenated token lists of several ranks: what one process would see."""
    return tuple(token for data in datas for token in tokens_of(data))


@functools.lru_cache(maxsize=None)
def _search(tokens, name):
    kw = common.loss_kwargs(name)
    search = ref.algorithm1 if kw["search_order"] == "upper_first" else ref.authors_order
    grid = [kw[name] for name in RANGE_ARGS]
    return search(
        tokens, *grid, kw["positive_contribution_target"], kw["contribution"], kw["clip_ratio_c"]
    )


def oracle(tokens, name):
    """(c_low, c_high, steps) of the literal transcription for config ``name``."""
    return _search(tuple(tokens), name)


def reference_token_mean(data, name, low, high):
    """Token-mean loss of one rank's batch at a given pair (float64, from the lists)."""
    lp, old = torch.tensor(data["logprob"]).double(), torch.tensor(data["old_logprob"]).double()
    adv, mask = torch.tensor(data["advantages"]).double(), torch.tensor(data["mask"]).bool()
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    losses = ref.token_loss(ratio, adv, low, high, common.loss_kwargs(name)["clip_ratio_c"])
    return float(losses[mask].mean())


def got_choice(metrics):
    """Return (c_low, c_high, steps) from a rank's metrics."""
    keys = ("bapo_clip_low", "bapo_clip_high", "bapo_search_steps")
    low, high, steps = (metrics[key] for key in keys)
    return low, high, int(steps)


def compare_to_union(results, datas, name):
    """Mismatches of every rank's choice, rho and loss against the union oracle (empty: all ok)."""
    union = union_tokens(datas)
    want = oracle(union, name)
    kw = common.loss_kwargs(name)
    want_rho = ref.rho(union, want[0], want[1], kw["contribution"], kw["clip_ratio_c"])
    problems = []
    for rank, (metrics, data) in enumerate(zip(results, datas)):
        where = f"{name} rank {rank}"
        if got_choice(metrics) != want:
            problems.append(f"{where}: {got_choice(metrics)} != union oracle {want}")
        rho = metrics["bapo_positive_contribution"]
        if not math.isclose(rho, want_rho, rel_tol=1e-5, abs_tol=1e-9):
            problems.append(f"{where}: rho {rho} != global rho {want_rho}")
        if any(map(any, data["mask"])):  # the loss used the synced pair on local tokens
            loss, want_loss = metrics["pg_loss"], reference_token_mean(data, name, *want[:2])
            if not math.isclose(loss, want_loss, rel_tol=1e-4, abs_tol=1e-6):
                problems.append(f"{where}: pg_loss {loss} != {want_loss} at the union pair")
    return problems


def pairs_by_call(calls_by_rank):
    """For each loss call, the (c_low, c_high) each rank chose; every rank made as many calls."""
    assert len({len(calls) for calls in calls_by_rank}) == 1, "ranks made different call counts"
    keys = ("bapo_clip_low", "bapo_clip_high")
    return [[tuple(c["metrics"][k] for k in keys) for c in calls] for calls in zip(*calls_by_rank)]


def locals_differ(datas, name):
    """Whether some rank alone would choose differently than the union (data can tell)."""
    union = oracle(union_tokens(datas), name)[:2]
    return any(oracle(tokens_of(d), name)[:2] != union for d in datas)
