"""What ``make trinity-run`` trains on, built from code with nothing downloaded.

A tiny random Qwen2 with a word-level tokenizer; a sqlite experience buffer of GRPO groups whose
rollout log-probs are stale (they differ from the model's, so the clip search has work to do),
written through Trinity's own storage; and the example ``examples/bapo_gsm8k/gsm8k.yaml`` with
what a CPU and this buffer need written over it (``mode: train``, 2 trainer ranks).
"""

import asyncio
import math
from pathlib import Path
from typing import Any, Dict

import yaml

from scripts.harness.launch import REPO

EXAMPLE = REPO / "examples" / "bapo_gsm8k" / "gsm8k.yaml"
RANKS, GROUP, GROUPS_PER_STEP = 2, 4, 4  # trainer ranks; GRPO group size; groups per step
VOCAB, PAD, EOS = 64, 0, 1
# Over the example: train from the sqlite buffer on 2 ranks, with what a CPU needs. verl reads
# trainer_config's model and actor keys; Trinity takes use_remove_padding from trainer alone.
CPU_RUN = """\
mode: train
project: bapo-trinity-run
name: {name}
checkpoint_root_dir: {out}/checkpoints
monitor:
  monitor_type: tensorboard
algorithm:
  repeat_times: {group}
  optimizer:
    lr: 1.0e-3
  policy_loss_fn_args:
    sync_across_dp: {sync}
    search_scope: {scope}
model:
  model_path: {out}/model
  max_response_tokens: 8
  max_model_len: 16
cluster:
  node_num: 1
  gpu_per_node: {ranks}
buffer:
  total_epochs: 1
  batch_size: {groups}
  train_batch_size: {batch}
  trainer_input:
    experience_buffer:
      name: bapo_buffer
      storage_type: sql
      path: sqlite:///{out}/buffer.db
      max_read_timeout: 30
trainer:
  trainer_strategy: fsdp2
  total_steps: {steps}
  save_interval: {steps}
  max_token_len_per_gpu: 64
  use_remove_padding: false
  trainer_config:
    model:
      enable_gradient_checkpointing: false
      override_config:
        attn_implementation: eager
    actor:
      use_torch_compile: false
      fsdp_config:
        mixed_precision:
          param_dtype: fp32
          reduce_dtype: fp32
          buffer_dtype: fp32
"""


def build_model(folder: Path) -> None:
    """A random 2-layer Qwen2 (hidden 32, vocabulary 64) and a word-level tokenizer, saved."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from scripts.harness.model import build_qwen2

    shape: Dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2
    )
    shape.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    shape.update(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    build_qwen2(shape, torch.float32, "cpu").save_pretrained(str(folder))
    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.save_pretrained(str(folder))


def experiences(steps: int, seed: int = 0) -> list:
    """GRPO groups of 4, advantages by Trinity's ``grpo``, stale rollout log-probs.

    One response of a group is right (reward 1) and short, the others wrong and long, so the
    negative tokens outweigh the positive ones, as on hard tasks. The log-probs lie within 1 of
    the random model's (about -ln 64), so the importance ratios spread over both clip ranges.
    """
    import torch

    from trinity.algorithm.advantage_fn.grpo_advantage import GRPOGroupedAdvantage
    from trinity.common.experience import EID, Experience

    gen, made = torch.Generator().manual_seed(seed), []
    for task in range(steps * GROUPS_PER_STEP):
        prompt = torch.randint(
            2, VOCAB, (int(torch.randint(3, 6, (1,), generator=gen)),), generator=gen
        )
        for run in range(GROUP):
            right = run == 0
            length = int(torch.randint(2, 5, (1,), generator=gen)) + (0 if right else 1)
            response = torch.randint(2, VOCAB, (length,), generator=gen)
            stale = -math.log(VOCAB) + 2 * torch.rand(length, generator=gen) - 1
            made.append(
                Experience(
                    eid=EID(batch=task // GROUPS_PER_STEP, task=task, run=run),
                    tokens=torch.cat([prompt, response]),
                    prompt_length=len(prompt),
                    logprobs=stale,
                    reward=float(right),
                )
            )
    return GRPOGroupedAdvantage().process(made)[0]


def write_config(out: Path, steps: int, sync: bool, scope: str = "micro_batch") -> Path:
    """The example config, its rollout sections dropped and ``CPU_RUN`` written over it."""
    config = yaml.safe_load(EXAMPLE.read_text())
    for section in ("explorer", "synchronizer", "buffer", "model"):
        del config[section]
    sizes = dict(ranks=RANKS, group=GROUP, groups=GROUPS_PER_STEP, batch=GROUP * GROUPS_PER_STEP)
    settings = dict(out=out, steps=steps, sync=str(sync).lower(), scope=scope, name=run_name(sync))
    run = CPU_RUN.format(**sizes, **settings)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(merged(config, yaml.safe_load(run)), sort_keys=False))
    return path


def merged(base: dict, over: dict) -> dict:
    """``base`` with ``over`` written over it, section by section."""
    both = dict(base)
    for key, value in over.items():
        both[key] = merged(base[key], value) if isinstance(base.get(key), dict) else value
    return both


def run_name(sync: bool) -> str:
    """The run's name, under which Trinity saves its checkpoints."""
    return "sync" if sync else "nosync"


def fill_buffer(config_path: Path, steps: int) -> None:
    """Write the experiences through Trinity's own sqlite storage, as the run's config names it."""
    from trinity.buffer.storage.sql import SQLExperienceStorage
    from trinity.common.config import load_config

    buffer = load_config(str(config_path)).check_and_update().buffer.trainer_input.experience_buffer
    assert buffer is not None, "the run's config names no experience buffer"
    storage = SQLExperienceStorage(buffer.to_storage_config())
    asyncio.run(storage.write(experiences(steps)))
