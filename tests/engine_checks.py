"""Checks inside verl 0.8's FSDP engine, run on every rank by the harness's DP worker.

- ``engine`` (options ``strategy``, ``sp``, ``phases``, ``released_losses``): every rank builds
  ``FSDPEngineWithLMHead`` on one tiny Llama and trains ``engine.train_batch`` steps through
  ``TrinityPolicyLoss`` around ``bapo``; the engine alone picks the micro-batches and the group.
  Phases: ``sync``, ``authors`` (their order and grid), ``nosync`` and ``released`` (the
  released ``losses.py``, which drops the group): the last two controls must disagree.
- ``worker`` (option ``config``): a Trinity trainer rank minus Ray, from the YAML to one
  ``update_actor`` on this rank's share of a batch.
"""

import importlib.util
import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

from dist_checks import loss_kwargs
from scripts.harness.engine import build_engine, cpu_stand_ins, engine_batch, trinity_layout
from scripts.harness.model import build_model, save_model
from scripts.harness.recorder import LossRecorder
from scripts.harness.tasks import VOCAB_SIZE
from scripts.harness.variants import loss_config

STEPS, MICRO_BATCH = 2, 4  # train_batch calls per phase, sequences per micro-batch
# Phase: (sync_across_dp, a config of dist_checks.CONFIGS, the released losses.py). ``gradient``
# stops the search at the first pair that meets the target, so pairs land inside the grid too.
PHASES = {
    "sync": (True, "paper_upper_gradient", False),
    "authors": (True, "yaml_lower_surrogate", False),
    "nosync": (False, "paper_upper_gradient", False),
    "released": (True, "paper_upper_gradient", True),
}
BATCH, WIDTH = 8, 6  # sequences per data-parallel rank and step; prompt and response width
# Share of positive sequences per data-parallel rank: apart, so that alone they choose apart.
POSITIVE_SHARE = (0.75, 0.15, 0.5, 0.3)


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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            data = engine_batch(rank_batch(dp_rank, step), MICRO_BATCH, options["sp"] != "1")
            with engine.train_mode():
                engine.train_batch(data, loss_function=loss)
    for call in recorder.calls:
        call["data"] = {key: value.tolist() for key, value in call.pop("inputs").items()}
    bapo_warnings = sorted({str(w.message) for w in caught if "BAPO" in str(w.message)})
    return {"config": name, "calls": recorder.calls, "warnings": bapo_warnings}


def check_engine(ctx) -> dict:
    """Build the engine once, run the phases."""
    options = ctx.options
    cpu_stand_ins(fsdp1=options["strategy"] == "fsdp")
    model_dir = save_model(build_model(0, hidden=32), Path(options["out"]) / "model")
    engine = build_engine(model_dir, options["strategy"], sp_size=int(options["sp"]))
    dp_rank = engine.get_data_parallel_rank()
    phases = {p: run_phase(engine, p, options, dp_rank) for p in options["phases"].split(",")}
    return {
        "engine_group": dist.get_process_group_ranks(engine.get_data_parallel_group()),
        "phases": phases,
    }


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
    """Config file to ``update_actor`` on this rank; returns what the driver checks."""
    from trinity.common.config import load_config
    from trinity.trainer.verl.config import build_verl_config
    from trinity.trainer.verl.workers import TrinityActorRolloutRefWorker

    cpu_stand_ins(worker=True)
    save_model(build_model(0, hidden=32), Path(ctx.options["config"]).parent / "model")
    config = load_config(ctx.options["config"]).check_and_update()
    worker = TrinityActorRolloutRefWorker(build_verl_config(config), role="actor")
    worker.init_model()
    worker.set_trinity_config(config.algorithm, rollout_engine_type="vllm", ray_namespace="")
    loss = worker.actor.loss_fn
    recorder = LossRecorder(loss)
    data = trainer_batch(ctx.rank, config)
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


CHECKS = {"engine": check_engine, "worker": check_worker}
