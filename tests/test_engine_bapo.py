"""BAPO inside verl 0.8's real FSDP training engine, on CPU with gloo (check ``engine``).

The engine splits each rank's batch into micro-batches and calls ``TrinityPolicyLoss`` with its
own data-parallel group, as in a Trinity job. Every call must receive that group (WORLD, or with
Ulysses SP the mesh's ``dp`` groups), and every rank of a group must choose the union oracle's
pair, steps, rho and loss at every call; the controls (sync off, the released ``losses.py``)
must disagree.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from bapo_inputs import PAPER_START
from dist_oracle import compare_to_union, pairs_by_call
from scripts.harness.launch import REPO

LOSSES = "trinity/trainer/verl/losses.py"
# name: (ranks, strategy, Ulysses SP size, phases)
LAUNCHES = {
    "fsdp2": (2, "fsdp2", 1, "sync,authors,nosync,released"),
    "fsdp1": (2, "fsdp", 1, "sync"),
    "ulysses": (4, "fsdp2", 2, "sync"),
}


def released_losses(folder: Path) -> Path:
    """A copy of the installed ``losses.py`` with the patch that forwards dp_group reverted."""
    import trinity

    installed = Path(trinity.__file__).resolve().parent.parent / LOSSES
    patch = next(REPO.glob("patches/*engine-loss-forwards-dp-group*.patch"))
    copy = folder / LOSSES  # the patch's own path, so that `git apply` finds it under `folder`
    copy.parent.mkdir(parents=True)
    shutil.copyfile(installed, copy)
    subprocess.run(["git", "apply", "--reverse", str(patch)], cwd=folder, check=True)
    assert "dp_group=dp_group" not in copy.read_text()
    return copy


def engine_run(launches, tmp_path_factory, name):
    """Per rank, the ``engine`` check's record of launch ``name``."""
    ranks, strategy, sp, phases = LAUNCHES[name]
    released = released_losses(tmp_path_factory.mktemp("released")) if "released" in phases else ""
    options = dict(strategy=strategy, sp=sp, phases=phases, released_losses=released)
    args = (ranks, "engine_checks", ["engine"])
    return launches.check(f"engine_{name}", "engine", *args, timeout=240, **options)


def calls(launches, tmp_path_factory, name, phase):
    """Per rank, the BAPO calls recorded in one phase."""
    return [r["phases"][phase]["calls"] for r in engine_run(launches, tmp_path_factory, name)]


def groups_of(calls_by_rank):
    """The distinct groups (tuples of global ranks) the loss received, over all calls."""
    return {tuple(c["group_ranks"] or ()) for calls in calls_by_rank for c in calls}


def all_agree(calls_by_rank):
    return all(len(set(pairs)) == 1 for pairs in pairs_by_call(calls_by_rank))


def assert_groups_agree_with_their_union(calls_by_rank, config_name, groups):
    """The engine's groups reached BAPO, moved the search, and chose the union pair per call."""
    assert all(c["is_engine_group"] for rank in calls_by_rank for c in rank)
    assert groups_of(calls_by_rank) == groups
    pairs = pairs_by_call(calls_by_rank)  # as many calls on every rank
    assert pairs and any(p != PAPER_START for ps in pairs for p in ps), "the search never moved"
    assert all_agree(calls_by_rank), pairs
    problems = []
    for i in range(len(pairs)):
        for group in groups:
            metrics = [calls_by_rank[r][i]["metrics"] for r in group]
            datas = [calls_by_rank[r][i]["data"] for r in group]
            problems += [
                f"call {i}, group {group}: {p}"
                for p in compare_to_union(metrics, datas, config_name)
            ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "name,phase,config",
    [
        ("fsdp2", "sync", "paper_upper_gradient"),
        ("fsdp2", "authors", "yaml_lower_surrogate"),
        ("fsdp1", "sync", "paper_upper_gradient"),
    ],
)
def test_engine_group_reaches_bapo_and_ranks_pick_the_union_pair(
    launches, tmp_path_factory, name, phase, config
):
    got = calls(launches, tmp_path_factory, name, phase)
    assert_groups_agree_with_their_union(got, config, {(0, 1)})


def test_ulysses_sub_groups_reach_bapo_and_agree(launches, tmp_path_factory):
    """SP=2 on 4 ranks: BAPO gets the mesh's dp groups {0, 2} and {1, 3}, never WORLD."""
    got = calls(launches, tmp_path_factory, "ulysses", "sync")
    assert_groups_agree_with_their_union(got, "paper_upper_gradient", {(0, 2), (1, 3)})


def test_control_sync_off_disagrees(launches, tmp_path_factory):
    """With sync_across_dp false the same engine path leaves each rank to its own pair."""
    got = calls(launches, tmp_path_factory, "fsdp2", "nosync")
    assert all(c["is_engine_group"] for rank in got for c in rank)
    assert not all_agree(got), pairs_by_call(got)


def test_control_released_losses_drops_the_group_and_disagrees(launches, tmp_path_factory):
    """Without patch 0002 the engine's group never reaches BAPO: it warns, ranks differ."""
    phases = [r["phases"]["released"] for r in engine_run(launches, tmp_path_factory, "fsdp2")]
    got = [phase["calls"] for phase in phases]
    assert groups_of(got) == {()}, "the released TrinityPolicyLoss passed a group"
    assert all(any("sync_across_dp" in w for w in phase["warnings"]) for phase in phases)
    assert not all_agree(got), pairs_by_call(got)
