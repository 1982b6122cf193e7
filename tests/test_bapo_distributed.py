"""BAPO's data-parallel bound search, run for real with torchrun on gloo (CPU).

With ``sync_across_dp`` every rank of a group must take the decision one process takes on the
union of the members' tokens (the literal oracle on the concatenated token lists). One 4-rank
launch runs the checks of ``tests/dist_checks.py`` on the groups of 2, 3 and 4 ranks; a failure
names its check, group size, case, config and rank. nccl runs where 4 GPUs exist.
"""

import math

import pytest
import torch

from scripts.harness.launch import tail, torchrun
from tests import oracle
from tests.dist_checks import CHECKS, SIZES
from tests.inputs import CASES, CONFIGS, DTYPES, chosen, loss_kwargs

WORLD = 4
ALL_REDUCE = "c10d.allreduce_.default"
NCCL = ["nccl"] if torch.cuda.device_count() >= WORLD else []  # one GPU per rank
with_backend = pytest.mark.parametrize("backend", ["gloo", *NCCL])
with_size = pytest.mark.parametrize("size", SIZES)


def results(launches, backend, name, size=None):
    """Per-rank results of check ``name`` (of the group of ``size`` ranks: its members')."""
    got = launches.check(f"dist_{backend}", name, WORLD, "tests.dist_checks", list(CHECKS), backend)
    return got if size is None else [rank[str(size)] for rank in got[:size]]


@with_backend
def test_launch_ends_cleanly(launches, backend):
    """Every check ran and torchrun exited 0 (a check's own test reports its failure)."""
    results(launches, backend, "oracle")
    launch, records = launches.done[f"dist_{backend}"]
    assert launch.code == 0, f"exit {launch.code}\n{tail(launch.err)}"
    assert all(list(r["checks"]) == list(CHECKS) for r in records)


@with_backend
@with_size
def test_every_rank_chooses_the_union_pair(launches, backend, size):
    """Every case x config against the oracle on the union of the group's tokens.

    For every config some case has a rank whose own choice differs from the union's, or a loss
    that skipped the all-reduce would pass; a sub-group's union differs from WORLD's, or a
    reduce over WORLD would pass.
    """
    result = results(launches, backend, "oracle", size)
    datas = {case: [rank[case]["data"] for rank in result] for case in CASES}
    problems = []
    for case in CASES:
        for name in CONFIGS:
            metrics = [rank[case]["runs"][name]["metrics"] for rank in result]
            problems += [
                f"{case}: {p}" for p in oracle.compare_to_union(metrics, datas[case], name)
            ]
    assert not problems, "\n".join(problems)
    blind = [n for n in CONFIGS if not any(oracle.locals_differ(d, n) for d in datas.values())]
    assert not blind, f"{size} ranks: no case tells synced from local for {blind}"
    if size < WORLD:
        world = [rank["mixed"]["data"] for rank in results(launches, backend, "oracle", WORLD)]
        unions = [oracle.union_tokens(datas["mixed"]), oracle.union_tokens(world)]
        pairs = [[oracle.search(u, loss_kwargs(n)) for n in CONFIGS] for u in unions]
        assert pairs[0] != pairs[1], "data cannot tell a sub-group's reduce from WORLD's"


@with_backend
@with_size
def test_one_all_reduce_per_synced_call_the_first_included(launches, backend, size):
    """A new loss's first call on a new group is one all-reduce, as is every later call."""
    for rank, rank_result in enumerate(results(launches, backend, "oracle", size)):
        for case in CASES:
            for name, run in rank_result[case]["runs"].items():
                assert run["collectives"] == [ALL_REDUCE], (rank, case, name, run["collectives"])
    for rank, calls in enumerate(results(launches, backend, "nonfinite", size)):
        for runs in (calls["nan"], calls["clean"]):
            assert all(run["collectives"] == [ALL_REDUCE] for run in runs.values()), rank


@with_backend
def test_without_sync_each_rank_decides_alone_and_the_ranks_differ(launches, backend):
    """Sync off (with WORLD passed) and no group: no collective, each rank its local oracle.

    The control: on this data the ranks' own pairs differ, so agreement needs the all-reduce.
    """
    result = results(launches, backend, "local")
    for mode in ("sync_off", "no_group"):
        for name in CONFIGS:
            runs = [rank_result[mode][name] for rank_result in result]
            pairs = [chosen(run["metrics"]) for run in runs]
            assert len({pair[:2] for pair in pairs}) > 1, f"{mode}/{name}: all chose {pairs[0]}"
            for rank, (run, rank_result) in enumerate(zip(runs, result)):
                want = oracle.search(oracle.tokens_of(rank_result["data"]), loss_kwargs(name))
                assert pairs[rank] == want and run["collectives"] == [], (mode, name, rank)


@with_backend
def test_size_one_group_decides_alone(launches, backend):
    """A group of rank 0 alone: its one all-reduce sums nothing else in."""
    result = results(launches, backend, "local")[0]
    for name in CONFIGS:
        run, want = result["solo"][name], result["sync_off"][name]
        assert chosen(run["metrics"]) == chosen(want["metrics"]), name
        assert run["collectives"] == [ALL_REDUCE], name


@with_backend
@with_size
def test_nan_on_one_rank_keeps_the_start_pair_everywhere_then_the_next_call_moves(
    launches, backend, size
):
    """A NaN makes the group's rho NaN, so every rank keeps the start pair.

    The next, clean call of the same losses takes the union's pair again.
    """
    result = results(launches, backend, "nonfinite", size)
    datas, moved = [rank_result["data"] for rank_result in result], []
    for name in CONFIGS:
        kwargs = loss_kwargs(name)
        start = (kwargs["ratio_lower_start"], kwargs["ratio_upper_start"], 0)
        want = oracle.search(oracle.union_tokens(datas), kwargs)
        moved.append(want != start)
        for rank, rank_result in enumerate(result):
            nan, clean = rank_result["nan"][name], rank_result["clean"][name]
            assert chosen(nan["metrics"]) == start, (name, rank)
            assert nan["metrics"]["bapo_positive_contribution"] == "nan", (name, rank)
            assert rank == size - 1 or math.isfinite(nan["loss"]), (name, rank)
            assert chosen(clean["metrics"]) == want, (name, rank)
    assert any(moved), "the clean union must move the search, for the NaN to stop it"


@with_backend
@with_size
def test_overflowing_ratios_take_the_union_pair_of_eq8_in_every_dtype(launches, backend, size):
    """Ratios of e^12 and e^20 (inf in float16) on tokens of each sign, on every rank.

    Every rank's pair and rho equal the literal Algorithm 1 on the union of the tokens as the
    loss sees them in that dtype (their ratios computed on the ranks, under the launch's pinned
    numerics), with bounds rounded as torch.clamp rounds them.
    """
    result = results(launches, backend, "overflow", size)
    for key, dtype in ((key, DTYPES[key.split()[0]]) for key in result[0]):
        union = [tuple(t) for rank in result for t in rank[key]["tokens"]]
        bound = oracle.rounded_to(dtype)
        for name in result[0][key]["runs"]:
            want = oracle.search(union, loss_kwargs(name), bound=bound)
            rho = oracle.rho(union, *map(bound, want[:2]))
            for rank, rank_result in enumerate(result):
                metrics = rank_result[key]["runs"][name]["metrics"]
                assert chosen(metrics) == want, (key, name, rank)
                got = metrics["bapo_positive_contribution"]
                assert got == pytest.approx(rho, rel=1e-9, abs=0), (key, name, rank)


def test_by_hand_check_two_ranks():
    """The DP worker's by-hand mode with 2 ranks and 2 calls: exits 0 and reports agreement."""
    code, out, err, seconds = torchrun(
        2, "scripts.harness.dp_worker", ["by-hand", "--calls", "2"], 150
    )
    assert code == 0, f"exit {code} after {seconds:.0f} s\n{tail(out)}\n{tail(err)}"
    lines = [line for line in out.splitlines() if line.startswith("call ")]
    assert len(lines) == 2 and all(line.endswith("agree: yes") for line in lines), lines
