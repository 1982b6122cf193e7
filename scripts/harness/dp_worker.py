"""The one torchrun data-parallel worker: BAPO's loss called on every rank with a real group.

``python -m torch.distributed.run --nproc_per_node=N -m scripts.harness.dp_worker MODE ...``

- ``checks --out DIR --checks a,b,... [--module dist_checks]``: the named checks of a module
  (the tests' ``tests/dist_checks.py``, on ``PYTHONPATH``). Every rank runs them in order and
  rewrites ``DIR/rank<R>.json`` after each one, with what it computed and the data it used.
- ``bench --out FILE``: the bench's data-parallel figure (``scripts/bench.py``).
- ``by-hand [--calls K] [--no-sync] [--group 0,1]``: prints every rank's pair per call and
  whether the group agrees (``make dp-check``); exit 1 if synced ranks disagree.

Collectives are counted with a TorchDispatchMode that sees every ``c10d`` op, whichever Python
path issued it, and only around the loss call. A failing check is recorded with its traceback
and ends the run, since the other ranks may now wait in a collective this rank will never join
(the process-group timeout turns that wait into their own recorded error).
"""

import argparse
import importlib
import json
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from scripts.harness import cases as common
from scripts.harness.launch import write_record
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

GROUP_TIMEOUT = timedelta(seconds=40)


class CollectiveCounter(TorchDispatchMode):
    """The c10d ops (all_reduce, all_gather, barrier, ...) dispatched while active.

    ``ops`` holds their names; ``values`` the element count each one sends (its first tensor
    argument, or the first tensor of its first list argument).
    """

    def __init__(self):
        """Start with no collective seen."""
        super().__init__()
        self.ops = []
        self.values = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Record c10d ops, then run every op unchanged."""
        if func.namespace == "c10d":
            self.ops.append(str(func))
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.values.append(first.numel() if torch.is_tensor(first) else None)
        return func(*args, **(kwargs or {}))


class Context:
    """This rank's place in the job and its device."""

    def __init__(self, args):
        """Read rank, world size, seed and device from the launch."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.seed, self.backend = args.seed, args.backend
        if args.backend == "nccl":
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        else:
            self.device = torch.device("cpu")

    def put(self, data):
        """Move a case's tensors to this rank's device."""
        return {key: value.to(self.device) for key, value in data.items()}


def _plain(metrics):
    """Metric values as JSON numbers (NaN becomes the string 'nan')."""
    out = {}
    for key, value in metrics.items():
        value = float(value.item() if torch.is_tensor(value) else value)
        out[key] = value if value == value else "nan"
    return out


def counted_call(loss_fn, **kwargs):
    """Call the loss with the collective counter active; return (loss, metrics, counter)."""
    with CollectiveCounter() as counter:
        loss, metrics = loss_fn(**kwargs)
    return loss, metrics, counter


def run_record(loss, metrics, counter):
    """What a driver reads of one call: metrics, loss, collectives and their sizes."""
    return {
        "metrics": _plain(metrics),
        "loss": float(loss),
        "collectives": counter.ops,
        "values": counter.values,
    }


def call_bapo(ctx, loss_fn, data, group):
    """Call BAPO on one case with ``group``; return metrics, loss and collectives."""
    data = ctx.put(data)
    return run_record(
        *counted_call(
            loss_fn,
            logprob=data["logprob"],
            old_logprob=data["old_logprob"],
            action_mask=data["mask"],
            advantages=data["advantages"],
            dp_group=group,
        )
    )


def counted(fn):
    """(c10d ops, values sent by all-reduces) of one call of ``fn``."""
    with CollectiveCounter() as counter:
        fn()
    sent = [v for op, v in zip(counter.ops, counter.values) if "allreduce" in op]
    return len(counter.ops), sum(v or 0 for v in sent)


def gather_rows(row: torch.Tensor):
    """Every rank's ``row`` (a float64 vector of one length), as lists."""
    gathered = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, row)
    return [g.tolist() for g in gathered]


def run_bench(args) -> int:
    """Time the per-candidate search and ours on every rank; rank 0 writes ``--out``.

    Each repeat starts at a barrier and makes ``--calls-per-repeat`` calls back to back, as a
    trainer calls the loss micro-batch after micro-batch; a step waits for its slowest rank, so
    a repeat counts the slowest rank's time per call, and the figure is the median over repeats.
    """
    from scripts.bench import literal_search

    rank, group = dist.get_rank(), dist.group.WORLD
    rows = max(1, args.tokens_per_rank // 1024)
    batch = common.bench_batch((rows, min(args.tokens_per_rank, 1024)), seed=1000 + rank)
    ratio, adv, mask, finite = common.search_inputs(batch)
    loss_fn = BAPOPolicyLossFn(**common.PAPER)
    unsynced = BAPOPolicyLossFn(**common.PAPER, sync_across_dp=False)
    search, all_reduce = loss_fn.search, lambda t: dist.all_reduce(t, group=group)
    contenders = {
        "literal": lambda: literal_search(ratio, adv, mask, common.PAPER, all_reduce),
        "ours": lambda: search.decide(
            loss_fn.sync.reduce(search.local_sums(ratio, adv, mask, finite), group)
        ),
        "loss": lambda: loss_fn(**batch, dp_group=group),
    }
    samples: Dict[str, List[float]] = {name: [] for name in contenders}
    for i in range(args.warmup + args.repeats):
        for name, call in contenders.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.calls_per_repeat):
                call()
            if i >= args.warmup:
                samples[name].append((time.perf_counter() - start) / args.calls_per_repeat)
    synced, values = counted(contenders["loss"])
    unsynced_ops, _ = counted(lambda: unsynced(**batch, dp_group=group))
    literal_ops, _ = counted(contenders["literal"])
    _, metrics = loss_fn(**batch, dp_group=group)
    mine = [metrics["bapo_clip_low"], metrics["bapo_clip_high"], metrics["bapo_search_steps"]]
    pairs = gather_rows(torch.tensor([*contenders["literal"](), *mine], dtype=torch.float64))
    parts = [gather_rows(t.reshape(-1).double()) for t in (ratio, adv, mask, finite)]
    union = [torch.tensor(sum(p, [])) for p in parts]
    single = search.decide(search.local_sums(union[0], union[1], union[2].bool(), union[3].bool()))
    times = gather_rows(
        torch.tensor([samples[n] for n in contenders], dtype=torch.float64).reshape(-1)
    )
    if rank == 0:
        slowest = torch.tensor(times).amax(0).reshape(len(contenders), -1)
        medians = {n: slowest[k].median().item() for k, n in enumerate(contenders)}
        agree = all(row == pairs[0] for row in pairs)
        union_pair = [single.clip_low, single.clip_high, float(single.steps)]
        result = {
            "world_size": dist.get_world_size(),
            "tokens_per_rank": ratio.numel(),
            "repeats": args.repeats,
            "calls_per_repeat": args.calls_per_repeat,
            "median_s": medians,
            "speedup": medians["literal"] / medians["ours"],
            "collectives": {
                "loss_synced": synced,
                "loss_synced_values": values,
                "loss_unsynced": unsynced_ops,
                "literal": literal_ops,
            },
            "literal_pair": pairs[0][:3],
            "ours_pair": pairs[0][3:],
            "union_pair": union_pair,
            "ranks_agree": agree,
            "same_pair": agree and pairs[0][:3] == pairs[0][3:] == union_pair,
        }
        Path(args.out).write_text(json.dumps(result))
    return 0


def run_by_hand(args) -> int:
    """Print every rank's pair per call and whether the group agrees; 1 if synced ones differ."""
    ctx = Context(args)
    members = (
        sorted({int(r) for r in args.group.split(",")}) if args.group else list(range(ctx.world))
    )
    group = dist.new_group(members) if args.group else dist.group.WORLD
    loss_fn = BAPOPolicyLossFn(contribution=args.contribution, sync_across_dp=not args.no_sync)
    disagreements = 0
    for call in range(args.calls):
        row = torch.full((3,), float("nan"), dtype=torch.float64)
        if ctx.rank in members:
            # odd ranks mostly negative, even ones balanced: alone they choose apart, and together
            # (rho below the target) the group still has to move
            shape, share = (3 + ctx.rank, 40), 0.9 if ctx.rank % 2 else 0.5
            batch = common.bench_batch(shape, 100 * args.seed + 10 * ctx.rank + call, share)
            _, m = loss_fn(**ctx.put(batch), dp_group=group)
            keys = ("bapo_clip_low", "bapo_clip_high", "bapo_positive_contribution")
            row = torch.tensor([m[key] for key in keys], dtype=torch.float64)
        rows = gather_rows(row)
        agree = len({tuple(rows[r][:2]) for r in members}) == 1
        disagreements += not agree
        if ctx.rank == 0:
            cells = "  ".join(
                f"rank{r} ({rows[r][0]:.2f}, {rows[r][1]:.2f}) rho={rows[r][2]:.3f}"
                for r in members
            )
            print(f"call {call}: {cells}  agree: {'yes' if agree else 'NO'}", flush=True)
    return 1 if disagreements and not args.no_sync else 0


def run_checks(args) -> int:
    """Run the named checks of ``--module`` in order, writing this rank's JSON after each."""
    checks = importlib.import_module(args.module).CHECKS
    ctx = Context(args)
    path = args.out / f"rank{ctx.rank}.json"
    record = {"rank": ctx.rank, "world": ctx.world, "backend": args.backend, "checks": {}}
    for name in args.checks.split(","):
        try:
            record["checks"][name] = checks[name](ctx)
        except Exception:
            record["checks"][name] = {"error": traceback.format_exc()}
            write_record(path, record)
            print(f"rank {ctx.rank}: check {name} failed", file=sys.stderr, flush=True)
            traceback.print_exc()
            os._exit(1)  # no clean shutdown: peers may be waiting in a collective
        write_record(path, record)
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    """The three modes' flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    checks = modes.add_parser("checks")
    checks.add_argument("--out", required=True, type=Path)
    checks.add_argument("--checks", required=True, help="comma list of check names")
    checks.add_argument("--module", default="dist_checks", help="where the checks live")
    bench = modes.add_parser("bench")
    bench.add_argument("--out", required=True)
    bench.add_argument("--tokens-per-rank", type=int, default=16384)
    bench.add_argument("--repeats", type=int, default=15)
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--calls-per-repeat", type=int, default=8)
    by_hand = modes.add_parser("by-hand")
    by_hand.add_argument("--calls", type=int, default=3)
    by_hand.add_argument("--no-sync", action="store_true", help="each rank on its own")
    by_hand.add_argument("--group", default=None, help="comma list of ranks (default WORLD)")
    by_hand.add_argument("--contribution", default="surrogate", choices=("surrogate", "gradient"))
    for mode in (checks, bench, by_hand):
        mode.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
        mode.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Start the process group, run one mode, shut down."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(args.backend, timeout=GROUP_TIMEOUT)
    code = {"checks": run_checks, "bench": run_bench, "by-hand": run_by_hand}[args.mode](args)
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
