"""Checks inside verl 0.8's FSDP engine, run on every rank as ``python -m tests.engine_checks``.

- ``fsdp2`` and ``fsdp1`` (options ``sp``, ``phases``, ``released_losses``): every rank builds
  ``FSDPEngineWithLMHead`` on one tiny Llama and trains ``engine.train_batch`` steps through
  ``TrinityPolicyLoss`` around ``bapo``; the engine alone picks the micro-batches and the group.
  Phases: ``sync``, ``authors`` (their order and grid), ``nosync`` and ``released`` (the
  released ``losses.py``, which drops the group): the last two controls must disagree.
- ``worker`` (options ``config_true``, ``config_false``): a Trinity trainer rank minus Ray, from
  each YAML to one ``update_actor`` on this rank's share of a batch.
"""

import importlib.util
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

from scripts.harness.engine import build_engine, engine_batch, trinity_layout, use_torch_unpad_input
from scripts.harness.model import build_model, save_model
from scripts.harness.recorder import LossRecorder
from scripts.harness.tasks import VOCAB_SIZE
from scripts.harness.variants import loss_config
from tests.inputs import loss_kwargs
from tests.ranks import main

STEPS, MICRO_BATCH = 2, 4  # train_batch calls per phase, sequences per micro-batch
# Phase: (sync_across_dp, a config of tests.inputs.CONFIGS, the released losses.py)
PHASES = {
    "sync": (True, "paper_upper", False),
    "authors": (True, "yaml_lower", False),
    "nosync": (False, "paper_upper", False),
    "released": (True, "paper_upper", True),
}
BATCH, WIDTH = 8, 6  # sequences per data-parallel rank and step; prompt and response width
# Share of positive sequences per data-parallel rank: apart, so that alone they choose apart.
POSITIVE_SHARE = (0.75, 0.15, 0.5, 0.3)


def cpu_stand_ins(fsdp1: bool = False, worker: bool = False) -> None:
    """What a CPU-only machine lacks, and only that (docs/testing.md lists each stand-in).

    ``fsdp1``: FSDP1's check of CPU module states is skipped (gloo broadcasts them fine);
    ``worker``: Trinity's actor worker builds the engine, and the model, on CPU.
    """
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None  # type: ignore[attr-defined]
    if fsdp1:
        from torch.distributed.fsdp import _init_utils

        _init_utils._check_module_states_for_sync_module_states = lambda module_states: None
    if worker:
        from verl.workers.engine import EngineRegistry
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        EngineRegistry.register("language_model", ["fsdp", "fsdp2"], "cpu")(FSDPEngineWithLMHead)
        for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated"):
            setattr(torch.cpu, name, lambda *args, **kwargs: 0)
        torch.cpu.memory_reserved = lambda *args, **kwargs: 0  # type: ignore[attr-defined]
        torch.cuda.get_device_capability = lambda *args, **kwargs: (0, 0)
        use_torch_unpad_input()


def rank_batch(dp_rank: int, step: int) -> TensorDict:
    """One data-parallel rank's batch in Trinity's layout: one advantage per sequence.

    Odd ranks hold longer sequences; old log-probs spread the ratios over both clip ranges.
    """
    gen = torch.Generator().manual_seed(1000 * dp_rank + step)
    low = 2 if dp_rank % 2 == 0 else 4
    prompt_len, response_len = torch.randint(low, low + 3, (2, BATCH), generator=gen)
    columns = torch.arange(WIDTH)
    prompt_mask = (columns >= WIDTH - prompt_len[:, None]).long()
    response_mask = (columns < response_len[:, None]).long()
    prompts, responses = torch.randint(1, VOCAB_SIZE, (2, BATCH, WIDTH), generator=gen)
    share = POSITIVE_SHARE[dp_rank % len(POSITIVE_SHARE)]
    sign = torch.where(torch.rand(BATCH, generator=gen) < share, 1.0, -1.0)
    advantages = (sign * (torch.rand(BATCH, generator=gen) + 0.2))[:, None] * response_mask
    old = -(torch.rand(BATCH, WIDTH, generator=gen) * 2.5 + 1.5) * response_mask
    prompts, responses = prompts * prompt_mask, responses * response_mask
    return trinity_layout(prompts, prompt_mask, responses, response_mask, old, advantages)


def loss_class(path):
    """``TrinityPolicyLoss`` from the installed module, or from a file (the released copy)."""
    if not path:
        from trinity.trainer.verl.losses import TrinityPolicyLoss

        return TrinityPolicyLoss
    spec = importlib.util.spec_from_file_location("released_trinity_losses", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.TrinityPolicyLoss


def run_phase(engine, phase: str, options: dict, dp_rank: int) -> dict:
    """Train ``STEPS`` batches with one phase's loss; return what BAPO saw."""
    sync, name, released = PHASES[phase]
    loss = loss_class(released and options["released_losses"])(
        loss_config("bapo", loss_kwargs(name, sync_across_dp=sync))
    )
    recorder = LossRecorder(loss, engine.get_data_parallel_group(), keep_inputs=True)
    for step in range(STEPS):
        data = engine_batch(rank_batch(dp_rank, step), MICRO_BATCH, options["sp"] != "1")
        with engine.train_mode():
            engine.train_batch(data, loss_function=loss)
    for call in recorder.calls:
        call["data"] = {key: value.tolist() for key, value in call.pop("inputs").items()}
    return {"config": name, "calls": recorder.calls}


def engine_check(strategy: str, phases: str):
    """A check that builds the engine of ``strategy`` once and runs ``phases`` (default: option)."""

    def check(ctx) -> dict:
        options = ctx.options
        cpu_stand_ins(fsdp1=strategy == "fsdp")
        model_dir = save_model(build_model(0, hidden=32), Path(options["out"]) / "model")
        engine = build_engine(model_dir, strategy, sp_size=int(options["sp"]))
        dp_rank = engine.get_data_parallel_rank()
        names = (phases or options["phases"]).split(",")
        return {p: run_phase(engine, p, options, dp_rank) for p in names}

    return check


def trainer_batch(rank: int, config) -> TensorDict:
    """This rank's share of a batch, with the fields Trinity's ``_update_actor`` adds."""
    from verl.utils import tensordict_utils as tu

    data, size = rank_batch(rank, step=0), config.buffer.train_batch_size
    tu.assign_non_tensor(
        data,
        calculate_entropy=False,
        global_batch_size=size,
        mini_batch_size=size,
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
        temperature=1.0,
        compute_loss=True,
    )
    return data


def check_worker(ctx) -> dict:
    """Each config file to ``update_actor`` on this rank; returns what the driver checks."""
    return {sync: run_worker(ctx.rank, ctx.options[f"config_{sync}"]) for sync in ("true", "false")}


def run_worker(rank: int, path: str) -> dict:
    """One config file to one ``update_actor`` on this rank."""
    from trinity.common.config import load_config
    from trinity.trainer.verl.config import build_verl_config
    from trinity.trainer.verl.workers import TrinityActorRolloutRefWorker

    cpu_stand_ins(worker=True)
    save_model(build_model(0, hidden=32), Path(path).parent / "model")
    config = load_config(path).check_and_update()
    worker = TrinityActorRolloutRefWorker(build_verl_config(config), role="actor")
    worker.init_model()
    worker.set_trinity_config(config.algorithm, rollout_engine_type="vllm", ray_namespace="")
    loss = worker.actor.loss_fn
    recorder = LossRecorder(loss)
    data = trainer_batch(rank, config)
    # the micro-batches this rank's tokens need alone, as verl's dynamic batching counts them
    tokens = int(data["attention_mask"].sum())
    own_count = min(len(data), math.ceil(tokens / (config.trainer.max_token_len_per_gpu or tokens)))
    metrics = worker.update_actor(data).get_non_tensor("metrics")
    return {
        "engine_group": dist.get_process_group_ranks(worker.actor.engine.get_data_parallel_group()),
        "loss_class": type(loss).__name__,
        "sync_across_dp": recorder.sync_across_dp,
        "calls": recorder.calls,
        "own_micro_batches": own_count,
        "metrics": {k: v for k, v in metrics.items() if "bapo" in k or k.startswith("pg_")},
    }


CHECKS = {
    "fsdp2": engine_check("fsdp2", ""),
    "fsdp1": engine_check("fsdp", "sync"),
    "worker": check_worker,
}

if __name__ == "__main__":
    sys.exit(main(CHECKS))
