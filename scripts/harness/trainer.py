"""The one trainer: GRPO on stale rollouts through verl's ``FSDPEngineWithLMHead``.

Each step, every rank's rollout policy (the engine's weights ``lag`` steps ago) answers; its
log-probs are the ``old_log_probs``, as in Trinity's async mode. The batch trains ``epochs``
passes of ``mini_batches`` updates of ``micro_batches`` ``TrinityPolicyLoss`` calls each. Rank 0
writes one JSON line per step: the reward and entropy of fresh answers, each call's pair, rho.
"""

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, NamedTuple

import torch
import torch.distributed as dist

from scripts.harness.cases import surrogate_sums
from scripts.harness.engine import (
    build_engine,
    engine_batch,
    full_state_dict,
    trinity_layout,
    worker_actor,
)
from scripts.harness.launch import gather_rows
from scripts.harness.model import build_model, sample_responses, save_model
from scripts.harness.recorder import LossRecorder
from scripts.harness.tasks import goal_tokens, group_advantages, left_pad, sample_prompts, scores
from scripts.harness.variants import Variant, loss_config, variant
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import LOG_RATIO_CLAMP, BAPOPolicyLossFn


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
    """One step's rollout in Trinity's padded fields, and how negative-heavy it is."""
    rows = sample_prompts(setting.prompts, gens["prompts"])
    rows = [r for r in rows for _ in range(setting.group_size)]
    prompts, prompt_mask = left_pad(rows)
    goal = goal_tokens(setting.task, rows)
    responses, mask, sampled_lp, _ = sample_responses(
        behaviour, prompts, prompt_mask, gens["sample"], goal
    )
    rewards = torch.tensor(scores(setting.task, rows, responses, mask))
    adv = group_advantages(rewards, setting.group_size)[:, None] * mask
    signed = adv[mask.bool() & adv.ne(0)]  # a group with equal rewards carries no sign
    negative = signed.clamp(max=0).abs().sum()
    stats = {
        "rollout_reward": rewards.mean().item(),
        "neg_token_share": signed.lt(0).float().mean().item() if signed.numel() else None,
        "neg_mass_share": (negative / signed.abs().sum()).item() if signed.numel() else None,
        "truncated_share": (rewards.eq(0) & mask[:, -1].bool()).float().mean().item(),
    }
    return (prompts, prompt_mask, responses, mask, sampled_lp, adv), stats


def split(fields, sequences: int, micro: int) -> List:
    """The engine's batches of ``sequences`` rows each, ``micro`` rows per loss call."""
    parts = zip(*(t.split(sequences) for t in fields))
    return [engine_batch(trinity_layout(*piece), micro) for piece in parts]


def call_figures(calls: List[Dict], run: Variant, lower: List[float]) -> Dict:
    """Each call's pair, search steps and target met; Eq. 8 on every rank's tokens apart.

    ``rho_surrogate`` is also the only rho a PPO variant has. ``lower_grew`` (calls that raised
    c_low above a-): whether rho, recomputed at each pair (c, b+) they passed, grew at a raise.
    """
    m = [call["metrics"] for call in calls]
    bapo, high = run.loss == "bapo", run.args.get("ratio_upper_max", 0.0)  # b+
    pairs = [[c["bapo_clip_low"], c["bapo_clip_high"]] if bapo else run.start for c in m]
    sums = []  # per call: (P, N) at its pair, then at (c, b+) for each lower candidate c
    for pair, i in zip(pairs, (call["inputs"] for call in calls)):
        ratio = (i["logprob"] - i["old_logprob"]).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        for low, up in [pair] + [(low, high) for low in lower]:
            sums.append(surrogate_sums(ratio, i["advantages"], i["mask"], low, up))
    total = torch.stack(sums)
    dist.all_reduce(total)  # the same shape on every rank
    eq8 = [1.0 if p + n == 0 else p / (p + n) for p, n in total.tolist()]
    width = 1 + len(lower)
    at_pair = eq8[::width]
    ladders = [eq8[k * width + 1 : (k + 1) * width] for k in range(len(calls))]
    rho = [c.get("bapo_positive_contribution", r) for c, r in zip(m, at_pair)]
    row = {"pairs": pairs, "rho": sum(rho) / len(m), "rho_surrogate": sum(at_pair) / len(m)}
    row.update(moved=any(p != run.start for p in pairs))
    row["clipfrac"] = sum(c["pg_clipfrac"] for c in m) / len(m)
    if bapo:
        row.update(search_steps=[int(c["bapo_search_steps"]) for c in m])
        row.update(target_met=[bool(c["bapo_target_met"]) for c in m])
    if lower:  # rho at each pair (c, b+) the lower phase passed: did it grow at a raise?
        passed = [rhos[: lower.index(p[0]) + 1] for p, rhos in zip(pairs, ladders)]
        grew = [any(b > a for a, b in zip(r, r[1:])) for r in passed]
        row["lower_grew"] = [g if len(r) > 1 else None for g, r in zip(grew, passed)]
    return row


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
    return dict(zip(("reward", "entropy"), (total / dist.get_world_size()).tolist()))


def fresh_engine(behaviour, lr: float, micro: int, seed: int):
    """The engine, loaded from a temporary copy of ``behaviour`` (rank 0's, which it writes)."""
    with tempfile.TemporaryDirectory(prefix="bapo-model-") as mine:
        folder = [mine]
        dist.broadcast_object_list(folder, src=0)
        save_model(behaviour, Path(folder[0]))
        engine = build_engine(Path(folder[0]), lr=lr, micro_batch_size=micro, seed=seed)
        dist.barrier()  # every rank has loaded it before rank 0 removes it
    return engine


def train(run: Variant, seed: int, setting: Setting, out: Path, args) -> None:
    """Train one run on every rank; rank 0 writes ``metrics.jsonl`` (``--dump``: ``fixed.pt``)."""
    started, rank = time.time(), dist.get_rank()
    behaviour = build_model(seed).eval()  # the rollout copy; the engine holds the policy
    current = copy.deepcopy(behaviour)  # the engine's latest weights, for evaluation
    sequences = setting.prompts * setting.group_size // setting.mini_batches
    micro = sequences // setting.micro_batches
    engine = fresh_engine(behaviour, setting.lr, micro, seed)
    actor = worker_actor(engine, loss_config(run.loss, run.args))
    loss_fn = actor.loss_fn
    recorder = LossRecorder(loss_fn, engine.get_data_parallel_group(), keep_inputs=True)
    upper_first = run.loss == "bapo" and not recorder.capped and len(recorder.lower) > 1
    lower = recorder.lower if upper_first else []
    snapshots = deque([copy.deepcopy(behaviour.state_dict())], maxlen=setting.lag + 1)
    # this rank's streams: training prompts and samples, evaluation prompts and samples
    streams = enumerate(("prompts", "sample", "eval_prompts", "eval_sample"))
    gens = {k: torch.Generator().manual_seed(seed * 1000 + 10 * rank + i) for i, k in streams}
    eval_rows = sample_prompts(setting.eval_prompts, gens["eval_prompts"])
    eval_set = (eval_rows, *left_pad(eval_rows))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("")
    for step in range(setting.steps):
        lag = len(snapshots) - 1
        behaviour.load_state_dict(snapshots[0])  # the oldest snapshot kept
        fields, stats = rollout(behaviour, gens, setting)
        recorder.calls.clear()
        recorder.pass_calls.clear()
        norms = []
        # one train-mode context per step, as Trinity's actor worker; nothing is offloaded
        batches = split(fields, sequences, micro)
        with engine.train_mode(disable_auto_offload=True):
            for _ in range(setting.epochs):
                for batch in batches:
                    result = actor.train_batch(batch)
                    norms.append(float(result["metrics"]["grad_norm"]))
        snapshots.append(full_state_dict(engine))
        current.load_state_dict(snapshots[-1])
        row: Dict[str, Any] = {"step": step, "lag": lag, "grad_norm": sum(norms) / len(norms)}
        row.update(evaluate(current, eval_set, gens["eval_sample"], setting.task), **stats)
        row.update(call_figures(recorder.calls, run, lower))
        forwarded = all(call["is_engine_group"] for call in recorder.calls)
        row.update(ranks_agree=ranks_agree(row["pairs"]), dp_group_forwarded=forwarded)
        row["wall_s"] = round(time.time() - started, 2)
        if rank == 0:
            with open(out / "metrics.jsonl", "a") as sink:
                sink.write(json.dumps(row) + "\n")
            if args.log_every and (step % args.log_every == 0 or step == setting.steps - 1):
                # the launch's minutes so far, and an estimate of those left
                minutes, done = (time.time() - args.started) / 60, args.done_before + step + 1
                figures = "  ".join(f"{k} {row[k]:.3f}" for k in ("reward", "entropy", "rho"))
                head = f"[{args.tag}{run.name}] step {step + 1}/{setting.steps}  {figures}"
                left = minutes * (args.total - done) / done
                print(f"{head}  agree {row['ranks_agree']}  {minutes:.1f} min, {left:.1f} left")
    if args.dump and rank == 0:
        torch.save({"state": snapshots[-1], "fields": fields}, out / "fixed.pt")


def replay(args) -> None:
    """Call BAPO through the engine on one fixed mini-batch, split over ranks and micro-batches.

    The policy does not move (``infer_batch``), so the splits differ only in what each call sees.
    Each split runs twice: deciding per call, and per update (``search_scope: update``, the
    mini-batch one update: the loss's ``optimizer_update`` with the engine's pass, as the worker
    hands it over, around the calls).
    Rank 0 writes each call's pair and the reference: the pair on all the tokens in one process.
    """
    from trinity.trainer.verl.losses import TrinityPolicyLoss

    fixed, rank, world = torch.load(args.replay), dist.get_rank(), dist.get_world_size()
    model = build_model(args.seed)
    model.load_state_dict(fixed["state"])
    share = args.sequences // world
    fields = [t[: args.sequences][rank * share : (rank + 1) * share] for t in fixed["fields"]]
    run, result = variant("bapo_paper"), []
    engine = fresh_engine(model, args.lr, share, args.seed)
    micros = [m for m in map(int, args.micro.split(",")) if share % m == 0]
    for micro, scope in [(m, scope) for m in micros for scope in ("micro_batch", "update")]:
        loss_fn = TrinityPolicyLoss(loss_config(run.loss, {**run.args, "search_scope": scope}))
        recorder = LossRecorder(loss_fn, keep_inputs=True)
        batch = split(fields, share, micro)[0]
        run_pass = partial(engine.infer_batch, batch, loss_function=loss_fn)
        with engine.eval_mode(disable_auto_offload=True):
            with loss_fn.policy_loss_fn.optimizer_update(batch, run_pass):
                engine.infer_batch(batch, loss_function=loss_fn)
        pairs = call_figures(recorder.calls, run, [])["pairs"]
        keys, inputs = ("logprob", "old_logprob", "advantages"), [
            c["inputs"] for c in recorder.calls
        ]
        mine = [torch.stack([i[k] for k in keys])[:, i["mask"].bool()] for i in inputs]  # live
        union = [torch.empty(0)] * world
        dist.all_gather_object(union, torch.cat(mine, 1))
        tokens = torch.cat(union, 1)
        alone = BAPOPolicyLossFn(**{**run.args, "sync_across_dp": False})
        metrics = alone(**dict(zip(keys, tokens)), action_mask=torch.ones_like(tokens[0]))[1]
        reference = [metrics["bapo_clip_low"], metrics["bapo_clip_high"]]
        result.append({"micro": micro, "scope": scope, "pairs": pairs})
        result[-1].update(ranks_agree=ranks_agree(pairs))
        result[-1].update(reference=reference, tokens=tokens.tolist())
        if rank == 0:
            print(f"[{world} ranks] {micro} sequences per call, per {scope}: {len(pairs)} calls")
    if rank == 0:
        args.out.write_text(json.dumps({"ranks": world, "splits": result}))


def bench_update(args) -> None:
    """Seconds per optimizer update (``engine.train_batch``), deciding per call and per update.

    One rollout of the default setting, trained as one update of ``args.micro`` sequences per
    call (lr 0, so the weights stay), by BAPO at the paper's settings in both scopes, and the
    pass alone (``engine.infer_batch`` through the loss), in interleaved rounds, the first a
    warm-up; rank 0 prints the medians as one JSON line.
    """
    setting, rank = Setting(), dist.get_rank()
    behaviour = build_model(args.seed, hidden=args.hidden).eval()
    gens = {k: torch.Generator().manual_seed(args.seed * 10 + rank) for k in ("prompts", "sample")}
    fields, _ = rollout(behaviour, gens, setting)
    sequences, micro = setting.prompts * setting.group_size, int(args.micro)
    engine = fresh_engine(behaviour, 0.0, micro, args.seed)
    batch = split(fields, sequences, micro)[0]
    seconds: Dict[str, List[float]] = {"micro_batch": [], "update": [], "pass": []}
    with engine.train_mode(disable_auto_offload=True):
        for _ in range(args.bench_update + 1):
            for scope, times in seconds.items():
                kept = "micro_batch" if scope == "pass" else scope
                loss_args = {**variant("bapo_paper").args, "search_scope": kept}
                actor = worker_actor(engine, loss_config("bapo", loss_args))
                started = time.perf_counter()
                if scope == "pass":
                    engine.infer_batch(batch, loss_function=actor.loss_fn)
                else:
                    actor.train_batch(batch)
                times.append(time.perf_counter() - started)
    median = {scope: statistics.median(times[1:]) for scope, times in seconds.items()}
    if rank == 0:
        share = (median["update"] - median["micro_batch"]) / median["micro_batch"]
        result = {"pass_share_of_step": share, "median_s": median, "rounds": args.bench_update}
        result["pass_alone_share_of_step"] = median["pass"] / median["micro_batch"]
        result.update(
            sequences=sequences, micro=micro, hidden=args.hidden, ranks=dist.get_world_size()
        )
        print(json.dumps(result), flush=True)


def main(argv=None) -> int:
    """Start gloo, train each variant in turn on every rank, shut down."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="ppo_clip_higher,bapo_paper")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument("--tag", default="", help="names the launch in its progress lines")
    p.add_argument("--dump", action="store_true", help="save the last rollout and policy")
    p.add_argument("--replay", type=Path, help="a saved rollout and policy: run replay()")
    p.add_argument("--sequences", type=int, default=32, help="replay: the mini-batch's size")
    p.add_argument("--micro", default="1,2,4,8", help="replay: sequences per call and rank")
    p.add_argument("--bench-update", type=int, default=0, help="rounds: run bench_update()")
    p.add_argument("--hidden", type=int, default=64, help="bench_update: the model's width")
    for field, value in Setting()._asdict().items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args(argv)
    setting = Setting(**{k: getattr(args, k) for k in Setting._fields})
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo")
    names = args.variants.split(",")
    args.tag = f"{args.tag} " if args.tag else ""
    args.started, args.total = time.time(), len(names) * setting.steps
    try:
        for index, name in enumerate([] if args.replay or args.bench_update else names):
            args.done_before = index * setting.steps
            train(variant(name), args.seed, setting, args.out / name, args)
            dist.barrier()
        if args.replay:
            replay(args)
        if args.bench_update:
            bench_update(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
