# -*- coding: utf-8 -*-
"""Test BAPO on two gloo ranks through TrinityPolicyLoss, and the trainer it refuses.

The ranks, forked with this module's imports, pass their group as verl's engine does.
"""

import json
import tempfile
import time
import unittest
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from tensordict import TensorDict

from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.common.config import AlgorithmConfig, Config
from trinity.trainer.verl.losses import TrinityPolicyLoss

WORLD, TIMEOUT = 2, 300  # seconds for the whole two-rank run, start-up included


def rank_batch(rank):
    """Rank 0: 4 x 40 tokens, mostly negative advantages; rank 1: 2 x 3, mostly positive."""
    gen = torch.Generator().manual_seed(rank)
    shape, positive = ((4, 40), 0.2) if rank == 0 else ((2, 3), 0.8)
    old = -torch.rand(shape, generator=gen) * 2 - 0.1
    batch = {"log_prob": old + 0.5 * torch.randn(shape, generator=gen), "old_log_probs": old}
    sign = torch.where(torch.rand(shape, generator=gen) < positive, 1.0, -1.0)
    batch["advantages"] = sign * (torch.rand(shape, generator=gen) + 0.1)
    return {**batch, "response_mask": torch.rand(shape, generator=gen) > 0.1}


def alone(batches):
    """The (c_low, c_high) one process chooses on the tokens of ``batches`` as one micro-batch."""
    union = {key: torch.cat([b[key].reshape(-1) for b in batches])[None] for key in batches[0]}
    metrics = BAPOPolicyLossFn(sync_across_dp=False)(**union)[1]
    return [metrics["bapo_clip_low"], metrics["bapo_clip_high"]]


# Each case: the loss's arguments, a NaN log-prob on rank 0, the dp_group (WORLD or the rank's)
CASES = {
    "synced": ({}, False, "world"),
    "alone": ({"sync_across_dp": False}, False, "world"),
    "nan": ({}, True, "world"),
    "own_group": ({}, False, "own"),
}


def run_rank(rank, store):
    """One rank: the pair that TrinityPolicyLoss, given the group, reports in each case."""
    torch.set_num_threads(1)
    group = dict(rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", init_method=f"file://{store}", **group)
    groups = {"world": dist.group.WORLD, "own": [dist.new_group([r]) for r in range(WORLD)][rank]}
    calls = {
        name: rank_pair(rank, args, nan, groups[at]) for name, (args, nan, at) in CASES.items()
    }
    (Path(store).parent / f"rank{rank}.json").write_text(json.dumps(calls))
    dist.destroy_process_group()


def rank_pair(rank, args, nan, group):
    """The pair BAPO, built from ``args`` as the trainer does, takes over ``group``; all-reduces."""
    data = rank_batch(rank)
    if nan and rank == 0:
        data["log_prob"][tuple(data["response_mask"].nonzero()[0])] = float("nan")
    log_prob = torch.cat([data.pop("log_prob"), torch.zeros(len(data["advantages"]), 1)], 1)
    rows, width = data["advantages"].shape  # the prompt is one token: t scores token t + 1
    data["prompts"] = torch.ones(rows, 1, dtype=torch.long)
    data["responses"] = data["response_mask"].long()
    data["attention_mask"] = torch.ones(rows, 1 + width, dtype=torch.long)
    config = AlgorithmConfig(policy_loss_fn="bapo", kl_loss_fn="none", entropy_loss_fn="none")
    config.policy_loss_fn_args, config.kl_loss_fn_args = args, {}
    config.entropy_loss_fn_args = {"entropy_coef": 0.0}
    batch, loss = TensorDict(data, batch_size=[rows]), TrinityPolicyLoss(config)
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        _, metrics = loss({"log_probs": log_prob.reshape(-1)}, batch, group)
    pair = [metrics["actor/bapo_clip_low"], metrics["actor/bapo_clip_high"]]
    return {"pair": pair, "all_reduces": all_reduce.call_count}


class BAPODataParallelTest(unittest.TestCase):
    """Two ranks with uneven micro-batches, against one process on their union."""

    @classmethod
    def setUpClass(cls):
        """Run the two ranks once, every case in turn; keep each rank's pairs."""
        with tempfile.TemporaryDirectory() as tmp:
            store = f"{tmp}/store"
            context = mp.start_processes(run_rank, (store,), WORLD, join=False, start_method="fork")
            deadline = time.monotonic() + TIMEOUT  # past it, the ranks' own timeout ends them
            while not context.join(timeout=5):
                assert time.monotonic() < deadline, f"the ranks ran past {TIMEOUT} s"
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
        cls.pairs = {name: [calls[name]["pair"] for calls in ranks] for name in CASES}
        cls.all_reduces = {name: [calls[name]["all_reduces"] for calls in ranks] for name in CASES}
        cls.batches = [rank_batch(rank) for rank in range(WORLD)]

    def test_every_rank_takes_the_pair_of_the_union(self):
        """A rank alone would choose another pair: one all-reduce per call makes them agree."""
        self.assertEqual(self.pairs["synced"], [alone(self.batches)] * WORLD)
        self.assertNotEqual([alone([batch]) for batch in self.batches], self.pairs["synced"])
        self.assertEqual(self.all_reduces["synced"], [1] * WORLD)

    def test_the_sums_are_reduced_over_the_group_passed_not_world(self):
        """Each rank its own group: each takes its own pair, where WORLD would give the union's."""
        self.assertEqual(self.pairs["own_group"], [alone([batch]) for batch in self.batches])

    def test_each_rank_takes_its_own_pair_without_sync_across_dp(self):
        """``sync_across_dp: false``: no all-reduce, each rank's pair is its own tokens'."""
        self.assertEqual(self.pairs["alone"], [alone([batch]) for batch in self.batches])

    def test_a_nan_on_one_rank_keeps_the_start_pair_on_every_rank(self):
        """The NaN makes the union's rho NaN, which is not below rho0, where clean it moves."""
        start = [0.6, 1.2]  # (a-, a+): the pair before any raise
        self.assertEqual(self.pairs["nan"], [start] * WORLD)
        self.assertNotEqual(alone(self.batches), start)


class BAPOTinkerTest(unittest.TestCase):
    """The trainer BAPO cannot run on, refused while the config is validated."""

    def test_the_tinker_trainer_is_refused_before_tinker_or_ray_starts(self):
        """Tinker calls the loss once per experience: the bounds would be chosen per sequence."""
        no_ray = mock.patch("ray.init", side_effect=AssertionError("ray.init was called"))
        no_tinker = mock.patch.dict("sys.modules", {"tinker": None})  # its import fails
        trainers = yaml.safe_load("[[true, verl], [false, tinker], [true, tinker]]")  # as read
        for algorithm_type, loss in yaml.safe_load("[[grpo, ppo], [bapo, null], [grpo, bapo]]"):
            for enable, trainer_type in trainers:
                config = Config()  # no cluster block: the cluster validator would start Ray
                config.model.model_path, config.model.max_model_len = "model", 64
                config.model.tinker.enable, config.trainer.trainer_type = enable, trainer_type
                config.algorithm.algorithm_type = algorithm_type
                config.algorithm.policy_loss_fn = loss
                with no_ray, no_tinker, self.assertRaises(Exception) as refused:
                    config.check_and_update()
                self.assertEqual("BAPO does not run" in str(refused.exception), loss != "ppo")
        config.model.tinker.enable, config.trainer.trainer_type = False, "verl"  # the control
        with no_ray, self.assertRaisesRegex(AssertionError, "ray.init was called"):
            config.check_and_update()


if __name__ == "__main__":
    unittest.main()
