"""Smoke test for `make bench` (scripts/bapo_bench.py and scripts/bench/).

The benchmark is not a test: nothing here looks at a time. What a reader of its figures relies
on is checked instead: the run ends with one JSON line carrying the five figures, a synchronised
call makes exactly one collective, and the per-candidate literal loop that the speed-ups are
measured against picks the same pair as our search. A small test pins the literal loop itself
against the Algorithm 1 transcription in tests/bapo_reference.py (an independent oracle).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
BENCH = SCRIPTS / "bapo_bench.py"
FIGURES = (
    "bapo_over_ppo_loss",
    "speedup_vs_literal_loop",
    "dp_speedup_vs_per_candidate_allreduce",
    "collectives_per_call",
    "all_reduce_values_per_call",
    "large_grid_peak_rss_over_input",
)
PAPER_RANGES = dict(
    ratio_lower_start=0.6,
    ratio_lower_max=0.9,
    ratio_lower_step=0.02,
    ratio_upper_start=1.2,
    ratio_upper_max=3.0,
    ratio_upper_step=0.05,
)

sys.path.insert(0, str(SCRIPTS))


@pytest.fixture(scope="module")
def quick_run():
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,  # ~40 s normally; generous because the cores are shared
    )
    return proc


@pytest.fixture(scope="module")
def result(quick_run):
    assert quick_run.returncode == 0, quick_run.stderr[-3000:]
    lines = quick_run.stdout.strip().splitlines()
    assert lines, "the bench printed nothing"
    return json.loads(lines[-1])


def test_last_line_is_json_with_every_figure(result):
    for key in FIGURES:
        assert key in result, key
        value = result[key]
        assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
    assert result["errors"] == {}


def test_steady_heap_figure_comes_from_a_tuned_child(result):
    value = result["bapo_over_ppo_loss_steady_heap"]
    assert isinstance(value, float) and math.isfinite(value) and value > 0
    malloc = result["checks"]["steady_heap_malloc"]
    assert "MALLOC_MMAP_THRESHOLD_=1073741824" in malloc
    assert "MALLOC_TRIM_THRESHOLD_=1073741824" in malloc


def test_synchronised_call_makes_one_collective(result):
    assert result["collectives_per_call"] == 1
    # header (failed ranks, non-finite tokens) + 16 lower (0.6..0.9) + 37 upper (1.2..3.0)
    assert result["all_reduce_values_per_call"] == 2 + 16 + 37
    collectives = result["checks"]["dp_collectives"]
    assert collectives["loss_unsynced"] == 0
    assert collectives["literal"] == 52  # per candidate: one per pair on the 52-pair path


def test_literal_loop_and_our_search_pick_the_same_pair(result):
    assert result["same_pair"] is True
    assert result["checks"]["mid_path"]["ok"] is True
    assert result["checks"]["dp_same_pair"] is True
    assert result["bapo_search_steps"] == 51  # the timed target is never met: full path


def test_report_has_a_verdict_per_figure(quick_run):
    summary = quick_run.stdout.split("## Summary", 1)[1]
    assert summary.count("PASS") + summary.count("MISS") == len(FIGURES)


# The baseline the speed-ups rest on, against an independent oracle (fast, in process).


def _batch(seed, negative_share, shape=(4, 128)):
    from bench.inputs import make_batch

    return make_batch(shape, seed=seed, negative_share=negative_share)


@pytest.mark.parametrize("seed,negative_share", [(0, 0.85), (1, 0.5), (2, 0.2)])
def test_literal_loop_walks_algorithm1(seed, negative_share):
    import bapo_reference as ref
    from bench.literal import literal_search

    batch = _batch(seed, negative_share)
    tokens = ref.token_lists(
        batch["logprob"], batch["old_logprob"], batch["action_mask"], batch["advantages"]
    )
    ratio = torch.exp(torch.clamp(batch["logprob"] - batch["old_logprob"], -20.0, 20.0))
    # Target halfway between rho at steps 4 and 5 of the upper phase, so the walk must stop
    # at step 5 whatever the data, and far from any rounding difference.
    rho4, rho5 = (ref.rho(tokens, 0.6, 1.2 + 0.05 * k, "surrogate") for k in (4, 5))
    assert rho4 < rho5
    for target in ((rho4 + rho5) / 2, 1.0, 0.0):
        grid = dict(PAPER_RANGES, positive_contribution_target=target)
        want = ref.algorithm1(tokens, 0.6, 0.9, 0.02, 1.2, 3.0, 0.05, target, "surrogate")
        got = literal_search(ratio, batch["advantages"], batch["action_mask"], grid)
        assert got == want
    assert (
        literal_search(
            ratio,
            batch["advantages"],
            batch["action_mask"],
            dict(PAPER_RANGES, positive_contribution_target=1.0),
        )[2]
        == 51
    )


def test_cuda_part_runs_its_code_path_on_cpu():
    """Run the CUDA figures' code on the CPU with tiny sizes (a GPU runs the full ones).

    Every figure the README reports is there and finite.
    """
    from bench import cuda

    result = cuda.run("cpu", "quick")
    keys = ("bapo_over_ppo_fwd", "bapo_over_ppo_fwd_bwd", "search_ms")
    for key in keys:
        assert result[key] and all(v > 0 and math.isfinite(v) for v in result[key].values())
    assert math.isfinite(result["step_overhead_share"]) and result["ms"]["model_step"] > 0
    assert cuda.SIZES["full"]["fwd_tokens"] == [65_536, 8_388_608]
    assert cuda.SIZES["full"]["search_tokens"] == [65_536, 1_048_576, 8_388_608]
    assert len(cuda.report(result)) == 2 + sum(len(result[key]) for key in keys)


def test_bench_says_when_cuda_is_skipped(quick_run):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert "## CUDA: skipped, no CUDA device" in quick_run.stdout
