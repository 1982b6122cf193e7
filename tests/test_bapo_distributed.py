"""BAPO's data-parallel bound search, run for real with torchrun on gloo (CPU).

With ``sync_across_dp`` every rank must take the decision one process takes on the union of the
ranks' tokens (the literal oracle on the concatenated token lists; the gradient from the
README's loss). One launch per world size (2, 3, 4) runs every check of ``tests/dist_checks.py``;
a failure names its check, world size, case, config and rank. nccl runs where GPUs exist.
"""

import math
from fractions import Fraction

import pytest
import torch

import bapo_reference as ref
import dist_checks as common
from dist_oracle import compare_to_union, got_choice, locals_differ, oracle, tokens_of, union_tokens
from scripts.harness.cases import RANGE_ARGS
from scripts.harness.launch import tail, torchrun

BASE_CHECKS = ["group_none", "oracle", "sync_off", "nonfinite", "gradient"]
BASE_CHECKS += ["mismatch", "failure", "copies"]
CHECKS_BY_WORLD = {
    2: BASE_CHECKS + ["groups"],
    3: BASE_CHECKS + ["subgroup", "nonmember"],
    4: BASE_CHECKS,
}
WORLDS = sorted(CHECKS_BY_WORLD)
ALL_REDUCE = "c10d.allreduce_.default"
# Before the candidates' sums: a failure count and three 16-bit settings-fingerprint lanes with
# their squares; after them, the non-finite count.
FRAME = 1 + 3 + 3 + 1


def values_per_call(name):
    """What one all-reduce carries for config ``name``: the frame and every candidate.

    Candidates are start + k step <= maximum, plus the capped maximum in the authors' order.
    """
    kw, count = common.loss_kwargs(name), FRAME
    for names in (RANGE_ARGS[:3], RANGE_ARGS[3:]):  # the lower range, then the upper one
        a, b, d = (Fraction(repr(float(kw[key]))) for key in names)
        steps = math.floor((b - a) / d) + 1 if a != b else 1
        count += steps + int(kw["search_order"] == "lower_first" and a + (steps - 1) * d < b)
    return count


def collective_problems(runs, where, previous=None):
    """Each synced call is one all-reduce, or two where the group's last call had another length.

    ``runs`` are (config, record) in call order on one group; ``previous`` is what the call
    before them carried (None: unknown). The first all-reduce of a pair has the group's last
    length (the header alone before any): the ranks move to a new length only together.
    """
    problems = []
    for name, run in runs:
        want = values_per_call(name)
        if run["collectives"] == [ALL_REDUCE] and previous in (None, want):
            ok = run["values"] == [want]
        else:
            ok = run["collectives"] == [ALL_REDUCE] * 2 and run["values"][1] == want
            ok = ok and previous in (None, run["values"][0])
        if not ok:
            problems.append(f"{where}/{name}: {run['collectives']} {run['values']}")
        previous = want
    return problems


def nccl_ranks(world):
    """Whether the machine has a GPU for each of ``world`` nccl ranks."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= max(2, world)


with_backend = pytest.mark.parametrize(
    "backend",
    ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(not nccl_ranks(2), reason="no GPUs"))],
)


def results(launches, world, backend, name):
    """Per-rank results of check ``name`` in the launch of ``world`` ranks."""
    if backend == "nccl" and not nccl_ranks(world):
        pytest.skip(f"nccl with {world} ranks needs {world} CUDA devices")
    args = (world, "dist_checks", CHECKS_BY_WORLD[world], backend)
    return launches.check(f"dist_{world}_{backend}", name, *args)


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_launch_ends_cleanly(launches, world, backend):
    """Every check ran and torchrun exited 0 (a check's own test reports its failure)."""
    results(launches, world, backend, "group_none")  # launched by now, or skipped
    launch, records = launches.done[f"dist_{world}_{backend}"]
    assert launch.code == 0, f"{world} ranks: exit {launch.code}\n{tail(launch.err)}"
    assert all(list(r["checks"]) == CHECKS_BY_WORLD[world] for r in records)


def union_problems(result):
    """Every case x config of one check, each rank's metrics against the union oracle."""
    problems = []
    for case in common.CASES:
        datas = [rank_result[case]["data"] for rank_result in result]
        for name in common.CONFIGS:
            metrics = [rank_result[case]["runs"][name]["metrics"] for rank_result in result]
            problems += [f"{case}: {p}" for p in compare_to_union(metrics, datas, name)]
    return problems


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_chooses_the_union_pair(launches, world, backend):
    """Call BAPOPolicyLossFn with dp_group=WORLD: all cases x configs against the oracle.

    For every config some case has a rank whose own choice differs from the union's, or a loss
    that skipped the all-reduce would pass.
    """
    result = results(launches, world, backend, "oracle")
    problems = union_problems(result)
    assert not problems, "\n".join(problems)
    datas = [[rank[case]["data"] for rank in result] for case in common.CASES]
    blind = [n for n in common.CONFIGS if not any(locals_differ(d, n) for d in datas)]
    assert not blind, f"{world} ranks: no case tells synced from local for {blind}"


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_one_all_reduce_per_synced_call(launches, world, backend):
    """Each synced call is one all_reduce; where the group's length changes, one more.

    The all-reduce carries the header and the candidates' sums; the length changes at a
    group's first call and at another grid. One loss per config serves every case in turn.
    """
    problems = []
    for rank, rank_result in enumerate(results(launches, world, backend, "oracle")):
        runs = [(n, r) for case in common.CASES for n, r in rank_result[case]["runs"].items()]
        problems += collective_problems(runs, f"oracle rank {rank}")
    for rank, rank_result in enumerate(results(launches, world, backend, "nonfinite")):
        problems += collective_problems(rank_result["runs"].items(), f"nonfinite rank {rank}")
    for rank, rank_result in enumerate(results(launches, world, backend, "gradient")):
        runs = [(name, runs["sync"]) for name, runs in rank_result["runs"].items()]
        problems += collective_problems(runs, f"gradient rank {rank}")
    assert not problems, "\n".join(problems)


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_no_collective_without_sync(launches, world, backend):
    """Sync off and group None: the loss issues no collective at all."""
    sync_off, gradient, group_none = (
        results(launches, world, backend, check) for check in ("sync_off", "gradient", "group_none")
    )
    for rank in range(world):
        assert not any(run["collectives"] for run in sync_off[rank]["runs"].values()), rank
        assert not any(r["nosync"]["collectives"] for r in gradient[rank]["runs"].values()), rank
        assert not any(call["collectives"] for call in group_none[rank]["calls"]), rank


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_group_none_warns_once_and_stays_local(launches, world, backend):
    result = results(launches, world, backend, "group_none")
    datas = [rank_result["data"] for rank_result in result]
    name = "paper_upper_surrogate"
    assert locals_differ(datas, name), "data cannot tell a local choice from a synced one"
    for rank, rank_result in enumerate(result):
        kinds = [w["category"] for w in rank_result["warnings"]]
        assert kinds == ["RuntimeWarning"], f"rank {rank}: warnings over two calls {kinds}"
        want = oracle(tokens_of(rank_result["data"]), name)
        for i, call in enumerate(rank_result["calls"]):
            got = got_choice(call["metrics"])
            assert got == want, f"rank {rank} call {i}: {got} != local oracle {want}"


SUBGROUP_WORLD = 3


@with_backend
def test_subgroup_syncs_its_members_only(launches, backend):
    """{0, 1} in a 3-rank job: 0 and 1 agree with their union; rank 2 never calls; no hang."""
    result = results(launches, SUBGROUP_WORLD, backend, "subgroup")
    datas = [rank_result["data"] for rank_result in result]
    assert all(rank_result["passed_barrier"] for rank_result in result)
    assert result[2]["pair"] == {} and result[2]["solo"] == {}
    problems = []
    for name in common.CONFIGS:
        metrics = [result[rank]["pair"][name]["metrics"] for rank in (0, 1)]
        problems += compare_to_union(metrics, datas[:2], name)
    for rank in (0, 1):  # a new group: its first call starts from the header alone
        runs = result[rank]["pair"].items()
        problems += collective_problems(runs, f"pair rank {rank}", previous=FRAME - 1)
    assert not problems, "\n".join(problems)
    # The data must tell the pair's union from WORLD's union and from each rank alone.
    pair_union = {n: oracle(union_tokens(datas[:2]), n)[:2] for n in common.CONFIGS}
    world_union = {n: oracle(union_tokens(datas), n)[:2] for n in common.CONFIGS}
    assert pair_union != world_union, "data cannot tell a {0,1} reduce from a WORLD reduce"
    assert any(locals_differ(datas[:2], n) for n in common.CONFIGS)


@with_backend
def test_size_one_group_is_local_and_silent(launches, backend):
    result = results(launches, SUBGROUP_WORLD, backend, "subgroup")
    solo = result[0]["solo"]
    for name in common.CONFIGS:
        want = oracle(tokens_of(result[0]["data"]), name)
        assert got_choice(solo[name]["metrics"]) == want, name
        assert solo[name]["collectives"] == [], name


@with_backend
def test_rank_outside_the_group_raises(launches, backend):
    """A rank that passes a group it is not in gets a clear error, not a silent solo search."""
    result = results(launches, SUBGROUP_WORLD, backend, "nonmember")
    assert "result" in result[0] and "result" in result[1], result[:2]
    assert result[2].get("raised") == "RuntimeError", result[2]
    assert "not a member of the dp_group" in result[2]["message"], result[2]


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_ranks_with_different_settings_raise_everywhere(launches, world, backend):
    """One setting changed on the last rank: every rank raises, naming BAPO's settings.

    The control, where every rank has the same settings, must run through and agree.
    """
    result = results(launches, world, backend, "mismatch")
    control = [rank_result["same"] for rank_result in result]
    assert all("result" in outcome for outcome in control), control
    assert len({got_choice(outcome["result"]["metrics"]) for outcome in control}) == 1
    for variant in result[0]:
        if variant == "same":
            continue
        for rank, rank_result in enumerate(result):
            outcome = rank_result[variant]
            assert outcome.get("raised") == "RuntimeError", (variant, rank, outcome)
            assert "differ between the ranks" in outcome["message"], (variant, rank, outcome)
            assert f"global ranks [{world - 1}]" in outcome["message"], (variant, rank, outcome)


# What the last rank raises for each bad input of the failure check, and a phrase of it
RAISED = {
    "short_advantages": ("ValueError", "must share one shape"),
    "bool_advantages": ("ValueError", "floating point"),
    "meta_logprob": ("RuntimeError", "device meta"),
}


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_bad_inputs_on_one_rank_raise_on_every_rank_in_that_call(launches, world, backend):
    """The last rank's inputs fail in calls 1, 3 and 5: no rank returns from those calls.

    A wrong shape, bool advantages, a log-prob on another device: the bad rank raises its own
    error, the others a RuntimeError naming it; in the calls between, with good inputs
    everywhere, every rank again takes the union's pair (nothing off by one).
    """
    result = results(launches, world, backend, "failure")
    datas = [rank_result["data"] for rank_result in result]
    name = "paper_upper_surrogate"
    want = oracle(union_tokens(datas), name)
    for rank, rank_result in enumerate(result):
        for call, outcome in enumerate(rank_result["calls"]):
            if call % 2 == 0:
                assert "result" in outcome, (rank, call, outcome)
                assert got_choice(outcome["result"]["metrics"]) == want, (rank, call)
                assert outcome["result"]["collectives"][-1] == ALL_REDUCE, (rank, call)
            elif rank == world - 1:
                error, phrase = RAISED[common.BAD_INPUTS[call // 2]]
                assert outcome.get("raised") == error and phrase in outcome["message"], outcome
            else:
                assert outcome.get("raised") == "RuntimeError", (rank, call, outcome)
                assert f"failed on global rank(s) [{world - 1}]" in outcome["message"], outcome
    assert locals_differ(datas, name), "data cannot tell a local choice from a synced one"


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_a_copied_or_new_loss_on_one_rank_pairs_with_its_peers(launches, world, backend):
    """A pickled copy and a loss built anew on the last rank: every call takes the union pair.

    Each is one all-reduce: the group's length lives with the process, not the loss object.
    """
    result = results(launches, world, backend, "copies")
    want = oracle(
        union_tokens([rank_result["data"] for rank_result in result]), "paper_upper_surrogate"
    )
    for rank, rank_result in enumerate(result):
        for call, outcome in enumerate(rank_result["calls"]):
            assert got_choice(outcome["metrics"]) == want, (rank, call)
            assert call == 0 or outcome["collectives"] == [ALL_REDUCE], (rank, call, outcome)


@with_backend
def test_destroyed_groups_leave_no_descriptors_open(launches, backend):
    """30 groups created, used and destroyed: the open descriptors stay flat after the first.

    A reference to each group kept anywhere would hold about five more per group.
    """
    for rank, rank_result in enumerate(results(launches, 2, backend, "groups")):
        fds = rank_result["fds"]
        assert max(fds) - fds[0] <= 2, f"rank {rank}: descriptors {fds[0]} -> {max(fds)}"


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_sync_off_ranks_diverge(launches, world, backend):
    """The tests can see divergence: without sync each rank takes its own local choice."""
    result = results(launches, world, backend, "sync_off")
    for name in common.CONFIGS:
        pairs = [got_choice(r["runs"][name]["metrics"])[:2] for r in result]
        assert len(set(pairs)) > 1, f"{name}: every rank chose {pairs[0]} without sync"
        for rank, rank_result in enumerate(result):
            want = oracle(tokens_of(rank_result["data"]), name)
            assert got_choice(rank_result["runs"][name]["metrics"]) == want, (name, rank)


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_nonfinite_on_one_rank_keeps_start_pair_everywhere(launches, world, backend):
    """Every rank counts the group's non-finite tokens, keeps the start pair, and stays finite."""
    for rank, rank_result in enumerate(results(launches, world, backend, "nonfinite")):
        for name, run in rank_result["runs"].items():
            kw, where, m = common.loss_kwargs(name), f"{name} rank {rank}", run["metrics"]
            start = (kw["ratio_lower_start"], kw["ratio_upper_start"], 0)
            assert got_choice(m) == start, where
            assert m["bapo_nonfinite_tokens"] == rank_result["expected_nonfinite"], where
            assert rank == world - 1 or math.isfinite(run["loss"]), where


def union_gradient(result, name):
    """The union oracle's pair, and each rank's share of the token-mean gradient over the union.

    A rank's loss is the token-mean over its own tokens, so its gradient is the union's times
    the union's token count over its own.
    """
    case = {
        key: torch.cat([torch.tensor(r["data"][key]).reshape(-1) for r in result])
        for key in ("logprob", "old_logprob", "advantages", "mask")
    }
    lp, old, adv = (case[k].double() for k in ("logprob", "old_logprob", "advantages"))
    mask, leaf = case["mask"].bool(), lp.clone().requires_grad_(True)
    low, high, _ = oracle(union_tokens([r["data"] for r in result]), name)
    ratio = torch.exp(torch.clamp(leaf - old, -20.0, 20.0))
    clip_c = common.loss_kwargs(name)["clip_ratio_c"]
    ref.token_loss(ratio, adv, low, high, clip_c)[mask].mean().backward()
    sizes = [torch.tensor(r["data"]["mask"]).numel() for r in result]
    counts = [int(torch.tensor(r["data"]["mask"]).sum()) for r in result]
    parts = leaf.grad.split(sizes)
    return (low, high), [g * int(mask.sum()) / max(n, 1) for g, n in zip(parts, counts)]


@with_backend
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", common.GRADIENT_CONFIGS)
def test_gradient_with_sync_equals_union_gradient(launches, world, backend, name):
    result = results(launches, world, backend, "gradient")
    pair, want = union_gradient(result, name)
    scale = max(float(w.abs().max()) for w in want)
    for rank, (rank_result, share) in enumerate(zip(result, want)):
        run = rank_result["runs"][name]["sync"]
        assert got_choice(run["metrics"])[:2] == pair, rank
        gap = float(
            (torch.tensor(run["grad"], dtype=torch.float64).reshape(-1) - share).abs().max()
        )
        assert gap < 1e-12 * scale, f"rank {rank}: gradient {gap:.3g} off the union's"


def test_by_hand_check_two_ranks():
    """The DP worker's by-hand mode with 2 ranks and 2 calls: exits 0 and reports agreement.

    Rank 0's batch is balanced and rank 1's mostly negative, so alone they choose different
    pairs: agreement on every call needs the all-reduce.
    """
    code, out, err, seconds = torchrun(
        2, "scripts.harness.dp_worker", ["by-hand", "--calls", "2"], 150
    )
    assert code == 0, f"exit {code} after {seconds:.0f} s\n{tail(out)}\n{tail(err)}"
    lines = [line for line in out.splitlines() if line.startswith("call ")]
    assert len(lines) == 2 and all(line.endswith("agree: yes") for line in lines), lines
