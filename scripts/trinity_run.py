"""``make trinity-run``: Trinity's own ``trinity run --config`` trains BAPO on 2 CPU ranks.

Everything is built under ``--out`` from code, nothing downloaded: a tiny random Qwen2 with a
word-level tokenizer, and a sqlite experience buffer of GRPO groups whose rollout log-probs are
stale (they differ from the model's, so the clip search has work to do). The config is the
example ``examples/bapo_gsm8k/gsm8k.yaml`` with what a CPU and this buffer need written over it
(``mode: train``, 2 trainer ranks). Trinity trains it on a Ray of its own, whose worker processes
take the CPU stand-ins (``scripts/harness/cpu.py``) and record each rank's loss calls.

``trinity run`` exits 0 even when training fails, so success is read from what it logged: one
``Step N:`` line per requested step. Prints a line per step, then one JSON line; exits 1 when a
step or the checkpoint is missing, or when the ranks chose apart with the sync on.
"""

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import yaml

from scripts.harness.cpu import CALL_LOG_ENV, STAND_INS_ENV
from scripts.harness.launch import PINNED_NUMERICS, REPO
from scripts.harness.ray_local import kill_ray, start_ray, stop_ray

EXAMPLE = REPO / "examples" / "bapo_gsm8k" / "gsm8k.yaml"
RANKS, GROUP, GROUPS_PER_STEP = 2, 4, 4  # trainer ranks; GRPO group size; groups per step
VOCAB, PAD, EOS = 64, 0, 1
STEP_LINE = re.compile(r"Step (\d+): (\{.*\})")
METRIC = re.compile(r"'([^']+)': ([^,}]+)")
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
PAIR_KEYS = ("actor/bapo_clip_low", "actor/bapo_clip_high", "actor/bapo_positive_contribution")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps (16 sequences each)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "trinity-run")
    parser.add_argument(
        "--no-sync", action="store_true", help="sync_across_dp: false (the ranks may disagree)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds for `trinity run`")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    return args


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


def write_config(out: Path, steps: int, sync: bool) -> Path:
    """The example config, its rollout sections dropped and ``CPU_RUN`` written over it."""
    config = yaml.safe_load(EXAMPLE.read_text())
    for section in ("explorer", "synchronizer", "buffer", "model"):
        del config[section]
    sizes = dict(ranks=RANKS, group=GROUP, groups=GROUPS_PER_STEP, batch=GROUP * GROUPS_PER_STEP)
    run = CPU_RUN.format(out=out, steps=steps, sync=str(sync).lower(), name=run_name(sync), **sizes)
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


def run_trinity(config_path: Path, env: Dict[str, str], log_path: Path, steps: int, timeout_s):
    """``trinity run``, a progress line per ``Step N:`` it logs; (exit code, metrics per step)."""
    trinity = str(Path(sys.executable).parent / "trinity")
    logged: Dict[int, Dict[str, float]] = {}
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [trinity, "run", "--config", str(config_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        kill = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
        kill.start()
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                found = STEP_LINE.search(line)
                if found:
                    step = int(found.group(1))
                    logged[step] = numbers(found.group(2))
                    low, high, rho = (logged[step].get(key, math.nan) for key in PAIR_KEYS)
                    seconds = time.monotonic() - started
                    print(
                        f"step {step}/{steps}: clip ({low:.3f}, {high:.3f}), rho {rho:.3f}, "
                        f"{seconds:.0f} s into trinity run",
                        flush=True,
                    )
        finally:
            kill.cancel()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(), logged


def numbers(logged: str) -> Dict[str, float]:
    """The numeric entries of a logged ``{'name': value, ...}``."""
    found = {}
    for key, value in METRIC.findall(logged):
        try:
            found[key] = float(value)
        except ValueError:  # a string entry
            continue
    return found


def rank_calls(folder: Path) -> List[List[dict]]:
    """Each trainer rank's loss calls, in order, as its recorder wrote them."""
    paths = [folder / f"rank{rank}.jsonl" for rank in range(RANKS)]
    return [
        [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
        for p in paths
    ]


def agreement(calls: List[List[dict]]) -> dict:
    """Whether every rank chose the same pair at every call, and the groups the loss received."""
    pairs = [
        [tuple(c["metrics"][k.split("/")[1]] for k in PAIR_KEYS[:2]) for c in rank]
        for rank in calls
    ]
    same_count = len({len(p) for p in pairs}) == 1 and len(pairs[0]) > 0
    apart = sum(len(set(at)) > 1 for at in zip(*pairs))
    groups = sorted({tuple(c["group_ranks"] or ()) for rank in calls for c in rank})
    return dict(
        calls_per_rank=[len(p) for p in pairs],
        ranks_agree=same_count and apart == 0,
        calls_apart=apart,
        groups=groups,
    )


def checkpoint(out: Path, name: str, steps: int) -> str:
    """The folder of the last step's actor checkpoint, or "" where Trinity saved none."""
    found = sorted((out / "checkpoints").glob(f"*/{name}/global_step_{steps}/actor"))
    return str(found[0].relative_to(out)) if found and any(found[0].iterdir()) else ""


def prepare(out: Path, steps: int, sync: bool) -> Path:
    """The run's folder, emptied, with the model, the config and the filled buffer; the config."""
    kill_ray(out / "ray")  # a run owns its folder: no Ray, buffer or checkpoint is reused
    shutil.rmtree(out, ignore_errors=True)
    (out / "calls").mkdir(parents=True)
    build_model(out / "model")
    config_path = write_config(out, steps, sync)
    fill_buffer(config_path, steps)
    return config_path


def worker_env(out: Path) -> Dict[str, str]:
    """What Ray's worker processes get: the stand-ins on, where to record, our sitecustomize."""
    site = [REPO / "scripts" / "harness" / "ray_site", REPO, os.environ.get("PYTHONPATH", "")]
    env = {STAND_INS_ENV: "1", CALL_LOG_ENV: str(out / "calls"), **PINNED_NUMERICS}
    env.update(PYTHONPATH=os.pathsep.join(str(p) for p in site if p), OMP_NUM_THREADS="1")
    return env


def report(out: Path, requested: int, sync: bool, code: int, logged: dict) -> dict:
    """The JSON line: steps, pairs and rho as Trinity logged them, the ranks' own agreement."""
    steps = sorted(logged)
    return dict(
        requested_steps=requested,
        steps=steps,
        clip_pairs=[[logged[s].get(k) for k in PAIR_KEYS[:2]] for s in steps],
        rho=[logged[s].get(PAIR_KEYS[2]) for s in steps],
        sync_across_dp=sync,
        **agreement(rank_calls(out / "calls")),
        checkpoint=checkpoint(out, run_name(sync), requested),
        trinity_exit=code,
        log=str(out / "trinity.log"),
    )


def exit_code(result: dict) -> int:
    """0 where the run is whole, else 1: ``trinity run`` exits 0 even when a step failed.

    Whole: every requested step logged, the last step's checkpoint saved, ``trinity run`` ended
    with 0, and, where the sync is on, the ranks chose the same pair at every call.
    """
    complete = result["steps"] == list(range(1, result["requested_steps"] + 1))
    ended = complete and bool(result["checkpoint"]) and result["trinity_exit"] == 0
    return 0 if ended and (result["ranks_agree"] or not result["sync_across_dp"]) else 1


def main(argv=None) -> int:
    """Build, start Ray, run ``trinity run``, stop Ray, report."""
    args = parse_args(argv)
    started, out, sync = time.monotonic(), args.out.resolve(), not args.no_sync
    config_path = prepare(out, args.steps, sync)
    print(f"inputs built under {out}; starting Ray and `trinity run`", flush=True)
    head = start_ray(out / "ray", RANKS, worker_env(out))
    try:
        env = {**head.env, **PINNED_NUMERICS, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        code, logged = run_trinity(config_path, env, out / "trinity.log", args.steps, args.timeout)
    finally:
        stop_ray(head)
    result = report(out, args.steps, sync, code, logged)
    result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result), flush=True)
    return exit_code(result)


if __name__ == "__main__":
    sys.exit(main())
