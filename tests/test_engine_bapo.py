"""BAPO inside verl 0.8's real FSDP training engine, on CPU with gloo.

``FSDPEngineWithLMHead.train_batch`` splits each rank's batch into micro-batches, runs the
model, and calls Trinity's ``TrinityPolicyLoss`` with ``dp_group=`` the engine's own
data-parallel group, as in a Trinity training job. The worker
(``tests/engine_checks.py engine``) records every call BAPO receives; here we check that

- every call received the engine's group (WORLD, or with Ulysses SP the mesh's ``dp`` groups);
- every rank of a group chose the same pair at every call, and that pair, its step count,
  rho and the loss equal the literal oracle (``bapo_reference``) run on the union of the
  group's micro-batches of that call (``compare_to_union`` of the distributed tests);
- the controls really fail the agreement check: ``sync_across_dp: false``, and the released
  ``TrinityPolicyLoss`` (patch 0002 reverted in a temporary copy of ``losses.py``), which
  drops the group, so BAPO warns and every rank searches alone.

Each strategy is one ``torchrun`` launch under a timeout, shared by its tests.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from dist_oracle import compare_to_union
from scripts.harness.launch import REPO, rank_records, torchrun

TESTS = REPO / "tests"

LAUNCH_TIMEOUT_S = 240  # a launch takes 10-40 s here; beyond this something hangs
LOSSES = "trinity/trainer/verl/losses.py"

# name: (ranks, strategy, Ulysses SP size, phases)
LAUNCHES = {
    "fsdp2": (2, "fsdp2", 1, "sync,authors,nosync,released"),
    "fsdp1": (2, "fsdp", 1, "sync"),
    "ulysses": (4, "fsdp2", 2, "sync,nosync"),
}


def released_losses(folder: Path) -> Path:
    """A copy of the installed ``losses.py`` with the patch that forwards dp_group reverted."""
    import trinity

    installed = Path(trinity.__file__).resolve().parent.parent / LOSSES
    patch = next(REPO.glob("patches/*engine-loss-forwards-dp-group*.patch"))
    copy = folder / LOSSES  # the patch's own path, so `git apply` finds it under `folder`
    copy.parent.mkdir(parents=True)
    shutil.copyfile(installed, copy)
    subprocess.run(["git", "apply", "--reverse", str(patch)], cwd=folder, check=True)
    assert copy.read_text() != installed.read_text()
    assert "dp_group=dp_group" not in copy.read_text()
    return copy


class EngineLaunches:
    """One torchrun launch per entry of LAUNCHES, made on first use."""

    def __init__(self, root: Path):
        """Launch outputs go under ``root``."""
        self.root = root
        self.done: dict = {}

    def records(self, name):
        """Per-rank records of launch ``name``; fails with the workers' errors."""
        if name not in self.done:
            ranks, strategy, sp, phases = LAUNCHES[name]
            out = self.root / name
            out.mkdir()
            argv = ["engine", "--out", out, "--strategy", strategy, "--sp", sp]
            argv += ["--phases", phases]
            if "released" in phases:
                argv += ["--released-losses", released_losses(out)]
            launch = torchrun(ranks, "engine_checks", argv, LAUNCH_TIMEOUT_S, path=TESTS)
            self.done[name] = (launch.code, launch.err, launch.seconds, rank_records(out, ranks))
        code, err, seconds, records = self.done[name]
        problems = [f"rank {r}: no result" for r, rec in enumerate(records) if rec is None]
        problems += [
            f"rank {r}:\n{rec['error']}" for r, rec in enumerate(records) if rec and "error" in rec
        ]
        status = "timed out" if code is None else f"exit code {code}"
        assert code == 0 and not problems, (
            f"{name}: {status} after {seconds:.0f} s\n" + "\n".join(problems) + "\n" + err[-3000:]
        )
        return records

    def calls(self, name, phase):
        """Per rank, the list of BAPO calls recorded in one phase."""
        return [record["phases"][phase]["calls"] for record in self.records(name)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return EngineLaunches(tmp_path_factory.mktemp("engine"))


def groups_of(calls_by_rank):
    """The distinct groups (tuples of global ranks) the loss received, over all calls."""
    return {tuple(c["group_ranks"] or ()) for calls in calls_by_rank for c in calls}


def group_problems(calls_by_rank, config_name):
    """Per call and group: agreement and the union oracle, as compare_to_union reports them."""
    counts = {len(calls) for calls in calls_by_rank}
    assert len(counts) == 1 and counts != {0}, f"loss calls per rank: {counts}"
    problems = []
    for i in range(counts.pop()):
        for group in groups_of([[calls[i]] for calls in calls_by_rank]):
            metrics = [calls_by_rank[r][i]["metrics"] for r in group]
            datas = [calls_by_rank[r][i]["data"] for r in group]
            problems += [
                f"call {i}, group {group}: {p}"
                for p in compare_to_union(metrics, datas, config_name)
            ]
    return problems


def pairs_by_call(calls_by_rank):
    """For each call, the pairs the ranks chose, rank by rank."""
    return [
        [(c["metrics"]["bapo_clip_low"], c["metrics"]["bapo_clip_high"]) for c in calls]
        for calls in zip(*calls_by_rank)
    ]


def all_agree(calls_by_rank):
    return all(len(set(pairs)) == 1 for pairs in pairs_by_call(calls_by_rank))


def moved(calls_by_rank, start):
    """Whether some call left the start pair (else agreement would be trivial)."""
    return any(pair != start for pairs in pairs_by_call(calls_by_rank) for pair in pairs)


PAPER_START = (0.6, 1.2)


@pytest.mark.parametrize(
    "name,phase,config",
    [
        ("fsdp2", "sync", "paper_upper_gradient"),
        ("fsdp2", "authors", "yaml_lower_surrogate"),
        ("fsdp1", "sync", "paper_upper_gradient"),
    ],
)
def test_engine_group_reaches_bapo_and_ranks_pick_the_union_pair(engine, name, phase, config):
    calls = engine.calls(name, phase)
    assert all(c["is_engine_group"] for rank in calls for c in rank), "a call lacked the group"
    assert groups_of(calls) == {(0, 1)}
    assert moved(calls, PAPER_START), "the search never moved: the data cannot tell"
    assert all_agree(calls)
    problems = group_problems(calls, config)
    assert not problems, "\n".join(problems)


def test_ulysses_sub_groups_reach_bapo_and_agree(engine):
    """SP=2 on 4 ranks: BAPO gets the mesh's dp groups {0, 2} and {1, 3}, never WORLD."""
    calls = engine.calls("ulysses", "sync")
    assert all(c["is_engine_group"] for rank in calls for c in rank)
    assert groups_of(calls) == {(0, 2), (1, 3)}
    assert moved(calls, PAPER_START)
    assert all_agree(calls), pairs_by_call(calls)
    problems = group_problems(calls, "paper_upper_gradient")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", ["fsdp2", "ulysses"])
def test_control_sync_off_disagrees(engine, name):
    """With sync_across_dp false the same engine path leaves each rank to its own pair."""
    calls = engine.calls(name, "nosync")
    assert all(c["is_engine_group"] for rank in calls for c in rank)
    assert not all_agree(calls), pairs_by_call(calls)


def test_control_released_losses_drops_the_group_and_disagrees(engine):
    """Without patch 0002 the engine's group never reaches BAPO: it warns, ranks differ."""
    records = engine.records("fsdp2")
    calls = [record["phases"]["released"]["calls"] for record in records]
    assert groups_of(calls) == {()}, "the released TrinityPolicyLoss passed a group"
    assert all(
        any("sync_across_dp" in w for w in r["phases"]["released"]["warnings"]) for r in records
    )
    assert not all_agree(calls), pairs_by_call(calls)
