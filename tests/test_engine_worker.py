"""From a Trinity YAML file to BAPO's decision, through Trinity's actor worker (CPU, gloo).

The ``worker`` check of ``tests/engine_checks.py`` takes the YAML below through ``load_config``,
``build_verl_config`` and ``TrinityActorRolloutRefWorker`` on 2 ranks, then one
``update_actor``; only Ray is bypassed. With ``use_dynamic_bsz`` the engine packs micro-batches
by tokens, and since one rank holds longer sequences, it must raise the other's count to match.
Checked: the YAML's ``sync_across_dp`` reaches the loss; with it on, every call gets the engine's
group and the ranks agree at every call, with it off they differ; the metrics come back.
"""

import pytest

from bapo_inputs import BAPO_METRICS
from dist_oracle import pairs_by_call

RANKS = 2

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
    contribution: gradient
    sync_across_dp: {sync}
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


@pytest.fixture(scope="module")
def runs(launches, tmp_path_factory):
    """One update_actor per value of sync_across_dp written in the YAML."""
    results = {}
    for sync in (True, False):
        root = tmp_path_factory.mktemp(f"sync_{sync}")
        path = root / "config.yaml"
        path.write_text(CONFIG.format(root=root, sync=str(sync).lower(), ranks=RANKS))
        key = f"worker_sync_{sync}"
        args = (RANKS, "engine_checks", ["worker"])
        results[sync] = launches.check(key, "worker", *args, timeout=300, config=path)
    return results


def pairs_per_call(records):
    calls = [record["calls"] for record in records]
    assert calls[0], "no loss call"
    return pairs_by_call(calls)


@pytest.mark.parametrize("sync", [True, False])
def test_yaml_flag_reaches_the_loss_with_the_engine_group(runs, sync):
    for record in runs[sync]:
        assert record["loss_class"] == "TrinityPolicyLoss"
        assert record["engine_group"] == list(range(RANKS))
        assert record["sync_across_dp"] is sync
        for call in record["calls"]:
            assert call["group_ranks"] == record["engine_group"]


def test_dynamic_batching_gives_every_rank_the_same_number_of_calls(runs):
    """The odd rank's longer sequences need more micro-batches; the engine pads the count."""
    for records in runs.values():
        own = [record["own_micro_batches"] for record in records]
        assert len(set(own)) > 1, f"the ranks' token counts do not test equalising: {own}"
        assert [len(record["calls"]) for record in records] == [max(own)] * RANKS


def test_sync_on_ranks_agree_at_every_call(runs):
    pairs = pairs_per_call(runs[True])
    assert all(len(set(p)) == 1 for p in pairs), pairs
    assert any(p[0] != (0.6, 1.2) for p in pairs), "the search never moved: agreement is trivial"


def test_sync_off_ranks_differ(runs):
    pairs = pairs_per_call(runs[False])
    assert any(len(set(p)) > 1 for p in pairs), pairs


@pytest.mark.parametrize("sync", [True, False])
def test_update_actor_returns_the_bapo_metrics(runs, sync):
    """Metrics are gathered over the group by verl: one entry per rank and call."""
    records = runs[sync]
    metrics = records[0]["metrics"]
    for name in BAPO_METRICS:
        assert len(metrics[f"actor/{name}"]) == RANKS * len(records[0]["calls"]), name
    logged = sorted(zip(metrics["actor/bapo_clip_low"], metrics["actor/bapo_clip_high"]))
    used = sorted(pair for pairs in pairs_per_call(records) for pair in pairs)
    assert logged == used
