# -*- coding: utf-8 -*-
"""Test BAPO's `search_scope: update`: one clip pair per optimizer update, over the dp_group.

Two gloo ranks started by the test run verl's `BaseEngine.train_batch` and `infer_batch` as they
are, on an engine whose forward hands each micro-batch's ready log-probs to TrinityPolicyLoss, as
verl's FSDP engine does after its model. The actor worker's `set_trinity_config` sets the loss on
its actor, and each update is the call verl's TrainingWorker makes on it. Then every training
call of an update takes the pair one process chooses on the union of both ranks' micro-batches,
after exactly one all-reduce, and the pair is released after the update; under `micro_batch` no
pass runs; without the worker BAPO refuses to guess. The worker leaves the engine alone, so a
loss set later trains as if BAPO had never been set. The trainer validator refuses `update`
where the pass would differ, the model's own config.json included.
"""

import json
import tempfile
import time
import unittest
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
import yaml

from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.common.config import AlgorithmConfig, Config
from trinity.common.config_validator import BufferConfigValidator, validators

try:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.base import BaseEngine

    from trinity.trainer.verl.losses import TrinityPolicyLoss
    from trinity.trainer.verl.workers import TrinityActorRolloutRefWorker

    ENGINE = True
except ImportError:  # verl < 0.8, Trinity's legacy stack, has no engine
    ENGINE = False
    BaseEngine = object  # type: ignore[misc, assignment]

WORLD = 2
TIMEOUT = 300  # seconds for the whole two-rank run, start-up included (a loaded machine)
PROMPT_LEN = 2
# the paper's settings otherwise; read as a config file's, not the interned literal the code has
ARGS = yaml.safe_load("search_scope: update")
SHAPES = {0: ((4, 40), 0.5, 2), 1: ((2, 3), 0.8, 1)}  # rank: shape, share of A > 0, rows per call


def rank_batch(rank, seed=0):
    """Rank 0: 4 x 40 tokens, half with positive advantages; rank 1: 2 x 3, mostly positive."""
    gen = torch.Generator().manual_seed(seed * WORLD + rank)
    shape, positive, _ = SHAPES[rank]
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


class LogProbEngine(BaseEngine):
    """verl's engine calling convention on ready log-probs: no model, no optimizer.

    ``forward_backward_batch`` cuts the batch into micro-batches of the rows its settings give,
    calls the loss on each with the group, and back-propagates it unless ``forward_only``, as
    verl's FSDP engine does; ``train_batch`` and ``infer_batch`` (no grad) are verl's own.
    """

    def __init__(self, rows, group, module=None):
        """Its config's micro-batches of ``rows`` rows; ``group``: the group the loss gets.

        ``module``: the model the worker inspects before a pass (none by default).
        """
        self.rows, self.group = rows, group
        self.module = module or torch.nn.Identity()

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """Each micro-batch through the loss, back-propagated unless ``forward_only``."""
        calls, rows = [], data["micro_batch_size_per_gpu"]  # as verl's engines read it
        for start in range(0, len(data), rows):
            output, fields = trinity_layout(data[start : start + rows])
            loss, metrics = loss_function(output, fields, dp_group=self.group)
            if not forward_only:
                loss.backward()
            calls.append({key.removeprefix("actor/"): value for key, value in metrics.items()})
        return {"metrics": {"calls": calls}}

    def optimizer_zero_grad(self):
        """No parameters: the log-probs are the leaves."""

    def optimizer_step(self):
        """No optimizer: a zero gradient norm."""
        return 0.0

    def is_mp_src_rank_with_outputs(self):
        """One rank per model replica: every rank reports."""
        return True


class Actor:
    """verl's TrainingWorker as Trinity's worker holds it: an engine, and the loss it is set."""

    def __init__(self, engine):
        """No loss until the worker sets one; verl's engine config of micro-batch settings."""
        self.engine, self.loss_fn = engine, None
        self.engine_config = SimpleNamespace(
            use_remove_padding=False,
            use_dynamic_bsz=False,
            max_token_len_per_gpu=None,
            micro_batch_size_per_gpu=engine.rows,
            use_fused_kernels=False,
        )

    def set_loss_fn(self, loss_fn):
        """As TrainingWorker.set_loss_fn."""
        self.loss_fn = loss_fn

    def settled(self, data):
        """``data`` with the engine config's settings where absent, as TrainingWorker fills them."""
        for key, value in vars(self.engine_config).items():
            if key not in data.keys():
                tu.assign_non_tensor(data, **{key: value})
        return data

    def train_batch(self, data):
        """One optimizer update, as TrainingWorker.train_batch calls the engine."""
        return self.engine.train_batch(self.settled(data), loss_function=self.loss_fn)


def configured_actor(engine, args, policy_loss_fn="bapo", worker=None):
    """The actor after the worker's ``set_trinity_config`` (no Ray, no model: the method alone).

    ``worker``: one configured before, whose actor gets the new loss.
    """
    if worker is None:
        worker = object.__new__(TrinityActorRolloutRefWorker)
        worker.actor = Actor(engine)
    worker.set_trinity_config(algorithm_config(args, policy_loss_fn), "vllm", "test")
    return worker


def trinity_layout(batch):
    """The model output and padded TensorDict that TrinityPolicyLoss reads, as in training."""
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


def algorithm_config(args, policy_loss_fn="bapo"):
    """The algorithm config of a policy loss with ``args``, no KL or entropy term."""
    return AlgorithmConfig(
        policy_loss_fn=policy_loss_fn,
        policy_loss_fn_args=args,
        kl_loss_fn="none",
        kl_loss_fn_args={},
        entropy_loss_fn="none",
        entropy_loss_fn_args={"entropy_coef": 0.0},
        loss_agg_mode="token-mean",
    )


def chosen(metrics):
    """(c_low, c_high, steps) from a call's metrics."""
    return [metrics[key] for key in ("bapo_clip_low", "bapo_clip_high", "bapo_search_steps")]


def single_process_pair(args, batches):
    """The pair one process chooses, at one call, on the tokens of ``batches`` together."""
    union = {key: torch.cat([b[key].reshape(-1) for b in batches])[None] for key in batches[0]}
    args = {**args, "search_scope": "micro_batch", "sync_across_dp": False}
    return chosen(BAPOPolicyLossFn(**args)(**union)[1])


def as_data(batch):
    """A rank's batch as the TensorDict verl's engine gets, the log-probs requiring grad."""
    rows = len(batch["logprob"])
    fields = {key: value.clone().requires_grad_(key == "logprob") for key, value in batch.items()}
    return TensorDict(fields, batch_size=[rows])


def raised(call):
    """What ``call()`` raises, as text; None if it returns."""
    try:
        call()
    except Exception as error:  # what this rank raises
        return f"{type(error).__name__}: {error}"
    return None


def per_call_pairs(batches):
    """The pair of each training call k, decided on the ranks' micro-batches k together."""
    rows = [SHAPES[rank][2] for rank in range(WORLD)]
    return [
        single_process_pair(
            ARGS,
            [
                {key: value[k * size : (k + 1) * size] for key, value in batch.items()}
                for batch, size in zip(batches, rows)
            ],
        )
        for k in range(2)
    ]


def update(rank, args, batch, worker=True):
    """One optimizer update on this rank: each call's pair and the all-reduces made.

    ``worker``: the engine and loss as the worker sets them; else the loss alone, unwrapped.
    ``after``: what a call of the loss outside any update raises, after it.
    """
    engine = LogProbEngine(SHAPES[rank][2], dist.group.WORLD)
    actor = configured_actor(engine, args).actor if worker else Actor(engine)
    actor.loss_fn = actor.loss_fn or TrinityPolicyLoss(algorithm_config(args))
    out: dict = {}
    with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
        error = raised(lambda: out.update(actor.train_batch(as_data(batch))["metrics"]))
    if error:
        return {"raised": error}
    pairs = [chosen(call) for call in out["calls"]]
    data = actor.settled(as_data(batch))
    after = raised(lambda: engine.infer_batch(data, loss_function=actor.loss_fn))
    return {"pairs": pairs, "all_reduces": all_reduce.call_count, "after": after}


def run_rank(rank, store):
    """One rank: updates with and without the hook, and sync off."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    batch = rank_batch(rank)
    record = {
        "update": update(rank, ARGS, batch),
        "micro_batch": update(rank, {"search_scope": "micro_batch"}, batch),
        "authors": update(rank, {**ARGS, "search_order": "lower_first"}, batch),
        "alone": update(rank, {**ARGS, "sync_across_dp": False}, batch),
        "unhooked": update(rank, ARGS, batch, worker=False),
    }
    (Path(store).parent / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def tiny_model(folder, **settings):
    """A tiny Llama's config.json in ``folder`` (all the validators read), with ``settings``."""
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    config.vocab_size = 32
    config.update(settings)
    config.save_pretrained(folder)
    return str(folder)


def offline_config(model_path, args, strategy="fsdp2", **verl):
    """A config that the validators pass offline: BAPO with ``args``, ``verl`` in trainer_config."""
    config = Config()
    config.model.model_path, config.model.max_model_len = model_path, 64
    config.cluster.node_num, config.cluster.gpu_per_node = 1, 2  # no Ray cluster is asked
    config.algorithm.algorithm_type = "bapo"
    config.algorithm.policy_loss_fn_args = dict(args)
    config.trainer.trainer_strategy = strategy
    config.trainer.trainer_config = {"actor_rollout_ref": verl} if verl else {}
    return config


def validate(config):
    """Run Trinity's validators in order; the buffer's needs a dataset and is left out."""
    for validator in validators:
        if not isinstance(validator, BufferConfigValidator):
            validator.validate(config)


class BAPOUpdateScopeConfigTest(unittest.TestCase):
    """The argument's values, and the trainers and models where the pass would differ."""

    def test_search_scope_takes_micro_batch_or_update(self):
        """Anything else is refused at construction."""
        BAPOPolicyLossFn(search_scope="update")
        with self.assertRaisesRegex(ValueError, "`search_scope` must be micro_batch or update"):
            BAPOPolicyLossFn(search_scope="step")

    def setUp(self):
        """A tiny model without dropout, and one whose config.json sets attention dropout.

        The plain one leaves classifier_dropout unset (null), as many config.json files do.
        """
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)
        self.plain = tiny_model(
            Path(folder.name) / "plain", attention_dropout=0.0, classifier_dropout=None
        )
        self.dropout = tiny_model(Path(folder.name) / "dropout", attention_dropout=0.1)

    def test_the_validator_refuses_update_where_the_pass_would_differ(self):
        """Each refusal names its setting; the default config and zero settings pass.

        So do the scope left unwritten, router replay other than R2, and a setting named like
        dropout that is no number (verl's LoRA `dropout_position`).
        """
        plain, override = self.plain, {"override_config": {"attention_dropout": 0.0}}
        validate(offline_config(plain, ARGS))
        validate(offline_config(plain, ARGS, model=override))
        validate(offline_config(self.dropout, ARGS, model=override))  # the override holds
        validate(offline_config(self.dropout, {"search_scope": "micro_batch"}))
        validate(offline_config(self.dropout, {"clip_ratio_c": 3.0}))
        for mode in ("disabled", "R3"):
            validate(offline_config(plain, ARGS, actor={"router_replay": {"mode": mode}}))
        validate(offline_config(plain, ARGS, model={"lora": {"dropout_position": "pre"}}))
        refused = [  # (the config's setting, what the message names)
            (offline_config(plain, ARGS, "megatron"), "trainer.trainer_strategy: megatron"),
            (offline_config(self.dropout, ARGS), f"config.json of `{self.dropout}` sets "),
            (offline_config(self.dropout, ARGS), "`attention_dropout: 0.1`"),
            (
                offline_config(plain, ARGS, model={"override_config": {"attention_dropout": 0.1}}),
                "model.override_config.attention_dropout: 0.1",
            ),
            (
                offline_config(plain, ARGS, model={"override_config": {"hidden_dropout": "0.1"}}),
                "0.1",
            ),
            (
                offline_config(plain, ARGS, model={"override_config": {"layerdrop": 0.2}}),
                "layerdrop",
            ),
            (
                offline_config(plain, ARGS, model={"override_config": {"drop_path_rate": 0.1}}),
                "drop_path_rate",
            ),
            (
                offline_config(plain, ARGS, actor={"router_replay": {"mode": "R2"}}),
                "router_replay.mode",
            ),
        ]
        for config, named in refused:
            with self.assertRaisesRegex(ValueError, "search_scope: update") as raised:
                validate(config)
            self.assertIn(named, str(raised.exception))
        legacy = mock.patch("trinity.trainer.trainer.is_verl_legacy", return_value=True)
        with legacy, self.assertRaisesRegex(ValueError, "search_scope: update.*legacy actors"):
            validate(offline_config(plain, ARGS))

    @unittest.skipUnless(ENGINE, "needs verl >= 0.8, whose engine the worker runs")
    def test_a_loss_set_after_bapo_trains_as_if_bapo_had_never_been_set(self):
        """BAPO per update, then PPO, on one worker: PPO trains; the engine is never changed."""
        engine = LogProbEngine(2, None)
        worker = configured_actor(engine, ARGS)
        self.assertIn(
            "bapo_clip_low", worker.actor.train_batch(as_data(rank_batch(0)))["metrics"]["calls"][0]
        )
        configured_actor(engine, {"clip_range": 0.2}, policy_loss_fn="ppo", worker=worker)
        calls = worker.actor.train_batch(as_data(rank_batch(0)))["metrics"]["calls"]
        self.assertEqual(len(calls), 2)
        self.assertTrue(all("pg_loss" in call and "bapo_clip_low" not in call for call in calls))
        self.assertEqual(sorted(vars(engine)), ["group", "module", "rows"])  # as built

    @unittest.skipUnless(ENGINE, "needs verl >= 0.8, whose engine the worker runs")
    def test_the_worker_refuses_a_pass_through_a_dropout_module(self):
        """The built model's modules: dropout above 0 or a batch norm refused, named; else trains.

        Dropout at 0, or under micro_batch, trains.
        """
        dropout = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
        norm = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        for model, named in ((dropout, r"`1` \(Dropout\(p=0.1"), (norm, r"`1` \(BatchNorm1d")):
            worker = configured_actor(LogProbEngine(2, None, model), ARGS)
            with self.subTest(named), self.assertRaisesRegex(ValueError, named):
                worker.actor.train_batch(as_data(rank_batch(0)))
        worker = configured_actor(LogProbEngine(2, None, dropout), {"search_scope": "micro_batch"})
        worker.actor.train_batch(as_data(rank_batch(0)))
        off = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))
        configured_actor(LogProbEngine(2, None, off), ARGS).actor.train_batch(
            as_data(rank_batch(0))
        )


@unittest.skipUnless(ENGINE, "needs verl >= 0.8, whose engine the worker wraps")
class BAPOUpdateScopeTest(unittest.TestCase):
    """Two gloo ranks with uneven micro-batches, against one process on the update's union."""

    @classmethod
    def setUpClass(cls):
        """Run both ranks once (forked, file rendezvous, under a timeout); read their files."""
        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "store"
            context = mp.start_processes(
                run_rank, (str(store),), nprocs=WORLD, join=False, start_method="fork"
            )
            deadline = time.monotonic() + TIMEOUT
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"the {WORLD} ranks did not finish in {TIMEOUT} s")
            cls.ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in (0, 1)]
        cls.batches = [rank_batch(rank) for rank in range(WORLD)]

    def test_every_call_of_the_update_takes_the_pair_of_its_union(self):
        """Both orders: the pair one process takes on all the update's tokens, one all-reduce."""
        for name, args in (("update", ARGS), ("authors", {**ARGS, "search_order": "lower_first"})):
            union = single_process_pair(args, self.batches)
            for record in self.ranks:
                self.assertEqual(record[name]["pairs"], [union] * 2, name)
                self.assertEqual(record[name]["all_reduces"], 1, name)

    def test_without_sync_each_rank_takes_its_own_update_pair(self):
        """The control: alone, each rank decides on its own update's tokens, and they differ."""
        alone = [single_process_pair(ARGS, [batch]) for batch in self.batches]
        self.assertNotEqual(alone[0], alone[1])
        self.assertEqual(
            [record["alone"]["pairs"] for record in self.ranks], [[p] * 2 for p in alone]
        )
        self.assertEqual([record["alone"]["all_reduces"] for record in self.ranks], [0, 0])

    def test_deciding_at_each_call_would_leave_the_update_pair(self):
        """The data can tell: some call's tokens over both ranks choose another pair."""
        union = single_process_pair(ARGS, self.batches)
        self.assertNotEqual(per_call_pairs(self.batches), [union] * 2)

    def test_the_pair_is_released_after_the_update(self):
        """A call outside any update finds no pair: it raises, rather than reuse the last one."""
        for record in self.ranks:
            self.assertRegex(record["update"]["after"], "^RuntimeError: BAPO: .*pass")

    def test_micro_batch_runs_no_pass(self):
        """Each training call decides on its own micro-batches over both ranks: one all-reduce."""
        per_call = per_call_pairs(self.batches)
        for record in self.ranks:
            self.assertEqual(record["micro_batch"]["pairs"], per_call)
            self.assertEqual(record["micro_batch"]["all_reduces"], 2)

    def test_without_the_worker_bapo_raises_on_every_rank(self):
        """No pass ran: BAPO refuses to decide per call in its place."""
        for record in self.ranks:
            self.assertRegex(record["unhooked"]["raised"], "^RuntimeError: BAPO: .*pass")


if __name__ == "__main__":
    unittest.main()
