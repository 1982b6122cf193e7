"""torchrun worker: BAPO inside verl 0.8's real FSDP engine, and from a Trinity YAML to the loss.

``python -m torch.distributed.run --nproc_per_node=N -m engine_checks MODE ...`` (``tests/`` on
``PYTHONPATH``)

- ``engine --phases sync,authors,nosync,released``: every rank builds ``FSDPEngineWithLMHead``
  on the same tiny Llama and trains a few steps with ``engine.train_batch``, the loss being
  Trinity's ``TrinityPolicyLoss`` with the ``bapo`` policy loss. The engine alone decides the
  micro-batches and the group it passes. Phases: ``sync`` (``sync_across_dp: true``),
  ``authors`` (the authors' order and grid), ``nosync`` (a control that must disagree) and
  ``released`` (``TrinityPolicyLoss`` from the released ``losses.py``, given as a file with
  ``--released-losses``, which drops the group).
- ``worker --config YAML``: what a Trinity job does on each trainer rank, minus Ray:
  ``load_config`` and ``check_and_update``, ``build_verl_config``,
  ``TrinityActorRolloutRefWorker`` with ``init_model`` and ``set_trinity_config``, then one
  ``update_actor`` on this rank's share of a batch laid out as Trinity's trainer lays it out.

The harness's ``LossRecorder`` sits between ``TrinityPolicyLoss`` and BAPO and notes every
call's group, inputs and pair; each rank writes ``<out>/rank<r>.json`` for the pytest drivers
(``tests/test_engine_bapo.py``, ``tests/test_engine_worker.py``).
"""

import argparse
import importlib.util
import math
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from dist_checks import engine_rank_batch, loss_kwargs
from scripts.harness.engine import build_engine, cpu_stand_ins, engine_batch, group_ranks
from scripts.harness.launch import write_record
from scripts.harness.model import build_model, save_model
from scripts.harness.recorder import LossRecorder
from scripts.harness.variants import loss_config

STEPS = 2  # train_batch calls per phase
# Phase: (sync_across_dp, a config of cases.CONFIGS, the released losses.py). ``gradient`` stops
# the search at the first pair that meets the target, so pairs land inside the grid too.
PHASES = {
    "sync": (True, "paper_upper_gradient", False),
    "authors": (True, "yaml_lower_surrogate", False),
    "nosync": (False, "paper_upper_gradient", False),
    "released": (True, "paper_upper_gradient", True),
}


def plain(call):
    """A recorded call as JSON values."""
    inputs = call.pop("inputs", None)
    if inputs is not None:
        call["data"] = {key: value.tolist() for key, value in inputs.items()}
    return call


def loss_class(path):
    """``TrinityPolicyLoss`` from the installed module, or from a file (the released copy)."""
    if path is None:
        from trinity.trainer.verl.losses import TrinityPolicyLoss

        return TrinityPolicyLoss
    spec = importlib.util.spec_from_file_location("released_trinity_losses", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.TrinityPolicyLoss


def run_phase(engine, phase: str, args, dp_rank: int):
    """Train ``STEPS`` batches with one phase's loss; return what BAPO saw."""
    sync, config_name, released = PHASES[phase]
    loss = loss_class(args.released_losses if released else None)(
        loss_config("bapo", {**loss_kwargs(config_name), "sync_across_dp": sync})
    )
    recorder = LossRecorder.install(loss, engine.get_data_parallel_group(), keep_inputs=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            batch = engine_rank_batch(dp_rank, step)
            data = engine_batch(batch, args.micro_batch_size, use_remove_padding=args.sp > 1)
            with engine.train_mode():
                engine.train_batch(data, loss_function=loss)
    bapo_warnings = sorted({str(w.message) for w in caught if "BAPO" in str(w.message)})
    calls = [plain(call) for call in recorder.calls]
    return {"config": config_name, "calls": calls, "warnings": bapo_warnings}


def run_engine(args, rank: int) -> dict:
    """Build the engine once, run the phases."""
    cpu_stand_ins(fsdp1=args.strategy == "fsdp")
    model_dir = save_model(build_model(0, hidden=32), Path(args.out) / "model")
    engine = build_engine(
        model_dir, args.strategy, sp_size=args.sp, micro_batch_size=args.micro_batch_size
    )
    dp_rank = engine.get_data_parallel_rank()
    record = {"engine_group": group_ranks(engine.get_data_parallel_group()), "dp_rank": dp_rank}
    record["phases"] = {phase: run_phase(engine, phase, args, dp_rank) for phase in args.phases}
    return record


def trainer_batch(rank: int, config):
    """This rank's share of a batch as Trinity's ``_update_actor`` prepares it for the dispatch.

    Laid out by Trinity's ``left_right_2_no_padding``, with the non-tensor fields
    ``_update_actor`` adds (mini-batch = the whole batch, one epoch).
    """
    from verl.utils import tensordict_utils as tu

    data = engine_rank_batch(rank, step=0)
    size = config.buffer.train_batch_size
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


def run_worker(args, rank: int) -> dict:
    """Config file to ``update_actor`` on this rank; returns what the checks need."""
    from trinity.common.config import load_config
    from trinity.trainer.verl.config import build_verl_config
    from trinity.trainer.verl.workers import TrinityActorRolloutRefWorker

    cpu_stand_ins(worker=True)
    save_model(build_model(0, hidden=32), Path(args.out) / "model")
    config = load_config(args.config).check_and_update()
    worker = TrinityActorRolloutRefWorker(build_verl_config(config), role="actor")
    worker.init_model()
    worker.set_trinity_config(config.algorithm, rollout_engine_type="vllm", ray_namespace="")
    loss = worker.actor.loss_fn
    recorder = LossRecorder.install(loss)
    data = trainer_batch(rank, config)
    # the micro-batch count this rank's tokens need alone, as verl's dynamic batching counts it
    tokens = int(data["attention_mask"].sum())
    own_count = min(len(data), math.ceil(tokens / (config.trainer.max_token_len_per_gpu or tokens)))
    output = worker.update_actor(data)
    metrics = output.get_non_tensor("metrics") if output is not None else {}
    return {
        "engine_group": group_ranks(worker.actor.engine.get_data_parallel_group()),
        "loss_class": type(loss).__name__,
        "calls": [
            {
                "group_ranks": call["group_ranks"],
                "pair": [call["metrics"]["bapo_clip_low"], call["metrics"]["bapo_clip_high"]],
                "sync_across_dp": recorder.sync_across_dp,
            }
            for call in recorder.calls
        ],
        "own_micro_batches": own_count,
        "metrics": {k: v for k, v in metrics.items() if "bapo" in k or k.startswith("pg_")},
    }


def main(argv=None) -> int:
    """Start gloo, run one mode, write this rank's JSON (errors too, for the driver)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("engine", "worker"))
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="fsdp2")
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--phases", default="sync", type=lambda text: text.split(","))
    p.add_argument("--released-losses", default=None)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--config", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record: dict = {"rank": rank, "world": dist.get_world_size()}
    try:
        record.update((run_engine if args.mode == "engine" else run_worker)(args, rank))
    except Exception:  # the driver reports it with the rank
        record["error"] = traceback.format_exc()
    write_record(Path(args.out) / f"rank{rank}.json", record)
    dist.destroy_process_group()
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main())
