"""The torchrun data-parallel worker: BAPO's loss called on every rank with a real group.

``bench``: the bench's DP figure and collectives; ``by-hand``: every rank's pair per call.
"""

import argparse
import functools
import json
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from scripts.harness.cases import CHOICE, PAPER, authors_loop, bench_batch, product_search
from scripts.harness.launch import gather_rows
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import LOG_RATIO_CLAMP, BAPOPolicyLossFn

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
            self.values.append(first.numel() if torch.is_tensor(first) else 0)
        return func(*args, **(kwargs or {}))


def run_bench(args) -> int:
    """Time the authors' loop, our search (both in the authors' order) and the loss on every rank.

    A repeat makes calls back to back after a barrier, as a trainer does, and counts the slowest
    rank; rank 0 prints the medians over repeats, the collectives and the pairs as one JSON line.
    """
    rank, group = dist.get_rank(), dist.group.WORLD
    rows = max(1, args.tokens_per_rank // 1024)
    batch = bench_batch((rows, min(args.tokens_per_rank, 1024)), seed=1000 + rank)
    loss_fn = BAPOPolicyLossFn(**PAPER)
    with CollectiveCounter() as counter:  # a fresh loss's first call
        first = loss_fn(**batch, dp_group=group)[1]
    ours = BAPOPolicyLossFn(**{**PAPER, "search_order": "lower_first"})
    log_ratio, advantages, *_ = ours._prepare(**batch)
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()  # as PPO's loss takes it

    def authors():
        all_reduce = functools.partial(dist.all_reduce, group=group)
        return authors_loop(ratio, advantages, batch["action_mask"], PAPER, all_reduce)

    contenders = {"authors": authors, "ours": lambda: product_search(ours, batch, group)}
    contenders["loss"] = lambda: loss_fn(**batch, dp_group=group)
    samples = torch.zeros(len(contenders), args.repeats, dtype=torch.float64)
    for i in range(WARMUP + args.repeats):
        for k, call in enumerate(contenders.values()):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(CALLS_PER_REPEAT):
                call()
            if i >= WARMUP:
                samples[k, i - WARMUP] = (time.perf_counter() - start) / CALLS_PER_REPEAT
    ops = {"loss_synced": len(counter.ops), "loss_synced_values": sum(counter.values)}
    with CollectiveCounter() as counter:
        BAPOPolicyLossFn(**{**PAPER, "sync_across_dp": False})(**batch, dp_group=group)
    ops["loss_unsynced"] = len(counter.ops)
    with CollectiveCounter() as counter:
        theirs = authors()
    ops["authors"] = len(counter.ops)
    pairs = {"loss": [first[key] for key in CHOICE], "authors": list(theirs)}
    pairs["ours"] = list(product_search(ours, batch, group))
    every = gather_rows(torch.tensor(sum(pairs.values(), []), dtype=torch.float64))
    slowest = torch.tensor(gather_rows(samples.reshape(-1))).amax(0).reshape(samples.shape)
    medians = {name: slowest[k].median().item() for k, name in enumerate(contenders)}
    result = {"median_s": medians, "speedup": medians["authors"] / medians["ours"]}
    result.update(collectives=ops, pairs=pairs, ranks_agree=all(row == every[0] for row in every))
    if rank == 0:
        print(json.dumps(result), flush=True)
    return 0


def run_by_hand(args) -> int:
    """Print every rank's pair per call and whether the group agrees; 1 if synced ones differ."""
    rank, world = dist.get_rank(), dist.get_world_size()
    members = sorted({int(r) for r in args.group.split(",")}) if args.group else range(world)
    group = dist.new_group(list(members)) if args.group else dist.group.WORLD
    loss_fn = BAPOPolicyLossFn(sync_across_dp=not args.no_sync)
    disagreements = 0
    for call in range(args.calls):
        row = torch.full((3,), float("nan"), dtype=torch.float64)
        if rank in members:
            # odd ranks mostly negative, even ones balanced: alone they choose apart, and together
            # (rho below the target) the group still has to move
            shape, share = (3 + rank, 40), 0.9 if rank % 2 else 0.5
            batch = bench_batch(shape, 10 * rank + call, share)
            _, m = loss_fn(**batch, dp_group=group)
            keys = ("bapo_clip_low", "bapo_clip_high", "bapo_positive_contribution")
            row = torch.tensor([m[key] for key in keys], dtype=torch.float64)
        rows = gather_rows(row)
        agree = len({tuple(rows[r][:2]) for r in members}) == 1
        disagreements += not agree
        if rank == 0:
            cells = [f"rank{r} ({c[0]:.2f}, {c[1]:.2f}) rho={c[2]:.3f}" for r, c in enumerate(rows)]
            cells = [cell for r, cell in enumerate(cells) if r in members]
            print(f"call {call}: {'  '.join(cells)}  agree: {'yes' if agree else 'NO'}", flush=True)
    return 1 if disagreements and not args.no_sync else 0


def parse_args(argv=None) -> argparse.Namespace:
    """The two modes' flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    bench = modes.add_parser("bench")
    bench.add_argument("--tokens-per-rank", type=int, default=16384)
    bench.add_argument("--repeats", type=int, default=15)
    by_hand = modes.add_parser("by-hand")
    by_hand.add_argument("--calls", type=int, default=3)
    by_hand.add_argument("--no-sync", action="store_true", help="each rank on its own")
    by_hand.add_argument("--group", default=None, help="comma list of ranks (default WORLD)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Start the process group, run one mode, shut down."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo", timeout=timedelta(seconds=40))
    code = {"bench": run_bench, "by-hand": run_by_hand}[args.mode](args)
    dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
