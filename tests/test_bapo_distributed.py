"""BAPO's data-parallel bound search, run for real with torchrun on gloo (CPU).

With ``sync_across_dp`` every rank of the dp group must take the decision that one process
would take on the union of the ranks' tokens. The oracle here is the literal transcription in
``bapo_reference`` run on the concatenated token lists, and the single-process gradient is
recomputed in this process from a loss written from the README's formula, so nothing expected
comes from the code under test.

One torchrun launch per world size (2, 3, 4) runs every check of the harness's DP worker
(``scripts.harness.dp_worker checks``); each rank writes JSON, and each test below reads one check,
so a failure names its check, world size, case, config and rank. A check that raised, or that
a crashed or timed-out launch never reached, fails its tests with the traceback and the
workers' stderr; ``test_launch_ends_cleanly`` fails on any unclean exit.

nccl variants are collected too and skipped unless the machine has a GPU per rank.
"""

import math
from fractions import Fraction

import pytest
import torch

import bapo_reference as ref
import dist_checks as common
from dist_oracle import (
    compare_to_union,
    got_choice,
    locals_differ,
    oracle,
    reference_token_loss,
    tokens_of,
    union_tokens,
)
from scripts.harness.launch import REPO, rank_records, tail, torchrun

WORKER = "scripts.harness.dp_worker"
LAUNCH_TIMEOUT_S = 150  # a launch takes 10-30 s here; beyond this something hangs

BASE_CHECKS = [
    "group_none",
    "oracle",
    "trinity",
    "sync_off",
    "nonfinite",
    "gradient",
    "mismatch",
    "failure",
]
CHECKS_BY_WORLD = {2: BASE_CHECKS, 3: BASE_CHECKS + ["subgroup", "nonmember"], 4: BASE_CHECKS}
WORLDS = sorted(CHECKS_BY_WORLD)
ALL_REDUCE = "c10d.allreduce_.default"
ALL_GATHER = "c10d.allgather_.default"
# The first synchronised call of a loss on a group checks the ranks' settings, then reduces.
FIRST_CALL = [ALL_GATHER, ALL_REDUCE]
HEADER = 2  # values before the candidates' sums: failed ranks, non-finite tokens


def grid_length(start, maximum, step, cap):
    """Candidates start + k step <= maximum (plus the capped maximum), in exact arithmetic."""
    a, b, d = (Fraction(repr(float(x))) for x in (start, maximum, step))
    if a == b:
        return 1
    count = math.floor((b - a) / d) + 1
    return count + int(cap and a + (count - 1) * d < b)


def values_per_call(name):
    """What one all-reduce may carry for config ``name``: the header and every candidate."""
    kw = common.loss_kwargs(name)
    cap = kw["search_order"] == "lower_first"
    lower = grid_length(kw["ratio_lower_start"], kw["ratio_lower_max"], kw["ratio_lower_step"], cap)
    upper = grid_length(kw["ratio_upper_start"], kw["ratio_upper_max"], kw["ratio_upper_step"], cap)
    return HEADER + lower + upper


# --------------------------------------------------------------------------- launching


def _backend_available(backend, world):
    if backend == "gloo":
        return True
    return torch.cuda.is_available() and torch.cuda.device_count() >= max(2, world)


class Launches:
    """One launch per (world, backend), made on first use and shared by the module."""

    def __init__(self, tmp_root):
        """Keep launches under ``tmp_root``."""
        self.tmp_root = tmp_root
        self.done = {}

    def records(self, world, backend):
        """Return (exit code, stderr, seconds, per-rank records) of one launch."""
        if not _backend_available(backend, world):
            pytest.skip(f"{backend} with {world} ranks needs {max(2, world)} CUDA devices")
        key = (world, backend)
        if key not in self.done:
            out = self.tmp_root / f"w{world}_{backend}"
            out.mkdir()
            argv = ["checks", "--out", out, "--backend", backend]
            argv += ["--checks", ",".join(CHECKS_BY_WORLD[world])]
            code, _, err, seconds = torchrun(
                world, WORKER, argv, LAUNCH_TIMEOUT_S, path=REPO / "tests"
            )
            self.done[key] = (code, err, seconds, rank_records(out, world))
        return self.done[key]

    def check(self, world, backend, name):
        """Per-rank results of one check, or a failure that says what went wrong where."""
        code, err, seconds, records = self.records(world, backend)
        where = f"torchrun {world} ranks ({backend}), check {name!r}"
        status = "timed out" if code is None else f"exit code {code}"
        problems = []
        for rank, record in enumerate(records):
            result = None if record is None else record["checks"].get(name)
            if result is None:
                problems.append(f"rank {rank}: no result ({status} after {seconds:.0f} s)")
            elif "error" in result:
                problems.append(f"rank {rank} raised:\n{result['error']}")
        if problems:
            pytest.fail(
                f"{where}:\n"
                + "\n".join(problems)
                + f"\n--- workers' stderr (tail) ---\n{tail(err)}"
            )
        return [record["checks"][name] for record in records]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return Launches(tmp_path_factory.mktemp("bapo_dist"))


# nccl needs one GPU per rank; the worlds beyond 2 skip inside Launches.records as well.
with_backend = pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(
                not _backend_available("nccl", 2), reason="nccl needs >= 2 CUDA devices"
            ),
        ),
    ],
)


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_launch_ends_cleanly(launches, world, backend):
    """Every check ran and torchrun exited 0 (a check's own test reports its failure)."""
    code, err, seconds, records = launches.records(world, backend)
    status = "timed out" if code is None else f"exit code {code}"
    assert code == 0, f"{world} ranks: {status} after {seconds:.0f} s\n{tail(err)}"
    for rank, record in enumerate(records):
        assert record is not None and list(record["checks"]) == CHECKS_BY_WORLD[world], rank


# --------------------------------------------------------------------------- oracle side

# --------------------------------------------------------------------------- the test data


@pytest.mark.parametrize("world", WORLDS)
def test_cases_discriminate_synced_from_local(world):
    """For every config some case has a rank whose own choice differs from the union's.

    Otherwise a loss that skipped the all-reduce would pass the oracle tests below.
    """
    missing = []
    for name in common.CONFIGS:
        datas_by_case = [
            [common.case_to_lists(common.make_case(case, r, world)) for r in range(world)]
            for case in common.CASES
        ]
        if not any(locals_differ(datas, name) for datas in datas_by_case):
            missing.append(name)
    assert not missing, f"{world} ranks: no case tells synced from local for {missing}"


# --------------------------------------------------------------------------- synced choice


def union_problems(result, prefix=""):
    """Every case x config of one check, each rank's metrics against the union oracle."""
    problems = []
    for case in common.CASES:
        datas = [rank_result[case]["data"] for rank_result in result]
        for name in common.CONFIGS:
            metrics = [rank_result[case]["runs"][name]["metrics"] for rank_result in result]
            problems += [f"{case}: {p}" for p in compare_to_union(metrics, datas, name, prefix)]
    return problems


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_chooses_the_union_pair(launches, world, backend):
    """Call BAPOPolicyLossFn with dp_group=WORLD: all cases x configs against the oracle."""
    problems = union_problems(launches.check(world, backend, "oracle"))
    assert not problems, "\n".join(problems)


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_trinity_policy_loss_forwards_the_group(launches, world, backend):
    """Call TrinityPolicyLoss on the engine's (model_output, data) layout, group forwarded."""
    problems = union_problems(launches.check(world, backend, "trinity"), "actor/")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- collectives


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_one_all_reduce_per_synced_call(launches, world, backend):
    """A loss's first synced call on a group checks settings; each later one is one all_reduce.

    The later all-reduces carry exactly the header and the candidates' sums (direct calls and
    calls through Trinity, which reuse one loss per config over the cases).
    """
    problems = []
    for check in ("oracle", "trinity"):
        for rank, rank_result in enumerate(launches.check(world, backend, check)):
            for index, case in enumerate(common.CASES):
                for name, run in rank_result[case]["runs"].items():
                    want = FIRST_CALL if index == 0 else [ALL_REDUCE]
                    if run["collectives"] != want:
                        problems.append(f"{check}/{case}/{name} rank {rank}: {run['collectives']}")
                    sent = run["values"][-1]
                    if sent != values_per_call(name):
                        problems.append(f"{check}/{case}/{name} rank {rank}: {sent} values")
    for rank, rank_result in enumerate(launches.check(world, backend, "nonfinite")):
        for name, run in rank_result["runs"].items():
            if run["collectives"] != FIRST_CALL:
                problems.append(f"nonfinite/{name} rank {rank}: {run['collectives']}")
    for rank, rank_result in enumerate(launches.check(world, backend, "gradient")):
        for name, runs in rank_result["runs"].items():
            if runs["sync"]["collectives"] != FIRST_CALL:
                problems.append(f"gradient/{name} rank {rank}: {runs['sync']['collectives']}")
    assert not problems, "\n".join(problems)


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_no_collective_without_sync(launches, world, backend):
    """Sync off and group None: the loss issues no collective at all."""
    problems = []
    for rank, rank_result in enumerate(launches.check(world, backend, "sync_off")):
        for name, run in rank_result["runs"].items():
            if run["collectives"]:
                problems.append(f"sync_off/{name} rank {rank}: {run['collectives']}")
    for rank, rank_result in enumerate(launches.check(world, backend, "gradient")):
        for name, runs in rank_result["runs"].items():
            if runs["nosync"]["collectives"]:
                problems.append(f"gradient/{name} rank {rank}: {runs['nosync']['collectives']}")
    for rank, rank_result in enumerate(launches.check(world, backend, "group_none")):
        for i, call in enumerate(rank_result["calls"]):
            if call["collectives"]:
                problems.append(f"group_none call {i} rank {rank}: {call['collectives']}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- groups


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_group_none_warns_once_and_stays_local(launches, world, backend):
    result = launches.check(world, backend, "group_none")
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
    result = launches.check(SUBGROUP_WORLD, backend, "subgroup")
    datas = [rank_result["data"] for rank_result in result]
    assert all(rank_result["passed_barrier"] for rank_result in result)
    assert result[2]["pair"] == {} and result[2]["solo"] == {}
    problems = []
    for name in common.CONFIGS:
        metrics = [result[rank]["pair"][name]["metrics"] for rank in (0, 1)]
        problems += compare_to_union(metrics, datas[:2], name)
        for rank in (0, 1):
            if result[rank]["pair"][name]["collectives"] != FIRST_CALL:
                problems.append(f"{name} rank {rank}: {result[rank]['pair'][name]['collectives']}")
    assert not problems, "\n".join(problems)
    # The data must tell the pair's union from WORLD's union and from each rank alone.
    pair_union = {n: oracle(union_tokens(datas[:2]), n)[:2] for n in common.CONFIGS}
    world_union = {n: oracle(union_tokens(datas), n)[:2] for n in common.CONFIGS}
    assert pair_union != world_union, "data cannot tell a {0,1} reduce from a WORLD reduce"
    assert any(locals_differ(datas[:2], n) for n in common.CONFIGS)


@with_backend
def test_size_one_group_is_local_and_silent(launches, backend):
    result = launches.check(SUBGROUP_WORLD, backend, "subgroup")
    solo = result[0]["solo"]
    for name in common.CONFIGS:
        want = oracle(tokens_of(result[0]["data"]), name)
        assert got_choice(solo[name]["metrics"]) == want, name
        assert solo[name]["collectives"] == [], name


@with_backend
def test_rank_outside_the_group_raises(launches, backend):
    """A rank that passes a group it is not in gets a clear error, not a silent solo search."""
    result = launches.check(SUBGROUP_WORLD, backend, "nonmember")
    assert "result" in result[0] and "result" in result[1], result[:2]
    assert result[2].get("raised") == "RuntimeError", result[2]
    assert "not a member of the dp_group" in result[2]["message"], result[2]


# --------------------------------------------------------------------------- settings


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_ranks_with_different_settings_raise_everywhere(launches, world, backend):
    """One setting changed on the last rank: every rank raises, naming BAPO's settings.

    The control, where every rank has the same settings, must run through and agree.
    """
    result = launches.check(world, backend, "mismatch")
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


# --------------------------------------------------------------------------- failures


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_bad_inputs_on_one_rank_raise_on_every_rank_in_that_call(launches, world, backend):
    """The last rank's shapes are wrong in call 2 of 3: no rank returns from that call.

    The bad rank raises its own ValueError, the others a RuntimeError naming it; in call 3,
    with good inputs everywhere, every rank again takes the union's pair (nothing off by one).
    """
    result = launches.check(world, backend, "failure")
    datas = [rank_result["data"] for rank_result in result]
    name = "paper_upper_surrogate"
    want = oracle(union_tokens(datas), name)
    for rank, rank_result in enumerate(result):
        first, failed, after = rank_result["calls"]
        for outcome in (first, after):
            assert "result" in outcome, (rank, outcome)
            assert got_choice(outcome["result"]["metrics"]) == want, rank
            assert outcome["result"]["collectives"][-1] == ALL_REDUCE, rank
        if rank == world - 1:
            assert failed.get("raised") == "ValueError", failed
            assert "must share one shape" in failed["message"], failed
        else:
            assert failed.get("raised") == "RuntimeError", (rank, failed)
            assert f"failed on global rank(s) [{world - 1}]" in failed["message"], failed
    assert locals_differ(datas, name), "data cannot tell a local choice from a synced one"


# --------------------------------------------------------------------------- sync off


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_sync_off_ranks_diverge(launches, world, backend):
    """The tests can see divergence: without sync each rank takes its own local choice."""
    result = launches.check(world, backend, "sync_off")
    for name in common.CONFIGS:
        pairs = [got_choice(r["runs"][name]["metrics"])[:2] for r in result]
        assert len(set(pairs)) > 1, f"{name}: every rank chose {pairs[0]} without sync"
        for rank, rank_result in enumerate(result):
            want = oracle(tokens_of(rank_result["data"]), name)
            assert got_choice(rank_result["runs"][name]["metrics"]) == want, (name, rank)


# --------------------------------------------------------------------------- non-finite


@with_backend
@pytest.mark.parametrize("world", WORLDS)
def test_nonfinite_on_one_rank_keeps_start_pair_everywhere(launches, world, backend):
    result = launches.check(world, backend, "nonfinite")
    problems = []
    for name in common.CONFIGS:
        kw = common.loss_kwargs(name)
        start = (kw["ratio_lower_start"], kw["ratio_upper_start"], 0)
        for rank, rank_result in enumerate(result):
            run = rank_result["runs"][name]
            got, count = got_choice(run["metrics"]), run["metrics"]["bapo_nonfinite_tokens"]
            if got != start:
                problems.append(f"{name} rank {rank}: {got} != start pair {start}")
            if count != rank_result["expected_nonfinite"]:
                problems.append(
                    f"{name} rank {rank}: bapo_nonfinite_tokens {count} != "
                    f"{rank_result['expected_nonfinite']}"
                )
            if rank != world - 1 and not math.isfinite(run["loss"]):
                problems.append(f"{name} rank {rank} (all finite): loss {run['loss']}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- gradients


def union_gradient(result, name):
    """Single-process gradient: token-mean over the union at the union oracle's pair."""
    kw = common.loss_kwargs(name)
    params = {
        k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
        for k, v in result[0]["params"].items()
    }
    pieces, tokens = [], []
    for rank_result in result:
        batch = rank_result["batch"]
        prev, target = torch.tensor(batch["prev"]), torch.tensor(batch["target"])
        adv = torch.tensor(batch["advantages"], dtype=torch.float64)
        mask = torch.tensor(batch["mask"]).bool()
        logprob = common.tiny_policy_logprob(params, prev, target)
        old = logprob.detach() - torch.tensor(batch["log_ratio"], dtype=torch.float64)
        tokens += ref.token_lists(logprob.detach(), old, mask, adv)
        pieces.append((logprob, old, adv, mask))
    low, high, _ = oracle(tokens, name)
    total, count = 0.0, 0
    for logprob, old, adv, mask in pieces:
        ratio = torch.exp(torch.clamp(logprob - old, -20.0, 20.0))
        total = total + reference_token_loss(ratio, adv, low, high, kw["clip_ratio_c"])[mask].sum()
        count += int(mask.sum())
    (total / count).backward()
    return (low, high), {k: v.grad for k, v in params.items()}


def _max_gap(got, want):
    return max(
        float((torch.tensor(got[k], dtype=torch.float64) - want[k]).abs().max()) for k in want
    )


@with_backend
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["paper_upper_surrogate", "paper_lower_gradient"])
def test_gradient_with_sync_equals_union_gradient(launches, world, backend, name):
    result = launches.check(world, backend, "gradient")
    pair, want = union_gradient(result, name)
    for rank, rank_result in enumerate(result):
        run = rank_result["runs"][name]["sync"]
        assert got_choice(run["metrics"])[:2] == pair, f"rank {rank}"
        gap = _max_gap(run["grad"], want)
        assert gap < 1e-9, f"rank {rank}: averaged gradient is {gap:.3g} off the union's"


@with_backend
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["paper_upper_surrogate", "paper_lower_gradient"])
def test_gradient_without_sync_differs(launches, world, backend, name):
    result = launches.check(world, backend, "gradient")
    _, want = union_gradient(result, name)
    pairs = {got_choice(r["runs"][name]["nosync"]["metrics"])[:2] for r in result}
    assert len(pairs) > 1, f"ranks agree without sync: {pairs}"
    scale = max(float(g.abs().max()) for g in want.values())
    gap = _max_gap(result[0]["runs"][name]["nosync"]["grad"], want)
    assert gap > 1e-3 * scale, f"unsynced gradient within {gap:.3g} of the union's"


# --------------------------------------------------------------------------- by-hand script


def test_by_hand_check_two_ranks():
    """The DP worker's by-hand mode with 2 ranks and 2 calls: exits 0 and reports agreement.

    Rank 0's batch is balanced and rank 1's mostly negative, so alone they choose different
    pairs: agreement on every call needs the all-reduce, and the same run with ``--no-sync``
    must report disagreement.
    """
    lines = {}
    for flags in ([], ["--no-sync"]):
        code, out, err, seconds = torchrun(2, WORKER, ["by-hand", "--calls", "2", *flags], 150)
        assert code == 0, f"exit {code} after {seconds:.0f} s\n{tail(out)}\n{tail(err)}"
        lines[bool(flags)] = [line for line in out.splitlines() if line.startswith("call ")]
    assert len(lines[False]) == 2 and all(line.endswith("agree: yes") for line in lines[False])
    assert any(line.endswith("agree: NO") for line in lines[True]), lines[True]
