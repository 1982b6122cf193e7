"""torchrun worker: a Trinity YAML config, through Trinity's actor worker, into BAPO (CPU, gloo).

What a Trinity training job does on each trainer rank, minus Ray:

1. ``trinity.common.config.load_config`` reads the YAML (``algorithm_type: bapo`` with
   ``policy_loss_fn_args.sync_across_dp``) and ``check_and_update`` fills in the preset;
2. ``build_verl_config`` turns it into verl's worker config;
3. ``TrinityActorRolloutRefWorker(config, role="actor")``, then ``init_model`` (verl's
   ``TrainingWorker`` and its ``FSDPEngineWithLMHead``) and ``set_trinity_config`` (which
   builds ``TrinityPolicyLoss`` from the algorithm config and installs it);
4. the batch as Trinity's trainer prepares it for ``update_actor`` (its
   ``left_right_2_no_padding`` and the same non-tensor fields), then one ``update_actor``.

Only the Ray dispatch in front of ``update_actor`` is bypassed: each rank calls the method on
its own worker with its own share of the batch, as the dispatch would hand it. A spy on the
policy loss records the group and the pair at each call; the returned metrics are written to
``<out>/rank<r>.json`` for the driver (``tests/test_engine_worker.py``).
"""

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # `demo` package
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from demo.batch import use_torch_unpad_input  # noqa: E402
from demo.engine import group_ranks, save_model  # noqa: E402
from engine_common import make_rank_batch, tiny_model  # noqa: E402


def apply_cpu_shims():
    """The CPU-only stand-ins the actor worker needs, and only those.

    - verl's engine registry lists ``FSDPEngineWithLMHead`` for the devices ``cuda`` and
      ``npu``; ``TrainingWorker`` looks it up under ``get_device_name()``, which is ``cpu``
      here. Register the same class for ``cpu``.
    - ``torch.cpu`` lacks the CUDA memory counters verl logs after each update
      (``max_memory_allocated`` and friends) and ``empty_cache``: zeros and a no-op.
    - Trinity's ``_build_module`` (its patch of the engine) asks
      ``torch.cuda.get_device_capability(0)`` to decide whether ranks other than 0 build the
      model on the meta device (only from capability 9); report capability (0, 0), so every
      rank builds it on the CPU.
    - Trinity's ``left_right_2_no_padding`` packs with flash-attention's ``unpad_input``, which
      a CPU install lacks: the same packing in plain torch (``demo.batch.torch_unpad_input``).
    """
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    EngineRegistry.register("language_model", ["fsdp", "fsdp2"], "cpu")(FSDPEngineWithLMHead)
    for name in (
        "max_memory_allocated",
        "max_memory_reserved",
        "memory_allocated",
        "memory_reserved",
    ):
        setattr(torch.cpu, name, lambda *args, **kwargs: 0)
    torch.cpu.empty_cache = lambda: None
    torch.cuda.get_device_capability = lambda *args, **kwargs: (0, 0)

    use_torch_unpad_input()


class LossSpy:
    """Between TrinityPolicyLoss and BAPO: records the group and the chosen pair per call."""

    def __init__(self, inner):
        """Wrap ``inner`` (BAPO, as set_trinity_config built it)."""
        self._inner, self.calls = inner, []

    def __getattr__(self, name):
        """Everything else is the real loss's."""
        return getattr(self._inner, name)

    def __call__(self, *args, dp_group=None, **kwargs):
        """Run the real loss, then record the group and the pair."""
        loss, metrics = self._inner(*args, dp_group=dp_group, **kwargs)
        self.calls.append(
            {
                "group_ranks": group_ranks(dp_group),
                "pair": [metrics["bapo_clip_low"], metrics["bapo_clip_high"]],
                "sync_across_dp": self._inner.sync_across_dp,
            }
        )
        return loss, metrics


def trainer_batch(rank: int, config):
    """This rank's share of a batch as Trinity's ``_update_actor`` prepares it for the dispatch.

    ``make_rank_batch`` lays it out with Trinity's ``left_right_2_no_padding``; the non-tensor
    fields are those ``_update_actor`` adds (mini-batch = the whole batch, one epoch).
    """
    from verl.utils import tensordict_utils as tu

    data = make_rank_batch(rank, step=0)
    tu.assign_non_tensor(
        data,
        calculate_entropy=False,
        global_batch_size=config.buffer.train_batch_size,
        mini_batch_size=config.buffer.train_batch_size,
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
        temperature=1.0,
        compute_loss=True,
    )
    return data


def run(args, rank):
    """Config file to update_actor on this rank; returns what the checks need."""
    from trinity.common.config import load_config
    from trinity.trainer.verl.config import build_verl_config
    from trinity.trainer.verl.workers import TrinityActorRolloutRefWorker

    config = load_config(args.config).check_and_update()
    worker = TrinityActorRolloutRefWorker(build_verl_config(config), role="actor")
    worker.init_model()
    worker.set_trinity_config(config.algorithm, rollout_engine_type="vllm", ray_namespace="")
    loss = worker.actor.loss_fn
    spy = LossSpy(loss.policy_loss_fn)
    loss.policy_loss_fn = spy
    data = trainer_batch(rank, config)
    # the micro-batch count this rank's tokens need alone, as verl's dynamic batching counts it
    tokens = int(data["attention_mask"].sum())
    own_count = min(len(data), math.ceil(tokens / config.trainer.max_token_len_per_gpu))
    output = worker.update_actor(data)
    metrics = output.get_non_tensor("metrics") if output is not None else {}
    return {
        "engine_group": group_ranks(worker.actor.engine.get_data_parallel_group()),
        "loss_class": type(loss).__name__,
        "calls": spy.calls,
        "own_micro_batches": own_count,
        "metrics": {k: v for k, v in metrics.items() if "bapo" in k or k.startswith("pg_")},
    }


def main():
    """Start gloo, apply the CPU shims, run, write this rank's JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--config", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record = {"rank": rank}
    try:
        apply_cpu_shims()
        save_model(tiny_model(), Path(args.out) / "model")
        record.update(run(args, rank))
    except Exception:  # the driver reports it with the rank
        record["error"] = traceback.format_exc()
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record, default=str))
    dist.destroy_process_group()
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main())
