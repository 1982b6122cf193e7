"""The CPU stand-ins: what verl's engine, Trinity's trainers and vLLM explorer lack without CUDA.

One home for the tests, which call ``cpu_stand_ins`` in their own ranks, and for the Ray worker
processes of ``make trinity-run``, where ``ray_site/sitecustomize.py`` calls ``install_from_env``:
inert unless the launcher sets ``STAND_INS_ENV`` (the trainer's) or ``VLLM_STAND_INS_ENV`` (the
explorer's), and then applied only once the module they change is imported (Trinity's verl
workers module in verl's ``WorkerDict`` ranks and the trainer that spawns them; Trinity's vLLM
worker and weight-transfer modules in vLLM's processes), so Ray's other processes import nothing
more. Nothing here edits an installed file; each stand-in replaces one attribute in the running
process.
"""

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

STAND_INS_ENV = "BAPO_CPU_STAND_INS"  # "1": the Ray workers take the stand-ins
CALL_LOG_ENV = "BAPO_CALL_LOG"  # a folder: each rank appends its loss calls to rank<N>.jsonl
VLLM_STAND_INS_ENV = "BAPO_VLLM_STAND_INS"  # "1": the Ray workers take the explorer's stand-ins
WORKERS_MODULE = "trinity.trainer.verl.workers"
VLLM_WORKER_MODULE = "trinity.common.models.vllm_worker"
TRANSFER_MODULE = "trinity.common.models.vllm_extension"


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


def vllm_cpu_worker() -> None:
    """The CPU worker of vLLM in place of Trinity's ``TrinityGPUWorker``, which vLLM is told to use.

    The stand-in keeps what Trinity's worker adds: its patches, and its checkpoint weight
    transfer engine registered before the model loads.
    """
    from vllm.v1.worker.cpu_worker import CPUWorker

    from trinity.common.models import vllm_worker
    from trinity.common.models.vllm_extension import register_checkpoint_weight_transfer_engine

    class TrinityCPUWorker(CPUWorker):
        apply_patches = vllm_worker.TrinityGPUWorker.apply_patches

        def load_model(self, *args, **kwargs):
            register_checkpoint_weight_transfer_engine()
            return super().load_model(*args, **kwargs)

    vllm_worker.TrinityGPUWorker = TrinityCPUWorker  # type: ignore[misc]


def checkpoint_transfer_alone() -> None:
    """Trinity's checkpoint transfer engine without its NCCL group: rank 0 loads the checkpoint.

    Under ``sync_method: checkpoint`` that engine still builds an NCCL group of the explorer's
    ranks, and rank 0 broadcasts the weights to the others on CUDA. With one engine of tensor
    parallel size 1 rank 0 is the only rank, so it loads the checkpoint on the CPU itself.
    """
    from trinity.common.models.utils import load_state_dict_iterator
    from trinity.common.models.vllm_extension import CheckpointWeightTransferEngine as Engine

    def init_alone(self, init_info) -> None:
        if init_info.world_size != 1 or init_info.sync_method != "checkpoint":
            raise RuntimeError(
                "the CPU stand-in loads checkpoints on one vLLM engine of tensor parallel size 1 "
                f"(sync_method: checkpoint); got world size {init_info.world_size}, sync_method "
                f"{init_info.sync_method}"
            )
        self.model_update_group = None

    def load_alone(self, update_info, load_weights) -> None:
        if update_info.checkpoint_path is None:
            raise ValueError("checkpoint_path must be provided for checkpoint sync method")
        load_weights(list(load_state_dict_iterator(checkpoint_dir=update_info.checkpoint_path)))

    Engine.init_transfer_engine = init_alone  # type: ignore[method-assign]
    Engine.receive_weights = load_alone  # type: ignore[method-assign]


def vllm_distribution() -> None:
    """The version of the distribution ``vllm``, which verl asks for, is the CPU build's.

    That build installs the ``vllm`` package as the distribution ``vllm-cpu``; the answer is
    vLLM's own for it (its platform check reads ``vllm-cpu``'s version with ``+cpu`` appended,
    and takes the CPU platform only where the version names it).
    """
    from importlib import metadata

    lookup = metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return f"{lookup('vllm-cpu')}+cpu"
        return lookup(distribution_name)

    metadata.version = version


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
    """Arm the stand-ins switched on: the trainer's (``STAND_INS_ENV``), the explorer's."""
    if os.environ.get(STAND_INS_ENV) == "1":
        sys.meta_path.insert(0, AfterImport(WORKERS_MODULE, ray_worker_stand_ins))
    if os.environ.get(VLLM_STAND_INS_ENV) == "1":
        vllm_distribution()
        sys.meta_path.insert(0, AfterImport(VLLM_WORKER_MODULE, vllm_cpu_worker))
        sys.meta_path.insert(0, AfterImport(TRANSFER_MODULE, checkpoint_transfer_alone))
