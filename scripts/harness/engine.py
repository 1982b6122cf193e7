"""verl 0.8's ``FSDPEngineWithLMHead`` on CPU (gloo): build it, lay batches out, read it back.

The engine Trinity's actor trains with runs unchanged on CPU given gloo, eager attention, no
``torch.compile`` and fp32 parameters (so that its log-probs and a plain copy's agree). Its
``train_batch`` splits the batch into micro-batches and calls the loss with its dp group.
"""

from pathlib import Path
from typing import Any, Dict, cast

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from scripts.harness.model import position_ids_for

FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def build_engine(model_dir: Path, strategy="fsdp2", lr=3e-3, sp_size=1, micro_batch_size=4, seed=0):
    """An initialised engine: AdamW, no weight decay, clipping at 1.0, fp32; ``sp_size``: SP."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    unpadded = dict(use_remove_padding=sp_size > 1)
    model: Dict[str, Any] = dict(
        path=str(model_dir), load_tokenizer=False, enable_gradient_checkpointing=False
    )
    model_config = HFModelConfig(
        **model, **unpadded, override_config={"attn_implementation": "eager"}
    )
    parts = dict(strategy=strategy, use_torch_compile=False, use_dynamic_bsz=False, seed=seed)
    parts.update(micro_batch_size_per_gpu=micro_batch_size, ulysses_sequence_parallel_size=sp_size)
    engine_config = FSDPEngineConfig(**parts, **unpadded, mixed_precision=FP32)
    optimizer_config = FSDPOptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0)
    engine = FSDPEngineWithLMHead(model_config, engine_config, optimizer_config, CheckpointConfig())
    engine.initialize()
    return engine


class EngineActor:
    """verl's TrainingWorker as far as Trinity's worker uses it: the engine and the loss set.

    ``train_batch`` is one optimizer update, the call TrainingWorker makes on its engine.
    """

    def __init__(self, engine):
        """The engine, its config (micro-batch settings), and no loss yet."""
        self.engine, self.engine_config, self.loss_fn = engine, engine.engine_config, None

    def set_loss_fn(self, loss_fn):
        """As TrainingWorker.set_loss_fn."""
        self.loss_fn = loss_fn

    def train_batch(self, data):
        """As TrainingWorker.train_batch, less its metrics' post-processing."""
        return self.engine.train_batch(data, loss_function=self.loss_fn)


def worker_actor(engine, algo_config) -> EngineActor:
    """The actor of Trinity's worker after ``set_trinity_config`` (no Ray: the method alone).

    Its ``train_batch`` is then the worker's ``train_batch_in_update``: one optimizer update in
    the policy loss's ``optimizer_update``, so an update's pass runs as in production.
    """
    from trinity.trainer.verl.workers import TrinityActorRolloutRefWorker

    worker, actor = object.__new__(TrinityActorRolloutRefWorker), EngineActor(engine)
    worker.actor = cast(Any, actor)  # the part of a TrainingWorker the worker uses
    worker.set_trinity_config(algo_config, "vllm", "harness")
    return actor


def engine_batch(data: TensorDict, micro_batch_size: int, use_remove_padding=False) -> TensorDict:
    """Add the fields the engine reads: ``len(data) // micro_batch_size`` micro-batches, T = 1."""
    fixed = dict(use_dynamic_bsz=False, temperature=1.0, calculate_entropy=False)
    tu.assign_non_tensor(
        data, **fixed, use_fused_kernels=False, use_remove_padding=use_remove_padding
    )
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=micro_batch_size)
    return data


def trinity_layout(prompts, prompt_mask, responses, response_mask, old_log_probs, advantages):
    """A padded batch converted by Trinity's ``left_right_2_no_padding``, as its trainer does."""
    from trinity.trainer.verl.monkey_patch import left_right_2_no_padding

    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    fields = dict(prompts=prompts, responses=responses, response_mask=response_mask)
    fields.update(input_ids=torch.cat([prompts, responses], dim=1), attention_mask=attention_mask)
    fields.update(position_ids=position_ids_for(attention_mask), old_log_probs=old_log_probs)
    data = TensorDict({**fields, "advantages": advantages}, batch_size=[prompts.shape[0]])
    use_torch_unpad_input()
    return left_right_2_no_padding(data)


def use_torch_unpad_input() -> None:
    """Give Trinity's padding helper transformers' torch ``unpad_input`` for flash-attn's."""
    from transformers.modeling_flash_attention_utils import _unpad_input

    import trinity.trainer.verl.monkey_patch as trinity_patch

    trinity_patch.unpad_input = _unpad_input


def full_state_dict(engine) -> Dict[str, torch.Tensor]:
    """The engine's current weights, gathered whole on every rank (for a rollout copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    state = get_model_state_dict(engine.module, options=options)
    return {name: cast(torch.Tensor, value).detach().clone() for name, value in state.items()}
