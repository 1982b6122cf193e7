"""verl 0.8's ``FSDPEngineWithLMHead`` on CPU (gloo): build it, lay batches out, read it back.

The engine Trinity's actor trains with runs unchanged on CPU given gloo, eager attention, no
``torch.compile`` and fp32 parameters (so that its log-probs and a plain copy's agree). Its
``train_batch`` splits the batch into micro-batches and calls the loss with its dp group.
"""

from pathlib import Path
from typing import Dict, cast

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from scripts.harness.model import position_ids_for

FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def build_engine(
    model_dir: Path,
    strategy: str = "fsdp2",
    lr: float = 3e-3,
    sp_size: int = 1,
    micro_batch_size: int = 4,
    seed: int = 0,
):
    """An initialised engine: AdamW, no weight decay, clipping at 1.0, fp32; ``sp_size``: SP."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model_config = HFModelConfig(
        path=str(model_dir),
        load_tokenizer=False,
        override_config={"attn_implementation": "eager"},
        enable_gradient_checkpointing=False,
        use_remove_padding=sp_size > 1,
    )
    engine_config = FSDPEngineConfig(
        strategy=strategy,
        use_torch_compile=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
        mixed_precision=FP32,
        ulysses_sequence_parallel_size=sp_size,
        use_remove_padding=sp_size > 1,
        seed=seed,
    )
    optimizer_config = FSDPOptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0)
    engine = FSDPEngineWithLMHead(model_config, engine_config, optimizer_config, CheckpointConfig())
    engine.initialize()
    return engine


def engine_batch(data: TensorDict, micro_batch_size: int, use_remove_padding=False) -> TensorDict:
    """Add the fields the engine reads: ``len(data) // micro_batch_size`` micro-batches, T = 1."""
    tu.assign_non_tensor(
        data,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
        use_remove_padding=use_remove_padding,
        temperature=1.0,
        calculate_entropy=False,
        use_fused_kernels=False,
    )
    return data


def trinity_layout(
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
) -> TensorDict:
    """A padded batch converted by Trinity's ``left_right_2_no_padding``, as its trainer does."""
    from trinity.trainer.verl.monkey_patch import left_right_2_no_padding

    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    data = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids_for(attention_mask),
            "response_mask": response_mask,
            "old_log_probs": old_log_probs,
            "advantages": advantages,
        },
        batch_size=[prompts.shape[0]],
    )
    use_torch_unpad_input()
    return left_right_2_no_padding(data)


def use_torch_unpad_input() -> None:
    """Give Trinity's padding helper transformers' torch ``unpad_input`` for flash-attn's."""
    from transformers.modeling_flash_attention_utils import _unpad_input

    import trinity.trainer.verl.monkey_patch as trinity_patch

    trinity_patch.unpad_input = _unpad_input


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
        counters = ("max_memory_allocated", "max_memory_reserved", "memory_allocated")
        for name in (*counters, "memory_reserved"):
            setattr(torch.cpu, name, lambda *args, **kwargs: 0)
        torch.cuda.get_device_capability = lambda *args, **kwargs: (0, 0)
        use_torch_unpad_input()


def full_state_dict(engine) -> Dict[str, torch.Tensor]:
    """The engine's current weights, gathered whole on every rank (for a rollout copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    state = get_model_state_dict(engine.module, options=options)
    return {name: cast(torch.Tensor, value).detach().clone() for name, value in state.items()}
