"""Peak resident-memory growth of one search, measured in a fresh process.

Run by the bench as a subprocess; prints one JSON line. The inputs (and, in ``search`` mode,
the ratio and finite mask the loss hands to the search) are built first; then the kernel's
high-water mark is reset to the current RSS (``/proc/self/clear_refs`` = 5) and one search
(``local_sums`` + ``decide``) runs; the growth is ``VmHWM - VmRSS(before)``. The bench starts
this process with ``MALLOC_MMAP_THRESHOLD_`` fixed and ``MALLOC_TRIM_THRESHOLD_=0`` so glibc
hands freed blocks back at once: otherwise memory freed while building the inputs would stay
resident and the search could reuse it without any growth, hiding its real peak.
"""

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.inputs import PAPER, grid_kwargs, input_bytes, make_batch, ratio_of  # noqa: E402


def status_kb(field: str) -> int:
    """Return one field of /proc/self/status, in kB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    """Reset the peak RSS (VmHWM); return whether the kernel allowed it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main() -> None:
    """Measure the peak RSS growth of one search and print it as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--grid", default="2000", help="'paper' or a key of CANDIDATE_GRIDS")
    parser.add_argument("--mode", choices=("search", "loss"), default="search")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn

    kwargs = PAPER if args.grid == "paper" else grid_kwargs(int(args.grid))
    loss_fn = BAPOPolicyLossFn(**kwargs)
    search = loss_fn.search
    # Warm up on a tiny batch so lazy one-off allocations are not charged to the search.
    tiny = make_batch((2, 64), seed=1)
    tiny_ratio, tiny_finite = ratio_of(tiny)
    loss_fn(**tiny)
    search.decide(
        search.local_sums(tiny_ratio, tiny["advantages"], tiny["action_mask"].bool(), tiny_finite)
    )

    width = 1000
    batch = make_batch((args.tokens // width, width), seed=0)
    mask = batch["action_mask"].bool()
    if args.mode == "search":
        ratio, finite = ratio_of(batch)

        def run():
            return search.decide(search.local_sums(ratio, batch["advantages"], mask, finite))

    else:

        def run():
            return loss_fn(**batch)

    gc.collect()
    exact = reset_peak()
    before = status_kb("VmRSS") if exact else status_kb("VmHWM")
    result = run()
    peak = status_kb("VmHWM")
    steps = result.steps if args.mode == "search" else result[1]["bapo_search_steps"]
    growth = max(0, peak - before) * 1024
    print(
        json.dumps(
            {
                "tokens": batch["logprob"].numel(),
                "candidates": len(search.upper) + len(search.lower),
                "mode": args.mode,
                "input_bytes": input_bytes(batch),
                "rss_before_kb": before,
                "peak_kb": peak,
                "growth_bytes": growth,
                "ratio": growth / input_bytes(batch),
                "steps": steps,
                "peak_reset": exact,
            }
        )
    )


if __name__ == "__main__":
    main()
