"""torchrun worker: BAPO inside verl 0.8's real FSDP engine, on CPU with gloo.

Every rank builds ``FSDPEngineWithLMHead`` on the same tiny Llama and trains it for a few
steps with ``engine.train_batch``, the loss being Trinity's ``TrinityPolicyLoss`` with the
``bapo`` policy loss. The engine alone decides the micro-batches and the group it passes to
the loss. A recorder between ``TrinityPolicyLoss`` and BAPO writes down, at every call, the
group that arrived, the tensors BAPO saw and the pair it chose; each rank writes them to
``<out>/rank<r>.json`` and the pytest driver (``tests/test_engine_bapo.py``) checks agreement
and runs the literal oracle on the union of the group's micro-batches.

Phases, one engine for all (``--phases``):

- ``sync``: the patched ``TrinityPolicyLoss`` with ``sync_across_dp: true``;
- ``authors``: the same with the authors' order and grid (``lower_first``, ``surrogate``);
- ``nosync``: the same with ``sync_across_dp: false`` (a control that must disagree);
- ``released``: ``TrinityPolicyLoss`` from the released ``losses.py`` (patch 0002 reverted in a
  temporary copy the driver passes as ``--released-losses``), which drops the group.
"""

import argparse
import importlib.util
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # `demo` package
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from demo.engine import build_engine, engine_batch, group_ranks, save_model  # noqa: E402
from engine_common import PHASES, STEPS, algo_config, make_rank_batch, tiny_model  # noqa: E402


class LossRecorder:
    """Sits where ``TrinityPolicyLoss`` keeps its policy loss; records each call, then calls it.

    Every attribute other than the call is the real loss's (``select_keys`` in particular).
    """

    def __init__(self, inner, engine_group):
        """Wrap ``inner``; ``engine_group`` is what a call should receive."""
        self._inner, self._engine_group = inner, engine_group
        self.calls = []

    def __getattr__(self, name):
        """Everything else is the real loss's."""
        return getattr(self._inner, name)

    def __call__(self, logprob, dp_group=None, **kwargs):
        """Run the real loss, then record its inputs, group and metrics."""
        loss, metrics = self._inner(logprob=logprob, dp_group=dp_group, **kwargs)
        data = {
            "logprob": logprob.detach(),
            "old_logprob": kwargs["old_log_probs"],
            "advantages": kwargs["advantages"],
            "mask": kwargs["response_mask"].to(torch.int64),
        }
        self.calls.append(
            {
                "group_ranks": group_ranks(dp_group),
                "is_engine_group": dp_group is self._engine_group,
                "data": {key: value.tolist() for key, value in data.items()},
                "metrics": {key: float(value) for key, value in metrics.items()},
            }
        )
        return loss, metrics


def load_loss_class(path):
    """``TrinityPolicyLoss`` from the installed module, or from a file (the released copy)."""
    if path is None:
        from trinity.trainer.verl.losses import TrinityPolicyLoss

        return TrinityPolicyLoss
    spec = importlib.util.spec_from_file_location("released_trinity_losses", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TrinityPolicyLoss


def run_phase(engine, phase, args, dp_rank):
    """Train ``STEPS`` batches with one phase's loss; return what BAPO saw."""
    sync, config_name, released = PHASES[phase]
    loss_class = load_loss_class(args.released_losses if released else None)
    loss = loss_class(algo_config(sync, config_name))
    recorder = LossRecorder(loss.policy_loss_fn, engine.get_data_parallel_group())
    loss.policy_loss_fn = recorder
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            batch = make_rank_batch(dp_rank, step)
            data = engine_batch(batch, args.micro_batch_size, use_remove_padding=args.sp > 1)
            with engine.train_mode():
                engine.train_batch(data, loss_function=loss)
    bapo_warnings = sorted({str(w.message) for w in caught if "BAPO" in str(w.message)})
    return {"config": config_name, "calls": recorder.calls, "warnings": bapo_warnings}


def apply_fsdp1_cpu_shims():
    """The two changes FSDP1 (``strategy: fsdp``) needs on a CPU-only machine.

    - verl's memory helpers call ``torch.cpu.empty_cache``, which CPU torch lacks: a no-op.
    - FSDP1 refuses CPU module states with ``sync_module_states=True`` (which verl always
      sets), although gloo broadcasts CPU tensors fine: skip that one check, keep the
      broadcast.
    """
    from torch.distributed.fsdp import _init_utils

    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None
    _init_utils._check_module_states_for_sync_module_states = lambda module_states: None


def main():
    """Build the engine once, run the phases, write this rank's JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="fsdp2")
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--phases", default="sync")
    p.add_argument("--released-losses", default=None)
    p.add_argument("--micro-batch-size", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record = {"rank": rank, "world": dist.get_world_size(), "phases": {}}
    try:
        if args.strategy == "fsdp":
            apply_fsdp1_cpu_shims()
        model_dir = save_model(tiny_model(), Path(args.out) / "model")
        engine = build_engine(
            model_dir, args.strategy, sp_size=args.sp, micro_batch_size=args.micro_batch_size
        )
        record["engine_group"] = group_ranks(engine.get_data_parallel_group())
        dp_rank = engine.get_data_parallel_rank()
        record["dp_rank"] = dp_rank
        for phase in args.phases.split(","):
            record["phases"][phase] = run_phase(engine, phase, args, dp_rank)
    except Exception:  # the driver reports it with the rank
        record["error"] = traceback.format_exc()
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main())
