"""torchrun worker for the data-parallel figures (gloo, CPU).

Run as ``python -m torch.distributed.run --standalone --nproc_per_node=4 dp_worker.py --out F``.
Every rank builds its own micro-batch (seed = rank) on which the paper target is never met and
times, interleaved and between barriers:

* ``literal``: the authors' style, one all_reduce of [P, N] and one ``.item()`` per candidate;
* ``ours``: ``local_sums`` + the loss's ``sync.reduce`` (one all_reduce of the header and
  the candidates' sums, 55 values on the paper grid) + ``decide``, i.e. the search as the loss
  runs it with ``dp_group``;
* ``loss``: the whole ``BAPOPolicyLossFn`` forward with ``dp_group`` (information).

Each repeat starts at a barrier and makes ``--calls-per-repeat`` calls back to back, as a
trainer calls the loss micro-batch after micro-batch; with 4 ranks on 2 cores a single call
would mostly time how long the scheduler keeps a rank off the CPU after the barrier. A step
waits for its slowest rank, so each repeat takes the maximum over ranks of the time per call;
the figure is the median over repeats. Collectives are counted by wrapping the
torch.distributed functions, and rank 0 writes one JSON file.
"""

import argparse
import datetime
import functools
import json
import os
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.inputs import PAPER, make_batch, ratio_of  # noqa: E402
from bench.literal import literal_search  # noqa: E402

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
)
calls = {"n": 0, "values": 0}
_original: Dict[str, Any] = {}


def count_collectives() -> None:
    """Replace each torch.distributed collective by a counting wrapper.

    Module attributes are looked up at call time, so ``bapo_sync``'s ``dist.all_reduce`` goes
    through it.
    """
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        _original[name] = fn

        @functools.wraps(fn)
        def wrapper(*args, __fn=fn, __name=name, **kwargs):
            calls["n"] += 1
            if __name == "all_reduce":
                calls["values"] += args[0].numel()
            return __fn(*args, **kwargs)

        setattr(dist, name, wrapper)


def counted(fn) -> int:
    """Collectives made by one call of ``fn`` (and the values its all-reduces sent, kept)."""
    calls["n"] = calls["values"] = 0
    fn()
    return calls["n"]


def uncounted(name):
    """Run ``name`` with the collective counter off."""
    return _original.get(name, getattr(dist, name))


def shape_for(tokens: int):
    """Return a (rows, 1024) shape holding ``tokens`` tokens."""
    return (max(1, tokens // 1024), min(tokens, 1024))


def main() -> None:
    """Time both searches on every rank and write rank 0's JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens-per-rank", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--calls-per-repeat", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    group = dist.group.WORLD
    batch = make_batch(shape_for(args.tokens_per_rank), seed=1000 + rank)
    ratio, finite = ratio_of(batch)
    adv, mask = batch["advantages"], batch["action_mask"].bool()
    loss_fn = BAPOPolicyLossFn(**PAPER)
    unsynced = BAPOPolicyLossFn(**PAPER, sync_across_dp=False)
    search = loss_fn.search
    count_collectives()
    all_reduce = lambda t: dist.all_reduce(t, group=group)  # noqa: E731

    def ours():
        sums = search.local_sums(ratio, adv, mask, finite)
        return search.decide(loss_fn.sync.reduce(sums, group))

    contenders = {
        "literal": lambda: literal_search(ratio, adv, mask, PAPER, all_reduce=all_reduce),
        "ours": ours,
        "loss": lambda: loss_fn(**batch, dp_group=group),
    }
    names = list(contenders)
    barrier = uncounted("barrier")
    samples: Dict[str, List[float]] = {name: [] for name in names}
    for i in range(args.warmup + args.repeats):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            barrier(group=group)
            start = time.perf_counter()
            for _ in range(args.calls_per_repeat):
                contenders[name]()
            elapsed = (time.perf_counter() - start) / args.calls_per_repeat
            if i >= args.warmup:
                samples[name].append(elapsed)

    per_call = {
        "loss_synced": counted(lambda: loss_fn(**batch, dp_group=group)),
        "loss_synced_values": calls["values"],
        "loss_unsynced": counted(lambda: unsynced(**batch, dp_group=group)),
        "literal": counted(contenders["literal"]),
    }
    # Decisions: every rank must agree, and the synced decision must be the one a single
    # process takes on the union of all ranks' tokens.
    lit = literal_search(ratio, adv, mask, PAPER, all_reduce=all_reduce)
    _, metrics = loss_fn(**batch, dp_group=group)
    mine = (metrics["bapo_clip_low"], metrics["bapo_clip_high"], metrics["bapo_search_steps"])
    pairs = torch.tensor([[*lit, *mine]], dtype=torch.float64)
    gathered = [torch.zeros_like(pairs) for _ in range(world)]
    uncounted("all_gather")(gathered, pairs, group=group)
    union = {}
    for key in ("ratio", "adv", "mask", "finite"):
        local = {"ratio": ratio, "adv": adv, "mask": mask, "finite": finite}[key].reshape(-1)
        parts = [torch.zeros_like(local) for _ in range(world)]
        uncounted("all_gather")(parts, local, group=group)
        union[key] = torch.cat(parts)
    single = search.decide(
        search.local_sums(union["ratio"], union["adv"], union["mask"], union["finite"])
    )

    times = torch.tensor([samples[n] for n in names], dtype=torch.float64)
    all_times = [torch.zeros_like(times) for _ in range(world)]
    uncounted("all_gather")(all_times, times, group=group)
    if rank == 0:
        slowest = torch.stack(all_times).amax(0)  # (contender, repeat): max over ranks
        medians = {n: slowest[k].median().item() for k, n in enumerate(names)}
        rows = [tuple(row.tolist()) for row in torch.cat(gathered)]
        ranks_agree = all(row == rows[0] for row in rows)
        lit0, mine0 = rows[0][:3], rows[0][3:]
        result = {
            "world_size": world,
            "tokens_per_rank": ratio.numel(),
            "repeats": args.repeats,
            "calls_per_repeat": args.calls_per_repeat,
            "median_s": medians,
            "speedup": medians["literal"] / medians["ours"],
            "collectives": per_call,
            "literal_pair": lit0,
            "ours_pair": mine0,
            "union_pair": (single.clip_low, single.clip_high, single.steps),
            "ranks_agree": ranks_agree,
            "same_pair": ranks_agree
            and tuple(lit0) == tuple(mine0)
            and tuple(mine0) == (single.clip_low, single.clip_high, float(single.steps)),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    barrier(group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
