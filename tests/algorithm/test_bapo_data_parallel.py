# -*- coding: utf-8 -*-
"""Test BAPO's synchronisation of its clip-bound search over data-parallel ranks.

Two gloo ranks started by the test, with uneven micro-batches: every rank takes the pair that one
process chooses on the union of both ranks' tokens, called directly and through
TrinityPolicyLoss (which must forward the engine's dp_group); with `sync_across_dp: false` the
ranks choose apart; and when one rank's inputs fail, both ranks raise in that same call. While
the config is validated, the trainers that cannot pass BAPO a group: Tinker refused however the
config names it, the legacy actors warned of; and the loss checked there is the trainer's.
"""

import json
import sys
import tempfile
import time
import unittest
from datetime import timedelta
from itertools import product
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.common.config import AlgorithmConfig, Config
from trinity.common.config_validator import (
    AlgorithmConfigValidator,
    BufferConfigValidator,
    TrainerConfigValidator,
    validators,
)

try:
    from tensordict import TensorDict

    from trinity.trainer.verl.losses import TrinityPolicyLoss

    ENGINE_LOSS = True
except ImportError:  # verl < 0.8, Trinity's legacy stack, has no engine loss
    ENGINE_LOSS = False

WORLD = 2
TIMEOUT = 180  # seconds for the whole two-rank run, start-up included
CONFIGS = {
    "paper": {},
    "authors": {
        "search_order": "lower_first",
        "ratio_lower_max": 0.8,
        "ratio_lower_step": 0.05,
        "ratio_upper_max": 2.0,
        "positive_contribution_target": 0.5,
    },
}
PROMPT_LEN = 2
BAPO_INIT = BAPOPolicyLossFn.__init__
BAPO_LOSS = [("bapo", None), ("grpo", "bapo")]  # (algorithm_type, policy_loss_fn)


def rank_batch(rank):
    """Rank 0: 4 x 40 tokens, mostly negative advantages; rank 1: 2 x 3, mostly positive."""
    gen = torch.Generator().manual_seed(rank)
    shape, positive = ((4, 40), 0.2) if rank == 0 else ((2, 3), 0.8)
    old_logprob = -torch.rand(shape, generator=gen) * 2 - 0.1
    logprob = old_logprob + 0.5 * torch.randn(shape, generator=gen)
    sign = torch.where(torch.rand(shape, generator=gen) < positive, 1.0, -1.0)
    advantages = sign * (torch.rand(shape, generator=gen) + 0.1)
    action_mask = torch.rand(shape, generator=gen) > 0.1
    return {
        "logprob": logprob,
        "old_logprob": old_logprob,
        "action_mask": action_mask,
        "advantages": advantages,
    }


def engine_call(args, batch, group):
    """Return BAPO's metrics through TrinityPolicyLoss, called as verl's engine calls it."""
    config = AlgorithmConfig(
        policy_loss_fn="bapo",
        policy_loss_fn_args=args,
        kl_loss_fn="none",
        kl_loss_fn_args={},
        entropy_loss_fn="none",
        entropy_loss_fn_args={"entropy_coef": 0.0},
        loss_agg_mode="token-mean",
    )
    rows, width = batch["logprob"].shape
    log_probs = torch.zeros(rows, PROMPT_LEN + width)
    log_probs[:, PROMPT_LEN - 1 : -1] = batch["logprob"]  # position t scores token t + 1
    data = {
        "prompts": torch.ones(rows, PROMPT_LEN, dtype=torch.long),
        "responses": torch.ones(rows, width, dtype=torch.long),
        "attention_mask": torch.ones(rows, PROMPT_LEN + width, dtype=torch.long),
        "response_mask": batch["action_mask"],
        "old_log_probs": batch["old_logprob"],
        "advantages": batch["advantages"],
    }
    model_output = {"log_probs": log_probs.reshape(-1)}
    _, metrics = TrinityPolicyLoss(config)(model_output, TensorDict(data, batch_size=[rows]), group)
    return {key.removeprefix("actor/"): value for key, value in metrics.items()}


def chosen(metrics):
    """(c_low, c_high, steps) from a call's metrics."""
    return [metrics[key] for key in ("bapo_clip_low", "bapo_clip_high", "bapo_search_steps")]


def single_process_pair(args, batches):
    """The pair one process chooses on the tokens of ``batches`` as one micro-batch."""
    union = {key: torch.cat([b[key].reshape(-1) for b in batches])[None] for key in batches[0]}
    return chosen(BAPOPolicyLossFn(**args, sync_across_dp=False)(**union)[1])


def run_rank(rank, store):
    """One rank: each pair it takes, then what it raises when rank 1's inputs fail."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    batch, group, record = rank_batch(rank), dist.group.WORLD, {}
    for name, args in CONFIGS.items():
        record[name] = {
            "synced": chosen(BAPOPolicyLossFn(**args)(**batch, dp_group=group)[1]),
            "alone": chosen(BAPOPolicyLossFn(**args, sync_across_dp=False)(**batch)[1]),
            "trinity": chosen(engine_call(args, batch, group)),
        }
    faults = {"failure": {"advantages": batch["advantages"] > 0}, "no_logprob": {"logprob": None}}
    for name, fault in faults.items():  # rank 1's inputs fail: bool advantages, then no tensor
        try:
            BAPOPolicyLossFn()(**{**batch, **fault} if rank == 1 else batch, dp_group=group)
        except Exception as error:  # what this rank raises in the failing call
            record[name] = f"{type(error).__name__}: {error}"
    record["after"] = chosen(BAPOPolicyLossFn()(**batch, dp_group=group)[1])
    (Path(store).parent / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def offline_config(algorithm_type, policy_loss_fn=None, tinker=()):
    """A config that the validators pass offline, Tinker written as ``tinker`` names it."""
    config = Config()
    config.model.model_path, config.model.max_model_len = "tiny-model", 64
    config.cluster.node_num, config.cluster.gpu_per_node = 1, 2  # no Ray cluster is asked
    config.algorithm.algorithm_type = algorithm_type
    config.algorithm.policy_loss_fn = policy_loss_fn
    config.model.tinker.enable = "model.tinker.enable" in tinker
    if "trainer.trainer_type" in tinker:
        config.trainer.trainer_type = "tinker"
    return config


def validate(config):
    """Run Trinity's validators in order; the buffer's needs a dataset and is left out."""
    for validator in validators:
        if not isinstance(validator, BufferConfigValidator):
            validator.validate(config)


class BAPOTrainerCheckTest(unittest.TestCase):
    """What the trainer must pass BAPO, checked while the config is validated."""

    def setUp(self):
        """Tinker's service, stubbed offline: it serves the test's model."""
        client = mock.MagicMock()
        client.get_server_capabilities.return_value.supported_models = [
            SimpleNamespace(model_name="tiny-model")
        ]
        sys.modules["tinker"] = SimpleNamespace(ServiceClient=mock.Mock(return_value=client))
        self.addCleanup(sys.modules.pop, "tinker")

    def test_dp_group_is_no_batch_field(self):
        """The keys BAPO reads from the batch are PPO's; the group is not among them."""
        self.assertEqual(
            BAPOPolicyLossFn().select_keys, ["old_log_probs", "response_mask", "advantages"]
        )

    def test_the_tinker_trainer_is_refused_however_the_config_is_composed(self):
        """Tinker calls the policy loss once per experience: bounds per sequence, not per update."""
        for loss in BAPO_LOSS:
            for tinker in (
                ["model.tinker.enable"],
                ["trainer.trainer_type"],
                ["model.tinker.enable", "trainer.trainer_type"],
            ):
                with self.assertRaisesRegex(ValueError, "Tinker.*once per experience"):
                    validate(offline_config(*loss, tinker))
            config = offline_config(*loss)
            validate(config)  # the control: the verl trainer passes
            self.assertEqual(config.trainer.trainer_type, "verl")

    @unittest.skipUnless(ENGINE_LOSS, "needs verl >= 0.8, whose engine loss builds the loss")
    def test_the_check_builds_the_loss_the_trainer_builds(self):
        """For each place the mode is written, with and without other loss arguments."""
        mode, other = "seq-mean-token-sum", {"positive_contribution_target": 0.5}
        written = [(None, None), (mode, None), (None, mode), (mode, "seq-mean-token-mean")]
        for loss, (algorithm_mode, args_mode), args in product(BAPO_LOSS, written, (None, other)):
            with self.subTest(loss=loss, algorithm=algorithm_mode, args=args_mode, other=args):
                config = offline_config(*loss)
                config.algorithm.loss_agg_mode = algorithm_mode
                if args is not None or args_mode is not None:
                    config.algorithm.policy_loss_fn_args = dict(args or {})
                if args_mode is not None:
                    config.algorithm.policy_loss_fn_args["loss_agg_mode"] = args_mode
                with mock.patch.object(
                    BAPOPolicyLossFn, "__init__", autospec=True, side_effect=BAPO_INIT
                ) as init:
                    validate(config)
                    TrinityPolicyLoss(config.algorithm)
                checked, trained = [call.kwargs for call in init.call_args_list]  # one each
                self.assertEqual(checked, trained)

    def test_a_bad_algorithm_mode_fails_beside_a_good_one_among_the_loss_args(self):
        """Even beside a good mode among the loss arguments, which the algorithm's overrides."""
        config = offline_config("bapo")
        config.algorithm.loss_agg_mode = "bogus"
        config.algorithm.policy_loss_fn_args = {"loss_agg_mode": "token-mean"}
        with self.assertRaisesRegex(ValueError, "`loss_agg_mode`"):
            validate(config)

    def test_the_legacy_actors_are_warned_of(self):
        """The legacy (verl < 0.8) FSDP and Megatron actors pass no dp_group."""
        named = {  # (trainer_strategy, verl < 0.8): the actor a warning names
            ("fsdp2", False): None,
            ("fsdp", True): "the legacy fsdp actor",
            ("megatron", True): "the legacy megatron actor",
        }
        for (strategy, legacy), actor in named.items():
            for sync in (True, False):
                config = offline_config("bapo")
                config.trainer.trainer_strategy = strategy
                config.algorithm.policy_loss_fn_args = {"sync_across_dp": sync}
                AlgorithmConfigValidator().validate(config)
                validator = TrainerConfigValidator()
                with mock.patch.object(validator, "logger") as logger:
                    with mock.patch("trinity.trainer.trainer.is_verl_legacy", return_value=legacy):
                        validator._check_bapo(config)
                warnings = [call.args[0] for call in logger.warning.mock_calls]
                self.assertEqual(len(warnings), 1 if actor and sync else 0, (actor, sync))
                for warning in warnings:
                    self.assertIn(f"BAPO: {actor}", warning)

    def test_backend_among_the_loss_arguments_is_refused(self):
        """The trainer passes its own backend: a second one would fail there, not at validation."""
        for loss in BAPO_LOSS:
            config = offline_config(*loss)
            config.algorithm.policy_loss_fn_args = {"backend": "verl"}
            with self.assertRaisesRegex(ValueError, "`backend`"):
                validate(config)


@unittest.skipUnless(ENGINE_LOSS, "needs verl >= 0.8, whose engine passes dp_group")
class BAPODataParallelTest(unittest.TestCase):
    """Two gloo ranks with uneven micro-batches, against one process on their union."""

    @classmethod
    def setUpClass(cls):
        """Run both ranks once (spawned, file rendezvous, under a timeout); read their files."""
        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "store"
            context = mp.start_processes(
                run_rank, (str(store),), nprocs=WORLD, join=False, start_method="spawn"
            )
            deadline = time.monotonic() + TIMEOUT
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"the {WORLD} ranks did not finish in {TIMEOUT} s")
            cls.ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in (0, 1)]
        cls.batches = [rank_batch(rank) for rank in range(WORLD)]

    def test_every_rank_takes_the_pair_of_the_union(self):
        """Called directly with the group, both ranks take the union's pair and steps."""
        for name, args in CONFIGS.items():
            union = single_process_pair(args, self.batches)
            self.assertEqual([record[name]["synced"] for record in self.ranks], [union] * WORLD)

    def test_through_trinity_policy_loss_every_rank_takes_the_pair_of_the_union(self):
        """Through the engine's loss callable, which must forward the group it is given."""
        for name, args in CONFIGS.items():
            union = single_process_pair(args, self.batches)
            self.assertEqual([record[name]["trinity"] for record in self.ranks], [union] * WORLD)

    def test_without_sync_the_ranks_choose_apart(self):
        """The control: alone, each rank takes its own pair, and they differ."""
        for name, args in CONFIGS.items():
            alone = [record[name]["alone"] for record in self.ranks]
            self.assertEqual(alone, [single_process_pair(args, [b]) for b in self.batches])
            self.assertNotEqual(alone[0], alone[1], name)

    def test_one_rank_failing_makes_every_rank_raise_in_that_call(self):
        """Rank 1's bad inputs raise there; rank 0 raises BAPO's error; the group goes on.

        A log-prob that is no tensor at all (None) fails the same way, with its own error.
        """
        for name in ("failure", "no_logprob"):
            self.assertRegex(self.ranks[0][name], "^RuntimeError: BAPO: .*another rank")
            self.assertNotRegex(self.ranks[1][name], "another rank")
        self.assertRegex(self.ranks[1]["no_logprob"], "^TypeError: .*NoneType")
        union = single_process_pair({}, self.batches)
        self.assertEqual([record["after"] for record in self.ranks], [union] * WORLD)


if __name__ == "__main__":
    unittest.main()
