# -*- coding: utf-8 -*-
"""Test BAPO's runtime key `dp_group` and its synchronisation over data-parallel ranks.

In one process: `dp_group` is a runtime key, never a batch field, and TrinityPolicyLoss hands
the engine's group to the losses that declare it (subclasses included) and to no other. On two
gloo ranks started by the test, with uneven micro-batches: every rank takes the pair that one
process chooses on the union of both ranks' tokens, called directly and through
TrinityPolicyLoss; with `sync_across_dp: false` the ranks choose apart; and under `contribution:
gradient` the logged rho is the positive share of the update that data-parallel averaging
applies, as autograd gives it, in every aggregation mode.
"""

import json
import os
import socket
import tempfile
import time
import unittest
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

from trinity.algorithm.algorithm import BAPOAlgorithm
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.algorithm.policy_loss_fn.bapo_sync import ContributionSync
from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn
from trinity.common.config import AlgorithmConfig, Config
from trinity.trainer.verl.losses import TrinityPolicyLoss

WORLD = 2
TIMEOUT = 180  # seconds for the whole two-rank run, start-up included
CONFIGS = {
    "paper": {},
    "authors_gradient": {"search_order": "lower_first", "contribution": "gradient"},
}
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TARGETS = [0.0, 0.4]  # the start pair, and one the search has to move to
PROMPT_LEN = 2


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


def engine_inputs(batch):
    """(model_output, data) for TrinityPolicyLoss, as verl's engine passes them (no padding)."""
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
    return {"log_probs": log_probs.reshape(-1)}, TensorDict(data, batch_size=[rows])


def trinity_loss(args) -> TrinityPolicyLoss:
    """The engine's loss callable with BAPO as its policy loss, and no KL or entropy term."""
    config = AlgorithmConfig(
        policy_loss_fn="bapo",
        policy_loss_fn_args=args,
        kl_loss_fn="none",
        kl_loss_fn_args={},
        entropy_loss_fn="none",
        entropy_loss_fn_args={"entropy_coef": 0.0},
        loss_agg_mode="token-mean",
    )
    return TrinityPolicyLoss(config)


def chosen(metrics, prefix=""):
    """(c_low, c_high, steps) from a call's metrics."""
    keys = ("bapo_clip_low", "bapo_clip_high", "bapo_search_steps")
    return [metrics[prefix + key] for key in keys]


def single_process_pair(args, batches):
    """The pair one process chooses on the tokens of ``batches`` as one micro-batch.

    Under "gradient" each token weighs its factor in its own rank's token-mean loss (1 / that
    rank's token count), as data-parallel averaging applies it: a fractional mask says so.
    """
    union = {key: torch.cat([b[key].reshape(-1) for b in batches])[None] for key in batches[0]}
    if args.get("contribution") == "gradient":
        masks = [b["action_mask"].reshape(-1) / b["action_mask"].sum() for b in batches]
        union["action_mask"] = torch.cat(masks)[None]
    return chosen(BAPOPolicyLossFn(**args, sync_across_dp=False)(**union)[1])


def run_rank(rank, port, out):
    """One rank: each pair it takes, and its log-prob gradients under `contribution: gradient`."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    batch, group, record = rank_batch(rank), dist.group.WORLD, {}
    for name, args in CONFIGS.items():
        alone = BAPOPolicyLossFn(**args, sync_across_dp=False)
        record[name] = {
            "synced": chosen(BAPOPolicyLossFn(**args)(**batch, dp_group=group)[1]),
            "alone": chosen(alone(**batch, dp_group=group)[1]),
            "trinity": chosen(trinity_loss(args)(*engine_inputs(batch), group)[1], "actor/"),
        }
    for mode in AGG_MODES:
        for target in TARGETS:
            args = dict(contribution="gradient", loss_agg_mode=mode)
            leaf = batch["logprob"].clone().requires_grad_(True)
            loss_fn = BAPOPolicyLossFn(**args, positive_contribution_target=target)
            loss, metrics = loss_fn(**{**batch, "logprob": leaf}, dp_group=group)
            loss.backward()
            record[f"{mode}/{target}"] = {"metrics": metrics, "grad": leaf.grad.tolist()}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


class BAPORuntimeKeyTest(unittest.TestCase):
    """`dp_group` reaches the losses that declare it in `_runtime_keys`, and only those."""

    def call_through_trinity(self, policy_loss_fn, group):
        """Call TrinityPolicyLoss with ``policy_loss_fn`` and ``group``; return what BAPO got."""
        wrapper = trinity_loss({})
        wrapper.policy_loss_fn = policy_loss_fn
        with mock.patch.object(ContributionSync, "group_for", autospec=True) as group_for:
            group_for.return_value = None  # then BAPO searches alone, on this process
            wrapper(*engine_inputs(rank_batch(1)), dp_group=group)
        return [call.args[1] for call in group_for.call_args_list]

    def test_dp_group_is_no_batch_field(self):
        """The keys BAPO reads from the batch are PPO's; the group is not among them."""
        self.assertEqual(
            BAPOPolicyLossFn().select_keys, ["old_log_probs", "response_mask", "advantages"]
        )

    def test_trinity_policy_loss_hands_the_engine_group_to_bapo(self):
        """The very object the engine passes reaches BAPO's synchronisation."""
        group = object()  # TrinityPolicyLoss passes it on without reading it
        self.assertEqual(self.call_through_trinity(BAPOPolicyLossFn(), group), [group])

    def test_a_subclass_keeps_the_runtime_key(self):
        """A subclass that overrides __call__ inherits `_runtime_keys`, so it gets the group."""

        class SubclassedBAPO(BAPOPolicyLossFn):
            def __call__(self, logprob, old_logprob, action_mask, advantages, dp_group=None):
                return super().__call__(logprob, old_logprob, action_mask, advantages, dp_group)

        group = object()
        self.assertNotIn("dp_group", SubclassedBAPO().select_keys)
        self.assertEqual(self.call_through_trinity(SubclassedBAPO(), group), [group])

    def test_a_loss_that_does_not_declare_it_never_receives_it(self):
        """Losses without `_runtime_keys` see exactly the keyword arguments they saw before."""

        class Probe(PolicyLossFn):
            def __call__(self, logprob, old_logprob, action_mask, advantages, **kwargs):
                self.received = sorted(kwargs)
                return (logprob * advantages).sum(), {}

            @classmethod
            def default_args(cls):
                return {}

        probe = Probe()
        self.call_through_trinity(probe, object())
        self.assertEqual(probe.received, [])

    def test_the_preset_warns_where_the_trainer_passes_no_group(self):
        """Tinker and the legacy Megatron actor call the loss without a dp_group."""
        named = {  # (trainer_type, trainer_strategy, verl < 0.8): the backend a warning names
            ("verl", "fsdp2", False): None,
            ("tinker", "fsdp2", False): "the Tinker trainer",
            ("verl", "megatron", True): "the legacy Megatron actor",
        }
        for (trainer_type, strategy, legacy), backend in named.items():
            for sync in (True, False):
                config = Config()
                config.trainer.trainer_type = trainer_type
                config.trainer.trainer_strategy = strategy
                config.algorithm.policy_loss_fn_args = {"sync_across_dp": sync}
                with mock.patch("trinity.algorithm.algorithm.logger") as logger:
                    with mock.patch("trinity.trainer.trainer.is_verl_legacy", return_value=legacy):
                        BAPOAlgorithm.check_config(config)
                warnings = [call.args[0] for call in logger.warning.mock_calls]
                self.assertEqual(len(warnings), 1 if backend and sync else 0, (backend, sync))
                for warning in warnings:
                    self.assertIn(f"BAPO: {backend}", warning)


class BAPODataParallelTest(unittest.TestCase):
    """Two gloo ranks with uneven micro-batches, against one process on their union."""

    @classmethod
    def setUpClass(cls):
        """Run both ranks once (spawned, on a free port, under a timeout) and read their files."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            context = mp.start_processes(
                run_rank, (port, Path(tmp)), nprocs=WORLD, join=False, start_method="spawn"
            )
            deadline = time.monotonic() + TIMEOUT
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"the {WORLD} ranks did not finish in {TIMEOUT} s")
            cls.ranks = [
                json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(WORLD)
            ]
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

    def test_gradient_share_is_the_share_of_the_applied_update(self):
        """Under "gradient", rho is autograd's positive share of the ranks' summed gradients.

        Data parallelism applies each rank's gradient over the number of ranks, a factor that
        no share sees. Checked at the start pair and at a pair the search moved to.
        """
        moved = set()
        for mode in AGG_MODES:
            for target in TARGETS:
                records = [record[f"{mode}/{target}"] for record in self.ranks]
                grads = [torch.tensor(record["grad"]).abs() for record in records]
                signs = [batch["advantages"] > 0 for batch in self.batches]
                positive = sum(float(g[s].sum()) for g, s in zip(grads, signs))
                share = positive / sum(float(g.sum()) for g in grads)
                for record in records:
                    rho = record["metrics"]["bapo_positive_contribution"]
                    self.assertAlmostEqual(rho, share, delta=1e-6, msg=(mode, target))
                moved.add(records[0]["metrics"]["bapo_search_steps"] > 0)
        self.assertEqual(moved, {False, True})


if __name__ == "__main__":
    unittest.main()
