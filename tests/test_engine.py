"""BAPO inside verl 0.8's real FSDP training engine and Trinity's actor worker (CPU, gloo).

The engine splits each rank's batch into micro-batches and calls ``TrinityPolicyLoss`` with its
own data-parallel group, as in a Trinity job. Every call must receive that group (WORLD, or with
Ulysses SP the mesh's ``dp`` groups), and every rank of a group must choose the union oracle's
pair, steps, rho and loss at every call; the controls (sync off, the released ``losses.py``)
must disagree. The ``worker`` check takes a Trinity YAML through ``load_config``,
``build_verl_config`` and ``TrinityActorRolloutRefWorker`` to one ``update_actor`` (only Ray is
bypassed); with ``use_dynamic_bsz`` one rank's longer sequences need more micro-batches, and the
engine must raise the other's count to match. The gradient the engine hands its optimizer, after
FSDP's reduction, must equal one process's gradient at the union's pairs (``grad_oracle`` in
``tests/engine_checks.py`` states verl's scaling). With ``search_scope: update``, every call of
an update must take the oracle's pair on the whole update's data, whatever the micro-batch split,
and a rank failing in the pass must make every rank raise; PPO set on the same worker after it
must train. Two launches: 2 ranks, and 4 for Ulysses.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from scripts.harness.launch import REPO
from tests.engine_checks import PHASES, STEPS, UPDATE_PHASES
from tests.inputs import BAPO_METRICS, PAPER_START, chosen, loss_kwargs
from tests.oracle import compare_to_union, pairs_by_call, search, union_tokens

LOSSES = "trinity/trainer/verl/losses.py"
RANKS = 2
# fp32 on both sides; the engine's packed forward and FSDP's reduction only reorder float sums
GRAD_RTOL = 1e-5  # of the largest gradient entry
LOG_PROB_ATOL = 1e-5  # the oracle's log-probs against those the loss received
# The model settings a CPU needs (eager attention, fp32, no torch.compile, no tokenizer in the
# tiny model's folder) go through trainer_config, Trinity's way of overriding verl's config.
CONFIG = """\
mode: train
project: bapo-engine-test
name: config-path
checkpoint_root_dir: {root}/checkpoints
algorithm:
  algorithm_type: bapo
  repeat_times: 4
  policy_loss_fn_args:
    sync_across_dp: {sync}
    search_scope: {scope}
model:
  model_path: {root}/model
  max_response_tokens: 6
  max_model_len: 12
cluster:
  node_num: 1
  gpu_per_node: {ranks}
buffer:
  total_epochs: 1
  batch_size: 4
  train_batch_size: 16
trainer:
  trainer_type: verl
  trainer_strategy: fsdp2
  use_dynamic_bsz: true
  max_token_len_per_gpu: 30
  trainer_config:
    model:
      use_remove_padding: false
      load_tokenizer: false
      enable_gradient_checkpointing: false
      override_config:
        attn_implementation: eager
    actor:
      use_torch_compile: false
      fsdp_config:
        mixed_precision:
          param_dtype: fp32
          reduce_dtype: fp32
          buffer_dtype: fp32
"""


# the worker's runs: (name, sync_across_dp, search_scope)
WORKER_RUNS = [("true", "true", "micro_batch"), ("false", "false", "micro_batch")]
WORKER_RUNS.append(("update", "true", "update"))


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


@pytest.fixture(scope="module")
def engine(launches, tmp_path_factory):
    """Per rank, what a check recorded in the 2-rank launch (one launch runs every check)."""
    options = dict(sp=1, phases=",".join([*PHASES, *UPDATE_PHASES]), grads=1)
    options["released_losses"] = released_losses(tmp_path_factory.mktemp("released"))
    for run, sync, scope in WORKER_RUNS:
        root = tmp_path_factory.mktemp(f"run_{run}")
        text = CONFIG.format(root=root, sync=sync, scope=scope, ranks=RANKS)
        (root / "config.yaml").write_text(text)
        options[f"config_{run}"] = root / "config.yaml"
    args = (RANKS, "tests.engine_checks", ["fsdp2", "fsdp1", "worker"])
    return lambda check: launches.check("engine", check, *args, timeout=600, **options)


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
    "check, phase", [("fsdp2", "sync"), ("fsdp2", "authors"), ("fsdp1", "sync")]
)
def test_engine_group_reaches_bapo_and_ranks_pick_the_union_pair(engine, check, phase):
    got = [rank[phase]["calls"] for rank in engine(check)]
    assert_groups_agree_with_their_union(got, PHASES[phase][1], {(0, 1)})


def test_ulysses_sub_groups_reach_bapo_and_agree(launches):
    """SP=2 on 4 ranks: BAPO gets the mesh's dp groups {0, 2} and {1, 3}, never WORLD."""
    args = (4, "tests.engine_checks", ["fsdp2"])
    records = launches.check("ulysses", "fsdp2", *args, timeout=300, sp=2, phases="sync")
    got = [rank["sync"]["calls"] for rank in records]
    assert_groups_agree_with_their_union(got, PHASES["sync"][1], {(0, 2), (1, 3)})


def grad_problems(records, phase, pairs="union", per_update=False) -> list:
    """Where the engine's gradient leaves the oracle's at ``pairs`` (``union`` or ``own``).

    Also where the union's pairs that the oracle computed on the concatenated micro-batches
    differ from the literal search (tests/oracle.py) on the tokens the loss recorded, and where
    the oracle's log-probs differ from those the loss received (the two would then not compare).
    """
    name, _, extra = UPDATE_PHASES[phase] if per_update else (PHASES[phase][1], 0, {})
    problems, kwargs = [], loss_kwargs(name, **extra)
    calls = [rank[phase]["calls"] for rank in records]
    for rank, record in enumerate(records):
        steps = record[phase]["grads"]
        per_step = len(calls[rank]) // len(steps)
        for step, got in enumerate(steps):
            where = f"{phase} rank {rank} step {step}"
            for k, pair in enumerate(got["union_pairs"]):
                i = step * per_step + k
                union = (
                    slice(step * per_step, (step + 1) * per_step) if per_update else slice(i, i + 1)
                )
                literal = search(union_tokens([d["data"] for c in calls for d in c[union]]), kwargs)
                if tuple(pair) != literal[:2]:
                    problems.append(f"{where} call {k}: union pair {pair} != literal {literal}")
            if got["log_prob_max_abs"] > LOG_PROB_ATOL:
                problems.append(f"{where}: log-probs off by {got['log_prob_max_abs']}")
            if not got["engine_max_abs"] > 0:
                problems.append(f"{where}: the engine's gradient is zero")
            if not got[pairs]["max_rel"] <= GRAD_RTOL:
                problems.append(f"{where}: gradient off the {pairs} oracle by {got[pairs]}")
    return problems


@pytest.mark.parametrize("phase", ["sync", "authors"])
def test_engine_grad_equals_one_process_grad_at_the_union_pairs(engine, phase):
    """FSDP2's reduced gradient is one process's at every call's union pair (both orders)."""
    records = engine("fsdp2")
    got = [rank[phase]["calls"] for rank in records]
    pairs = pairs_by_call(got)
    assert any(p != PAPER_START for ps in pairs for p in ps), "the search never moved"
    tokens = [[sum(map(sum, c["data"]["mask"])) for c in calls] for calls in zip(*got)]
    assert any(len(set(t)) > 1 for t in tokens), f"the ranks' micro-batches are even: {tokens}"
    problems = grad_problems(records, phase)
    for rank, record in enumerate(records):  # the ranks' recorded pairs are the union's
        union = [tuple(p) for step in record[phase]["grads"] for p in step["union_pairs"]]
        if [ps[rank] for ps in pairs] != union:
            problems.append(f"rank {rank} chose {[ps[rank] for ps in pairs]}, the union {union}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("phase", ["nosync", "muted"])
def test_control_grad_off_the_union_oracle_where_rank_pairs_differ(engine, phase):
    """Sync off, or BAPO's all-reduce a no-op: each rank's own pair, so not the union gradient.

    The ranks' own pairs differ from the union's at some call, the engine's gradient is the
    oracle's at those own pairs, and off the union oracle beyond the tolerance.
    """
    records = engine("fsdp2")
    pairs = pairs_by_call([rank[phase]["calls"] for rank in records])
    union = [tuple(p) for step in records[0][phase]["grads"] for p in step["union_pairs"]]
    assert any(set(ps) != {u} for ps, u in zip(pairs, union)), (pairs, union)
    assert not all_agree([rank[phase]["calls"] for rank in records]), pairs
    problems = grad_problems(records, phase, pairs="own")
    assert not problems, "\n".join(problems)
    off = grad_problems(records, phase)
    assert any("gradient off the union oracle" in p for p in off), off


def test_control_sync_off_disagrees(engine):
    """With sync_across_dp false the same engine path leaves each rank to its own pair."""
    got = [rank["nosync"]["calls"] for rank in engine("fsdp2")]
    assert all(c["is_engine_group"] for rank in got for c in rank)
    assert not all_agree(got), pairs_by_call(got)


def test_control_released_losses_drops_the_group_and_disagrees(engine):
    """Without the patch that forwards dp_group the engine's group never reaches BAPO."""
    got = [rank["released"]["calls"] for rank in engine("fsdp2")]
    assert groups_of(got) == {()}, "the released TrinityPolicyLoss passed a group"
    assert not all_agree(got), pairs_by_call(got)


@pytest.mark.parametrize("sync", ["true", "false"])
def test_yaml_flag_reaches_the_loss_with_the_engine_group(engine, sync):
    for record in engine("worker"):
        run = record[sync]
        assert run["loss_class"] == "TrinityPolicyLoss"
        assert run["engine_group"] == list(range(RANKS))
        assert run["sync_across_dp"] is (sync == "true")
        assert all(call["group_ranks"] == run["engine_group"] for call in run["calls"])


@pytest.mark.parametrize("sync", ["true", "false"])
def test_dynamic_batching_gives_every_rank_the_same_number_of_calls(engine, sync):
    """The odd rank's longer sequences need more micro-batches; the engine pads the count."""
    runs = [record[sync] for record in engine("worker")]
    own = [run["own_micro_batches"] for run in runs]
    assert len(set(own)) > 1, f"the ranks' token counts do not test equalising: {own}"
    assert [len(run["calls"]) for run in runs] == [max(own)] * RANKS


def test_worker_ranks_agree_at_every_call_with_sync_and_differ_without(engine):
    runs = {
        sync: [record[sync]["calls"] for record in engine("worker")] for sync in ("true", "false")
    }
    pairs = pairs_by_call(runs["true"])
    assert all(len(set(p)) == 1 for p in pairs), pairs
    assert any(p[0] != PAPER_START for p in pairs), "the search never moved: agreement is trivial"
    assert not all_agree(runs["false"]), pairs_by_call(runs["false"])


@pytest.mark.parametrize("sync", ["true", "false"])
def test_update_actor_returns_the_bapo_metrics(engine, sync):
    """Metrics are gathered over the group by verl: one entry per rank and call."""
    runs = [record[sync] for record in engine("worker")]
    metrics = runs[0]["metrics"]
    for name in BAPO_METRICS:
        assert len(metrics[f"actor/{name}"]) == RANKS * len(runs[0]["calls"]), name
    logged = sorted(zip(metrics["actor/bapo_clip_low"], metrics["actor/bapo_clip_high"]))
    used = sorted(pair for pairs in pairs_by_call([run["calls"] for run in runs]) for pair in pairs)
    assert logged == used


UPDATES = list(UPDATE_PHASES)


def updates(calls_by_rank, sizes) -> list:
    """The calls of each optimizer update, per rank; ``sizes``: each update's number of calls."""
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    return [[rank[end - size : end] for rank in calls_by_rank] for size, end in zip(sizes, ends)]


def update_sizes(records) -> list:
    """Each update's number of training calls, the same on every rank (verl evens them)."""
    sizes = [[outcome["calls"] for outcome in record["outcomes"]] for record in records]
    assert all(s == sizes[0] for s in sizes), sizes
    return sizes[0]


def update_problems(calls_by_rank, sizes, name, **extra) -> list:
    """Where a call leaves the pair, rho or loss of one decision on its whole update's data."""
    problems = []
    for step, ranks in enumerate(updates(calls_by_rank, sizes)):
        calls = [call for rank in ranks for call in rank]
        metrics, datas = [c["metrics"] for c in calls], [c["data"] for c in calls]
        found = compare_to_union(metrics, datas, name, **extra)
        problems += [f"update {step}: {p}" for p in found]
    return problems


def per_call_pairs(calls_by_rank, phase) -> list:
    """The pairs that deciding at each call, over the ranks, would take (micro_batch scope)."""
    name, _, extra = UPDATE_PHASES[phase]
    kwargs = loss_kwargs(name, **extra)
    return [
        search(union_tokens([c["data"] for c in calls]), kwargs)[:2]
        for calls in zip(*calls_by_rank)
    ]


@pytest.mark.parametrize("phase", UPDATES)
def test_update_scope_every_call_takes_one_decision_on_the_update_data(engine, phase):
    """Micro-batches of 1, 2, 4 sequences and dynamic bsz, both orders: the update's pair."""
    records = [rank[phase] for rank in engine("fsdp2")]
    calls = [record["calls"] for record in records]
    assert not [o for r in records for o in r["outcomes"] if "raised" in o]
    sizes = update_sizes(records)
    assert all(c["is_engine_group"] for rank in calls for c in rank)
    assert [r["pass_calls"] for r in records] == [len(rank) for rank in calls], "the pass's calls"
    if UPDATE_PHASES[phase][1] == 0:  # dynamic bsz: the ranks' token counts ask apart
        assert len(calls[0]) > STEPS, "dynamic bsz made one micro-batch per update"
    name, _, extra = UPDATE_PHASES[phase]
    problems = update_problems(calls, sizes, name, **extra)
    assert not problems, "\n".join(problems)


def test_update_scope_data_moves_the_search_and_per_call_decisions_leave_it(engine):
    """The control: on this data, deciding at each call would leave the update's pair."""
    left, moved = [], []
    for phase in UPDATES:
        calls = [rank[phase]["calls"] for rank in engine("fsdp2")]
        used = [pairs[0] for pairs in pairs_by_call(calls)]
        moved.append(any(pair != PAPER_START for pair in used))
        left.append(used != per_call_pairs(calls, phase))
    assert all(moved), dict(zip(UPDATES, moved))
    assert sum(left) >= len(UPDATES) - 2, dict(zip(UPDATES, left))  # size 4 may coincide


@pytest.mark.parametrize("phase", [p for p in UPDATES if UPDATE_PHASES[p][1]])
def test_update_scope_engine_grad_equals_one_process_grad_at_the_update_pair(engine, phase):
    records = engine("fsdp2")
    problems = grad_problems(records, phase, per_update=True)
    assert not problems, "\n".join(problems)


def test_worker_update_scope_takes_the_update_pair_at_every_call(engine):
    """From the YAML: set_trinity_config hooks the pass in; every call takes the update's pair."""
    runs = [record["update"] for record in engine("worker")]
    calls = [run["calls"] for run in runs]
    assert [run["pass_calls"] for run in runs] == [len(c) for c in calls]
    assert [run["pass_calls"] for run in (r["true"] for r in engine("worker"))] == [0] * RANKS
    problems = update_problems(calls, [len(calls[0])], "paper_upper")
    assert not problems, "\n".join(problems)
    assert any(chosen(c["metrics"])[:2] != PAPER_START for c in calls[0]), "the search never moved"


def test_worker_trains_ppo_set_after_bapo_per_update(engine):
    """The same worker, set PPO after BAPO with ``search_scope: update``: PPO's update trains."""
    for run in (record["update"] for record in engine("worker")):
        names = run["ppo_after"].get("result")
        assert names and "actor/pg_loss" in names, run["ppo_after"]
        assert not [name for name in names if "bapo" in name], names
