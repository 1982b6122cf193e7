"""The CPU stand-ins: what verl's engine and Trinity's trainer ranks lack on a machine without CUDA.

One home for the tests, which call ``cpu_stand_ins`` in their own ranks, and for the Ray worker
processes of ``make trinity-run``, where ``ray_site/sitecustomize.py`` calls ``install_from_env``:
inert unless the launcher sets ``STAND_INS_ENV``, and then applied only once Trinity's verl
workers module is imported (in verl's ``WorkerDict`` ranks and the trainer that spawns them),
so Ray's other processes import nothing more. Nothing here edits an installed file; each
stand-in replaces one attribute in the running process.
"""

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

STAND_INS_ENV = "BAPO_CPU_STAND_INS"  # "1": the Ray workers take the stand-ins
CALL_LOG_ENV = "BAPO_CALL_LOG"  # a folder: each rank appends its loss calls to rank<N>.jsonl
WORKERS_MODULE = "trinity.trainer.verl.workers"


def cpu_stand_ins(fsdp1: bool = False, worker: bool = False) -> None:
    """What a CPU-only machine lacks, and only that (docs/testing.md lists each stand-in).

    ``fsdp1``: FSDP1's check of CPU module states is skipped (gloo broadcasts them fine);
    ``worker``: Trinity's actor worker builds the engine, and the model, on CPU.
    """
    import torch

    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None  # type: ignore[attr-defined]
    if fsdp1:
        from torch.distributed.fsdp import _init_utils

        _init_utils._check_module_states_for_sync_module_states = lambda module_states: None
    if worker:
        from verl.workers.engine import EngineRegistry
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        from scripts.harness.engine import use_torch_unpad_input

        EngineRegistry.register("language_model", ["fsdp", "fsdp2"], "cpu")(FSDPEngineWithLMHead)
        for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated"):
            setattr(torch.cpu, name, lambda *args, **kwargs: 0)
        torch.cpu.memory_reserved = lambda *args, **kwargs: 0  # type: ignore[attr-defined]
        torch.cuda.get_device_capability = lambda *args, **kwargs: (0, 0)
        use_torch_unpad_input()


def ray_worker_stand_ins() -> None:
    """A trainer rank under Ray: the worker's stand-ins, gloo, and the loss calls recorded.

    verl's workers start their process group with ``cpu:gloo,<device>:nccl`` unless told a
    backend, which torch refuses when the device is the CPU: gloo becomes that default.
    """
    from verl.utils import distributed

    cpu_stand_ins(worker=True)
    distributed.initialize_global_process_group_ray.__defaults__ = (None, "gloo")
    if os.environ.get(CALL_LOG_ENV):
        record_loss_calls(Path(os.environ[CALL_LOG_ENV]))


def record_loss_calls(folder: Path) -> None:
    """Every ``TrinityPolicyLoss`` built from now on appends each call to ``folder``."""
    from scripts.harness.recorder import LossRecorder
    from trinity.trainer.verl.losses import TrinityPolicyLoss

    build = TrinityPolicyLoss.__init__

    def build_recorded(self, *args, **kwargs):
        build(self, *args, **kwargs)
        LossRecorder(self, log_dir=folder)

    TrinityPolicyLoss.__init__ = build_recorded  # type: ignore[method-assign]


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then`` once, right after module ``name`` has been executed (a post-import hook)."""

    def __init__(self, name: str, then: Callable[[], None]):
        """Watch for ``name``."""
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        """Find ``name`` the usual way, with its loader's ``exec_module`` followed by ``then``."""
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        execute = spec.loader.exec_module  # type: ignore[union-attr]

        def execute_then(module):
            execute(module)
            self.then()

        spec.loader.exec_module = execute_then  # type: ignore[union-attr, method-assign]
        return spec


def install_from_env() -> None:
    """Arm ``ray_worker_stand_ins`` for this process where ``STAND_INS_ENV`` is "1"."""
    if os.environ.get(STAND_INS_ENV) == "1":
        sys.meta_path.insert(0, AfterImport(WORKERS_MODULE, ray_worker_stand_ins))
