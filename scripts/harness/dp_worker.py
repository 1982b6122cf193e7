"""The one torchrun data-parallel worker: BAPO's loss called on every rank with a real group.

Modes: ``checks`` runs named checks of a tests/ module (``--option k=v`` become ``ctx.options``),
rewriting ``DIR/rank<R>.json`` after each; ``bench`` times the bench's data-parallel figure;
``by-hand`` prints every rank's pair per call (``make dp-check``), exit 1 if synced ranks
disagree. A TorchDispatchMode counts every ``c10d`` op. A failing check ends the run at once.
"""

import argparse
import importlib
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from scripts.harness.cases import PAPER, bench_batch, literal_search, search_inputs
from scripts.harness.launch import write_record
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

WARMUP, CALLS_PER_REPEAT = 2, 8  # the bench's untimed repeats; calls per timed repeat


class CollectiveCounter(TorchDispatchMode):
    """The c10d ops dispatched while active (``ops``) and the elements each one sends."""

    def __init__(self):
        """Start with no collective seen."""
        super().__init__()
        self.ops, self.values = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Note c10d ops and their first tensor's size, then run every op unchanged."""
        if func.namespace == "c10d":
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.ops.append(str(func))
            self.values.append(first.numel() if torch.is_tensor(first) else None)
        return func(*args, **(kwargs or {}))


class Context:
    """This rank's place in the job, its seed and its device."""

    def __init__(self, args):
        """Read rank, world size, seed and device from the launch."""
        self.rank, self.world, self.seed = dist.get_rank(), dist.get_world_size(), args.seed
        self.options = dict(option.split("=", 1) for option in getattr(args, "option", []))
        cuda = args.backend == "nccl"
        self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else "cpu"

    def put(self, data):
        """Move a case's tensors to this rank's device (a meta tensor stays: a wrong device)."""
        return {k: v if v.is_meta else v.to(self.device) for k, v in data.items()}


def counted_call(loss_fn, **kwargs):
    """Call the loss under a collective counter; return the loss and what a driver reads."""
    with CollectiveCounter() as counter:
        loss, metrics = loss_fn(**kwargs)
    plain = {k: float(v.item() if torch.is_tensor(v) else v) for k, v in metrics.items()}
    return loss, {
        "metrics": {k: v if v == v else "nan" for k, v in plain.items()},  # NaN is not JSON
        "loss": float(loss),
        "collectives": counter.ops,
        "values": counter.values,
    }


def call_bapo(ctx, loss_fn, data, group):
    """Call BAPO on one case (``logprob``, ``old_logprob``, ``mask``, ``advantages``)."""
    data = ctx.put(data)
    inputs = {key: data[key] for key in ("logprob", "old_logprob", "advantages")}
    return counted_call(loss_fn, **inputs, action_mask=data["mask"], dp_group=group)[1]


def gather_rows(row: torch.Tensor) -> list:
    """Every rank's ``row`` (a vector of one length), as lists: the harness's one all-gather."""
    gathered = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, row)
    return [g.tolist() for g in gathered]


def run_bench(args) -> int:
    """Time the per-candidate search, ours and the loss on every rank; rank 0 writes ``--out``.

    A repeat makes calls back to back after a barrier, as a trainer calls the loss, and counts
    the slowest rank (a step waits for it); the figure is the median over repeats.
    """
    rank, group = dist.get_rank(), dist.group.WORLD
    rows = max(1, args.tokens_per_rank // 1024)
    batch = bench_batch((rows, min(args.tokens_per_rank, 1024)), seed=1000 + rank)
    ratio, adv, mask, finite = search_inputs(batch)
    loss_fn = BAPOPolicyLossFn(**PAPER)
    search, all_reduce = loss_fn.search, lambda t: dist.all_reduce(t, group=group)
    contenders = {
        "literal": lambda: literal_search(ratio, adv, mask, PAPER, all_reduce),
        "ours": lambda: search.decide(
            loss_fn.sync.reduce(search.local_sums(ratio, adv, mask, finite), group)
        ),
        "loss": lambda: loss_fn(**batch, dp_group=group),
    }
    samples = torch.zeros(len(contenders), args.repeats, dtype=torch.float64)
    for i in range(WARMUP + args.repeats):
        for k, call in enumerate(contenders.values()):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(CALLS_PER_REPEAT):
                call()
            if i >= WARMUP:
                samples[k, i - WARMUP] = (time.perf_counter() - start) / CALLS_PER_REPEAT
    _, synced = counted_call(loss_fn, **batch, dp_group=group)
    unsynced = BAPOPolicyLossFn(**{**PAPER, "sync_across_dp": False})
    ops = {
        "loss_synced": len(synced["collectives"]),
        "loss_synced_values": sum(v or 0 for v in synced["values"]),
        "loss_unsynced": len(counted_call(unsynced, **batch, dp_group=group)[1]["collectives"]),
    }
    with CollectiveCounter() as counter:
        literal = contenders["literal"]()
    ops["literal"] = len(counter.ops)
    mine = [synced["metrics"][f"bapo_{key}"] for key in ("clip_low", "clip_high", "search_steps")]
    pairs = gather_rows(torch.tensor([*literal, *mine], dtype=torch.float64))
    slowest = torch.tensor(gather_rows(samples.reshape(-1))).amax(0).reshape(samples.shape)
    if rank == 0:
        medians = {name: slowest[k].median().item() for k, name in enumerate(contenders)}
        result = {
            "median_s": medians,
            "speedup": medians["literal"] / medians["ours"],
            "collectives": ops,
            "same_pair": all(row == pairs[0] for row in pairs) and pairs[0][:3] == pairs[0][3:],
        }
        write_record(Path(args.out), result)
    return 0


def run_by_hand(args) -> int:
    """Print every rank's pair per call and whether the group agrees; 1 if synced ones differ."""
    ctx = Context(args)
    members = sorted({int(r) for r in args.group.split(",")}) if args.group else range(ctx.world)
    group = dist.new_group(list(members)) if args.group else dist.group.WORLD
    loss_fn = BAPOPolicyLossFn(sync_across_dp=not args.no_sync)
    disagreements = 0
    for call in range(args.calls):
        row = torch.full((3,), float("nan"), dtype=torch.float64)
        if ctx.rank in members:
            # odd ranks mostly negative, even ones balanced: alone they choose apart, and together
            # (rho below the target) the group still has to move
            shape, share = (3 + ctx.rank, 40), 0.9 if ctx.rank % 2 else 0.5
            batch = bench_batch(shape, 100 * args.seed + 10 * ctx.rank + call, share)
            _, m = loss_fn(**ctx.put(batch), dp_group=group)
            keys = ("bapo_clip_low", "bapo_clip_high", "bapo_positive_contribution")
            row = torch.tensor([m[key] for key in keys], dtype=torch.float64)
        rows = gather_rows(row)
        agree = len({tuple(rows[r][:2]) for r in members}) == 1
        disagreements += not agree
        if ctx.rank == 0:
            cells = [
                f"rank{r} ({low:.2f}, {high:.2f}) rho={rho:.3f}"
                for r, (low, high, rho) in enumerate(rows)
                if r in members
            ]
            print(f"call {call}: {'  '.join(cells)}  agree: {'yes' if agree else 'NO'}", flush=True)
    return 1 if disagreements and not args.no_sync else 0


def run_checks(args) -> int:
    """Run the named checks of ``--module`` in order, writing this rank's JSON after each."""
    checks = importlib.import_module(args.module).CHECKS
    ctx = Context(args)
    path = args.out / f"rank{ctx.rank}.json"
    record: dict = {"rank": ctx.rank, "world": ctx.world, "checks": {}}
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
    checks.add_argument("--option", action="append", default=[], help="KEY=VALUE for the checks")
    bench = modes.add_parser("bench")
    bench.add_argument("--out", required=True)
    bench.add_argument("--tokens-per-rank", type=int, default=16384)
    bench.add_argument("--repeats", type=int, default=15)
    by_hand = modes.add_parser("by-hand")
    by_hand.add_argument("--calls", type=int, default=3)
    by_hand.add_argument("--no-sync", action="store_true", help="each rank on its own")
    by_hand.add_argument("--group", default=None, help="comma list of ranks (default WORLD)")
    for mode in (checks, bench, by_hand):
        mode.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
        mode.add_argument("--seed", type=int, default=0)
        mode.add_argument("--group-timeout", type=float, default=40.0, help="seconds")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Start the process group, run one mode, shut down."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.group_timeout))
    code = {"checks": run_checks, "bench": run_bench, "by-hand": run_by_hand}[args.mode](args)
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
