"""The one trainer: GRPO on stale rollouts through verl's ``FSDPEngineWithLMHead``.

Each step, every rank's rollout policy (the engine's weights ``lag`` steps ago) answers its
prompts; its log-probs of the drawn tokens are the ``old_log_probs``, as in Trinity's async
mode. The batch, in Trinity's layout, trains ``epochs`` passes of ``mini_batches`` updates, each
``micro_batches`` calls of ``TrinityPolicyLoss`` with the engine's data-parallel group. Rank 0
writes one JSON line per step: the reward and entropy of fresh answers, the pairs, rho.
"""

import argparse
import copy
import json
import shutil
import sys
import tempfile
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any, Dict, List, NamedTuple

import torch
import torch.distributed as dist

from scripts.harness.cases import surrogate_sums
from scripts.harness.dp_worker import gather_rows
from scripts.harness.engine import build_engine, engine_batch, full_state_dict, trinity_layout
from scripts.harness.model import build_model, sample_responses, save_model
from scripts.harness.recorder import LossRecorder
from scripts.harness.tasks import goal_tokens, group_advantages, left_pad, sample_prompts, scores
from scripts.harness.variants import Variant, loss_config, variant


class Setting(NamedTuple):
    """Everything but the variant and the seed that a run depends on."""

    task: str = "stop"  # see harness.tasks
    lag: int = 0  # training steps the rollout policy lags behind
    epochs: int = 1
    steps: int = 250
    prompts: int = 8  # per rank
    group_size: int = 8
    mini_batches: int = 2  # optimizer updates per epoch
    micro_batches: int = 1  # loss calls per update
    lr: float = 3e-3
    eval_prompts: int = 64  # per rank


def rollout(behaviour, gens, setting: Setting):
    """One step's mini-batches in Trinity's layout, and how negative-heavy the batch is."""
    rows = sample_prompts(setting.prompts, gens["prompts"])
    rows = [r for r in rows for _ in range(setting.group_size)]
    prompts, prompt_mask = left_pad(rows)
    goal = goal_tokens(setting.task, rows)
    responses, mask, sampled_lp, _ = sample_responses(
        behaviour, prompts, prompt_mask, gens["sample"], goal
    )
    rewards = torch.tensor(scores(setting.task, rows, responses, mask))
    adv = group_advantages(rewards, setting.group_size)[:, None] * mask
    size = len(rows) // setting.mini_batches
    parts = [t.split(size) for t in (prompts, prompt_mask, responses, mask, sampled_lp, adv)]
    batches = [
        engine_batch(trinity_layout(*piece), size // setting.micro_batches) for piece in zip(*parts)
    ]
    return batches, imbalance(rewards, adv, mask)


def imbalance(rewards: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> Dict:
    """How much of the batch negative advantages carry, by tokens and by |A| mass."""
    mask = mask.bool()
    neg, pos = (adv < 0) & mask, (adv > 0) & mask
    signed = neg.sum() + pos.sum()
    mass_neg, mass_pos = adv[neg].abs().sum(), adv[pos].sum()
    lengths, seq_adv = mask.sum(dim=1).float(), adv[:, 0]
    return {
        "rollout_reward": rewards.mean().item(),
        "neg_token_share": (neg.sum() / signed).item() if signed else None,
        "neg_mass_share": (mass_neg / (mass_neg + mass_pos)).item() if signed else None,
        "len_pos": lengths[seq_adv > 0].mean().item() if (seq_adv > 0).any() else None,
        "len_neg": lengths[seq_adv < 0].mean().item() if (seq_adv < 0).any() else None,
        "truncated_share": (rewards.eq(0) & mask[:, -1]).float().mean().item(),
    }


def call_figures(calls: List[Dict], run: Variant) -> Dict:
    """The calls' pairs, rho, moves, clip fraction; Eq. 8 on every rank's tokens as a cross-check.

    ``rho_surrogate`` is also the only rho a PPO variant has.
    """
    pairs = [list(run.start) for _ in calls]
    if run.loss == "bapo":
        pairs = [[c["metrics"]["bapo_clip_low"], c["metrics"]["bapo_clip_high"]] for c in calls]
    inputs = [c["inputs"] for c in calls]
    ratios = [(i["logprob"] - i["old_logprob"]).clamp(-20, 20).exp() for i in inputs]
    parts = zip(ratios, inputs, pairs)
    sums = torch.stack([surrogate_sums(r, i["advantages"], i["mask"], *p) for r, i, p in parts])
    dist.all_reduce(sums)
    eq8 = [1.0 if p + n == 0 else p / (p + n) for p, n in sums.tolist()]
    rho = [c["metrics"].get("bapo_positive_contribution", r) for c, r in zip(calls, eq8)]
    return {
        "pairs": pairs,
        "rho": sum(rho) / len(calls),
        "rho_surrogate": sum(eq8) / len(calls),
        "moved": any(pair != run.start for pair in pairs),
        "clipfrac": sum(c["metrics"]["pg_clipfrac"] for c in calls) / len(calls),
    }


def ranks_agree(pairs: List[List[float]]) -> bool:
    """Whether every rank used the same pairs in the same order."""
    rows = gather_rows(torch.tensor(pairs, dtype=torch.float64).reshape(-1))
    return all(row == rows[0] for row in rows)


@torch.no_grad()
def evaluate(model, eval_set, generator, task: str) -> Dict:
    """Reward and token entropy of the current policy on fresh samples, averaged over ranks."""
    rows, prompts, prompt_mask = eval_set
    goal = goal_tokens(task, rows)
    responses, mask, _, entropy = sample_responses(model, prompts, prompt_mask, generator, goal)
    rewards = scores(task, rows, responses, mask)
    means = [sum(rewards) / len(rewards), (entropy.sum() / mask.sum()).item()]
    total = torch.tensor(means, dtype=torch.float64)
    dist.all_reduce(total)
    reward, ent = (total / dist.get_world_size()).tolist()
    return {"reward": reward, "entropy": ent}


def fresh_engine(behaviour, setting: Setting, seed: int):
    """The engine, loaded from a temporary copy of ``behaviour`` (rank 0 writes it)."""
    folder = [tempfile.mkdtemp(prefix="bapo-model-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(folder, src=0)
    try:
        save_model(behaviour, Path(folder[0]))
        micro = setting.prompts * setting.group_size // setting.mini_batches
        micro //= setting.micro_batches
        return build_engine(Path(folder[0]), lr=setting.lr, micro_batch_size=micro, seed=seed)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)


class Progress(NamedTuple):
    """Where a run sits in its launch: the tag of its lines, and the launch's steps and time."""

    tag: str  # "" alone, "stale/seed0 " in a study
    every: int  # steps between progress lines; 0 prints none
    started: float
    done_before: int  # steps of the launch's earlier runs
    total: int

    def line(self, run: str, step: int, steps: int, row: Dict) -> str:
        """The step, the figures, the launch's minutes so far and an estimate of those left."""
        minutes, done = (time.time() - self.started) / 60, self.done_before + step + 1
        figures = "  ".join(f"{key} {row[key]:.3f}" for key in ("reward", "entropy", "rho"))
        left = minutes * (self.total - done) / done
        head = f"[{self.tag}{run}] step {step + 1}/{steps}"
        return f"{head}  {figures}  agree {row['ranks_agree']}  {minutes:.1f} min, {left:.1f} left"


def train(run: Variant, seed: int, setting: Setting, out: Path, progress: Progress) -> None:
    """Train one run on every rank of the default group; rank 0 writes ``out/metrics.jsonl``."""
    from trinity.trainer.verl.losses import TrinityPolicyLoss

    started, rank = time.time(), dist.get_rank()
    behaviour = build_model(seed).eval()  # the rollout copy; the engine holds the policy
    current = copy.deepcopy(behaviour)  # the engine's latest weights, for evaluation
    engine = fresh_engine(behaviour, setting, seed)
    loss_fn = TrinityPolicyLoss(loss_config(run.loss, run.args))
    recorder = LossRecorder(loss_fn, engine.get_data_parallel_group(), keep_inputs=True)
    snapshots = deque([copy.deepcopy(behaviour.state_dict())], maxlen=setting.lag + 1)
    # this rank's streams: training prompts and samples, evaluation prompts and samples
    streams = ("prompts", "sample", "eval_prompts", "eval_sample")
    gens = {
        k: torch.Generator().manual_seed(seed * 1000 + 10 * rank + i) for i, k in enumerate(streams)
    }
    eval_rows = sample_prompts(setting.eval_prompts, gens["eval_prompts"])
    eval_set = (eval_rows, *left_pad(eval_rows))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("")
    for step in range(setting.steps):
        lag = len(snapshots) - 1
        behaviour.load_state_dict(snapshots[0])  # the oldest snapshot kept
        batches, stats = rollout(behaviour, gens, setting)
        recorder.calls.clear()
        norms = []
        # One train-mode context per update, as Trinity's actor worker enters it; nothing is
        # offloaded, so the engine's offload round trip is skipped.
        with engine.train_mode(disable_auto_offload=True):
            for _ in range(setting.epochs):
                for batch in batches:
                    result = engine.train_batch(batch, loss_function=loss_fn)
                    norms.append(float(result["metrics"]["grad_norm"]))
        snapshots.append(full_state_dict(engine))
        current.load_state_dict(snapshots[-1])
        row: Dict[str, Any] = {"step": step, "lag": lag, "grad_norm": sum(norms) / len(norms)}
        row.update(evaluate(current, eval_set, gens["eval_sample"], setting.task))
        row.update(stats)
        row.update(call_figures(recorder.calls, run))
        first = recorder.calls[0]["inputs"]  # with no lag, the engine's log-probs are the sampler's
        gap = (first["logprob"] - first["old_logprob"])[first["mask"].bool()].abs()
        row["logprob_layout_err"] = gap.max().item() if lag == 0 and gap.numel() else None
        row["ranks_agree"] = ranks_agree(row["pairs"])
        row["dp_group_forwarded"] = recorder.forwarded
        row["wall_s"] = round(time.time() - started, 2)
        if rank == 0:
            with open(out / "metrics.jsonl", "a") as sink:
                sink.write(json.dumps(row) + "\n")
            if progress.every and (step % progress.every == 0 or step == setting.steps - 1):
                print(progress.line(run.name, step, setting.steps, row), flush=True)


def main(argv=None) -> int:
    """Start gloo, train each variant in turn on every rank, shut down."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="ppo_clip_higher,bapo_paper")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument("--tag", default="", help="names the launch in its progress lines")
    p.add_argument("--no-sync", action="store_true", help="BAPO with sync_across_dp: false")
    for field, value in Setting()._asdict().items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args(argv)
    setting = Setting(**{k: getattr(args, k) for k in Setting._fields})
    torch.set_num_threads(1)
    # A rank that gets no group would choose its own bounds; that warning is fatal here.
    warnings.filterwarnings("error", message="BAPO: sync_across_dp is on")
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo")
    names, started = args.variants.split(","), time.time()
    tag = f"{args.tag} " if args.tag else ""
    try:
        for index, name in enumerate(names):
            overrides = {"sync_across_dp": False} if args.no_sync and "bapo" in name else {}
            steps = setting.steps
            progress = Progress(tag, args.log_every, started, index * steps, len(names) * steps)
            train(variant(name, **overrides), args.seed, setting, args.out / name, progress)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
