"""What the distributed and engine tests share: the union oracle.

The union oracle is the literal transcription in ``bapo_reference`` run on the concatenated
token lists of several ranks: what one process would decide on their union. The per-token
loss is written here from the README's formula, so nothing expected comes from the code under
test. Used by tests/test_bapo_distributed.py and by the engine tests.
"""

import math

import torch

import bapo_reference as ref
import dist_checks as common

_ORACLE_CACHE: dict = {}


def tokens_of(data):
    """Return the (ratio, advantage) tokens of one rank's JSON case."""
    case = common.lists_to_case(data)
    return ref.token_lists(case["logprob"], case["old_logprob"], case["mask"], case["advantages"])


def union_tokens(datas):
    """Concatenated token lists of several ranks: what one process would see."""
    return [token for data in datas for token in tokens_of(data)]


def oracle(tokens, name):
    """(c_low, c_high, steps) of the literal transcription for config ``name``."""
    key = (tuple(tokens), name)
    if key not in _ORACLE_CACHE:
        kw = common.loss_kwargs(name)
        search = ref.algorithm1 if kw["search_order"] == "upper_first" else ref.authors_order
        _ORACLE_CACHE[key] = search(
            tokens,
            kw["ratio_lower_start"],
            kw["ratio_lower_max"],
            kw["ratio_lower_step"],
            kw["ratio_upper_start"],
            kw["ratio_upper_max"],
            kw["ratio_upper_step"],
            kw["positive_contribution_target"],
            kw["contribution"],
            kw["clip_ratio_c"],
        )
    return _ORACLE_CACHE[key]


def oracle_rho(tokens, name, low, high):
    """Return rho at one pair for config ``name``, from the oracle."""
    kw = common.loss_kwargs(name)
    return ref.rho(tokens, low, high, kw["contribution"], kw["clip_ratio_c"])


def reference_token_loss(ratio, advantages, low, high, clip_ratio_c):
    """Per-token loss as the README writes it: -min(rA, clip(r)A), then PPO's dual clip."""
    loss = -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    if clip_ratio_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_ratio_c), loss)
    return loss


def reference_token_mean(data, name, low, high):
    """Token-mean loss of one rank's batch at a given pair (float64, from the lists)."""
    kw = common.loss_kwargs(name)
    lp, old = torch.tensor(data["logprob"]).double(), torch.tensor(data["old_logprob"]).double()
    adv, mask = torch.tensor(data["advantages"]).double(), torch.tensor(data["mask"]).bool()
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    losses = reference_token_loss(ratio, adv, low, high, kw["clip_ratio_c"])
    return float(losses[mask].mean())


def got_choice(metrics, prefix=""):
    """Return (c_low, c_high, steps) from a rank's metrics."""
    return (
        metrics[prefix + "bapo_clip_low"],
        metrics[prefix + "bapo_clip_high"],
        int(metrics[prefix + "bapo_search_steps"]),
    )


def compare_to_union(results, datas, name, prefix=""):
    """Mismatch descriptions of every rank's choice against the union oracle (empty: all ok)."""
    union = union_tokens(datas)
    low, high, steps = oracle(union, name)
    want_rho = oracle_rho(union, name, low, high)
    problems = []
    for rank, (metrics, data) in enumerate(zip(results, datas)):
        got = got_choice(metrics, prefix)
        if got != (low, high, steps):
            problems.append(
                f"{name} rank {rank}: (low, high, steps) {got} != union oracle "
                f"{(low, high, steps)}"
            )
        rho = metrics[prefix + "bapo_positive_contribution"]
        if not math.isclose(rho, want_rho, rel_tol=1e-5, abs_tol=1e-9):
            problems.append(f"{name} rank {rank}: rho {rho} != global rho {want_rho}")
        if any(map(any, data["mask"])):  # the loss used the synced pair on local tokens
            want_loss = reference_token_mean(data, name, low, high)
            got_loss = metrics[prefix + "pg_loss"]
            if not math.isclose(got_loss, want_loss, rel_tol=1e-4, abs_tol=1e-6):
                problems.append(
                    f"{name} rank {rank}: pg_loss {got_loss} != {want_loss} " f"at the union pair"
                )
    return problems


def locals_differ(datas, name):
    """Whether some rank alone would choose differently than the union (data can tell)."""
    union = oracle(union_tokens(datas), name)[:2]
    return any(oracle(tokens_of(d), name)[:2] != union for d in datas)
