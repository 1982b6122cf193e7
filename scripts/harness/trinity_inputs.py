"""What ``make trinity-run`` trains on, built from code with nothing downloaded.

From a buffer (``mode: train``): a tiny random Qwen2 with a word-level tokenizer; a sqlite
experience buffer of GRPO groups whose rollout log-probs are stale (they differ from the model's,
so the clip search has work to do), written through Trinity's own storage.

With an explorer (``mode: both``): a tiny random OLMo-2 whose heads of 64 vLLM's CPU attention
accepts (it refuses the Qwen2's heads of 8), with the same tokenizer; a task set of word prompts
and a rule reward (``ParityReward``) that Trinity's ``simple_workflow`` scores the rollouts with.

Either way the config is the example ``examples/bapo_gsm8k/gsm8k.yaml`` with what a CPU needs
written over it (2 trainer ranks; in ``mode: both`` one vLLM engine beside them).
"""

import asyncio
import json
import math
from pathlib import Path
from typing import Any, Dict, NamedTuple, Optional
from urllib.parse import quote

import yaml

from scripts.harness.launch import REPO
from trinity.common.rewards.reward_fn import RewardFn

EXAMPLE = REPO / "examples" / "bapo_gsm8k" / "gsm8k.yaml"
RANKS, GROUP, GROUPS_PER_STEP = 2, 4, 4  # trainer ranks; GRPO group size; groups per step


class Rollout(NamedTuple):
    """How stale ``mode: both`` makes the trained rollouts (Trinity's synchronizer settings)."""

    interval: int  # sync_interval: steps between two reloads of the trainer's checkpoint
    offset: int  # sync_offset: steps the explorer runs ahead of the trainer


VOCAB, PAD, EOS = 64, 0, 1
PARITIES = ("even", "odd")  # a task's truth in mode: both
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the words, as they are
# Over the example, in either mode: 2 trainer ranks with what a CPU needs (a run's paths, sizes
# and BAPO's settings go over it as values: ``run_settings``). verl reads trainer_config's model
# and actor keys; Trinity takes use_remove_padding from trainer alone.
CPU_TRAINER = """\
project: bapo-trinity-run
monitor:
  monitor_type: tensorboard
algorithm:
  optimizer:
    lr: 1.0e-3
buffer:
  total_epochs: 1
trainer:
  trainer_strategy: fsdp2
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
# mode: train, from the sqlite buffer that fill_buffer writes (its path: ``mode_settings``)
FROM_BUFFER = """\
mode: train
model:
  max_response_tokens: 8
  max_model_len: 16
cluster:
  node_num: 1
buffer:
  trainer_input:
    experience_buffer:
      name: bapo_buffer
      storage_type: sql
      max_read_timeout: 30
"""
# mode: both: one vLLM engine on a GPU slot of its own explores the task set, the trainer reads
# its rollouts from a queue, and the explorer reloads the trainer's checkpoint every
# sync_interval steps while running sync_offset steps ahead: the trained rollouts are stale
# (the task set's path and the sync settings: ``mode_settings``).
WITH_EXPLORER = """\
mode: both
model:
  max_response_tokens: 8
  max_model_len: 32
cluster:
  node_num: 1
buffer:
  explorer_input:
    taskset:
      name: parity
      subset_name: null
    eval_tasksets: []
    default_workflow_type: simple_workflow
    default_reward_fn_type: scripts.harness.trinity_inputs.ParityReward
  trainer_input:
    experience_buffer:
      name: bapo_queue
explorer:
  runner_per_model: 2
  rollout_model:
    engine_num: 1
synchronizer:
  sync_method: checkpoint
  sync_timeout: 300
"""


def build_model(folder: Path, rollout: bool = False) -> None:
    """A random 2-layer causal LM and a word-level tokenizer (vocabulary 64), saved.

    A Qwen2 of hidden 32 to train from the buffer; for vLLM to roll out (``rollout``), an OLMo-2
    of hidden 128 in 2 heads of 64. The tokenizer is saved as the generic fast class, which
    transformers loads as it is (a ``qwen2`` one it would load as its BPE class, which encodes
    these words to nothing), with a chat template that joins the messages' words.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Olmo2Config, PretrainedConfig, PreTrainedTokenizerFast, Qwen2Config

    from scripts.harness.model import build_random

    shape: Dict[str, Any] = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64)
    shape.update(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    config: PretrainedConfig
    if rollout:
        config = Olmo2Config(hidden_size=128, intermediate_size=256, num_attention_heads=2, **shape)
    else:
        shape.update(hidden_size=32, intermediate_size=64, num_key_value_heads=2)
        config = Qwen2Config(num_attention_heads=4, **shape)
    build_random(config, torch.float32, "cpu").save_pretrained(str(folder))
    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))


class ParityReward(RewardFn):
    """The rule reward of ``mode: both``: the share of the response's words of the task's parity.

    A task's truth is "even" or "odd", which its prompt's first word tells (``w2`` or ``w3``);
    word ``w<i>`` has the parity of ``i``. A random policy earns about 0.5, with a spread within
    each group, so GRPO's advantages are not all zero.
    """

    def __init__(self, **kwargs) -> None:
        """No arguments."""

    def __call__(self, response: str, truth: str, **kwargs) -> Dict[str, float]:  # type: ignore
        """``{"parity": share}`` over the response's words, 0 where it has none."""
        indices = [int(word[1:]) for word in response.split() if word[1:].isdigit()]
        wanted = PARITIES.index(truth)
        return {"parity": sum(i % 2 == wanted for i in indices) / max(len(indices), 1)}


def write_tasks(folder: Path, count: int, seed: int = 0) -> None:
    """``count`` tasks of 3 to 5 random words after the parity's, alternately even and odd."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True)
    with open(folder / "train.jsonl", "w") as tasks:
        for task in range(count):
            parity = task % 2
            length = int(torch.randint(3, 6, (1,), generator=gen))
            words = torch.randint(2, VOCAB, (length,), generator=gen)
            question = " ".join(f"w{i}" for i in [2 + parity, *words.tolist()])
            tasks.write(json.dumps({"question": question, "answer": PARITIES[parity]}) + "\n")


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


def write_config(
    out: Path, steps: int, sync: bool, scope: str = "micro_batch", rollout: Optional[Rollout] = None
) -> Path:
    """The example config with ``CPU_TRAINER`` written over it, then a mode's settings.

    ``FROM_BUFFER`` with the example's rollout sections dropped, or, given a ``rollout``,
    ``WITH_EXPLORER``. A run's own values (paths among them) go in as YAML values, never into
    YAML text, where a path's ``" #"`` would start a comment and its ``": "`` a mapping.
    """
    config = yaml.safe_load(EXAMPLE.read_text())
    if rollout is None:
        for section in ("explorer", "synchronizer", "buffer", "model"):
            del config[section]
    mode = yaml.safe_load(FROM_BUFFER if rollout is None else WITH_EXPLORER)
    gpus = RANKS + (rollout is not None)
    run = run_settings(out, steps, sync, scope, gpus)
    for over in (yaml.safe_load(CPU_TRAINER), mode, run, mode_settings(out, rollout)):
        config = merged(config, over)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_settings(out: Path, steps: int, sync: bool, scope: str, gpus: int) -> dict:
    """A run's own settings in either mode: its paths, sizes, length and BAPO's arguments."""
    return {
        "name": run_name(sync),
        "checkpoint_root_dir": str(out / "checkpoints"),
        "algorithm": {
            "repeat_times": GROUP,
            "policy_loss_fn_args": {"sync_across_dp": sync, "search_scope": scope},
        },
        "model": {"model_path": str(out / "model")},
        "cluster": {"gpu_per_node": gpus},
        "buffer": {"batch_size": GROUPS_PER_STEP, "train_batch_size": GROUP * GROUPS_PER_STEP},
        "trainer": {"total_steps": steps, "save_interval": steps},
    }


def mode_settings(out: Path, rollout: Optional[Rollout]) -> dict:
    """A mode's own settings: the buffer's sqlite URL, or the task set and the synchronizer's.

    The URL's path is %-escaped, as SQLAlchemy reads it: a ``"?"`` in it would start the query.
    The queue of ``mode: both`` gets no path, so that Trinity keeps its copy in the run's folder
    (under the checkpoints), where the example's path would keep it outside.
    """
    if rollout is None:
        url = "sqlite:///" + quote(str(out / "buffer.db"))
        return {"buffer": {"trainer_input": {"experience_buffer": {"path": url}}}}
    return {
        "buffer": {
            "explorer_input": {"taskset": {"path": str(out / "tasks")}},
            "trainer_input": {"experience_buffer": {"path": None}},
        },
        "synchronizer": {"sync_interval": rollout.interval, "sync_offset": rollout.offset},
    }


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
