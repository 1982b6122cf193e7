"""verl 0.8's FSDP training engine on CPU (gloo): build it, feed it, read its weights back.

``FSDPEngineWithLMHead`` is the engine Trinity's actor worker trains with. Built directly (verl's
engine registry lists it for CUDA and NPU only), it runs unchanged on CPU once
``torch.distributed`` uses gloo, given eager attention (the default is flash-attention) and no
``torch.compile``. We also keep the parameters in fp32 (the default mixed precision computes in
bf16), so that the engine's log-probs and those of a plain fp32 copy of the model agree. The
model is a small Llama saved with ``save_pretrained`` to a folder, because the engine loads its
model from a path.

Each call to ``engine.train_batch(batch, loss_function=...)`` does what Trinity's actor does in
``update_actor``: split the rank's batch into micro-batches (the same count on every rank of
the data-parallel group), run the forward pass, call the loss with
``dp_group=engine.get_data_parallel_group()``, backward, clip and step.
"""

from pathlib import Path
from typing import Dict, Optional, cast

import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers import PreTrainedModel
from verl.utils import tensordict_utils as tu

FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def save_model(model: PreTrainedModel, folder: Path) -> Path:
    """Write a model as a Hugging Face folder the engine can load (rank 0 only, then a barrier)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(str(folder), safe_serialization=True)
    if dist.is_initialized():
        dist.barrier()
    return folder


def build_engine(
    model_dir: Path,
    strategy: str = "fsdp2",
    lr: float = 3e-3,
    sp_size: int = 1,
    micro_batch_size: int = 4,
    seed: int = 0,
):
    """An initialised ``FSDPEngineWithLMHead`` with AdamW, fp32, eager attention.

    ``sp_size > 1`` turns on Ulysses sequence parallelism, which verl allows only with
    ``use_remove_padding``; the data-parallel group is then the mesh's ``dp`` dimension.
    """
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


def engine_batch(
    data: TensorDict,
    micro_batch_size: int,
    use_remove_padding: bool = False,
    calculate_entropy: bool = False,
) -> TensorDict:
    """Add the non-tensor fields the engine reads to a rank's no-padding batch.

    With a fixed micro-batch size (no dynamic batching) the engine splits the batch into
    ``len(data) // micro_batch_size`` micro-batches; ``temperature`` 1 keeps the log-probs
    those of the sampling distribution; ``calculate_entropy`` adds per-token entropies to the
    model output the loss receives.
    """
    tu.assign_non_tensor(
        data,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
        use_remove_padding=use_remove_padding,
        temperature=1.0,
        calculate_entropy=calculate_entropy,
        use_fused_kernels=False,
    )
    return data


def full_state_dict(engine) -> Dict[str, torch.Tensor]:
    """The engine's current weights, gathered whole on every rank (for a rollout copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    state = get_model_state_dict(engine.module, options=options)
    return {name: cast(torch.Tensor, value).detach().clone() for name, value in state.items()}


def group_ranks(group: Optional[dist.ProcessGroup]):
    """Global ranks of a process group (None: the loss got no group)."""
    if group is None:
        return None
    return dist.get_process_group_ranks(group)
