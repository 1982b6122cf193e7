"""The scripts end to end, short, and the harness pieces they rest on, by hand-worked examples."""

import json
import math
import subprocess
import sys

import pytest
import torch

import bapo_reference as ref
from scripts.harness import report, tasks
from scripts.harness.cases import PAPER, bench_batch
from scripts.harness.launch import REPO
from scripts.harness.model import build_model, sample_responses

DEMO_STEPS = 6
CALLS_PER_STEP = 4  # the demo's 2 epochs x 1 mini-batch x 2 micro-batches


def run_module(module: str, *argv, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a module from the repo root, as the Makefile runs it."""
    cmd = [sys.executable, "-m", module, *map(str, argv)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def last_json(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def all_finite(value) -> bool:
    """Tell whether every number in a JSON value is finite (None allowed)."""
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(all_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def docs_files() -> dict:
    """Each file under docs/ with its size and modification time."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in (REPO / "docs").rglob("*")}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out, before = tmp_path_factory.mktemp("demo"), docs_files()
    done = run_module("scripts.demo", "--steps", DEMO_STEPS, "--out", out)
    return out, last_json(done), before == docs_files(), done.stdout


def test_demo_writes_only_its_out_folder_and_reports_progress(demo):
    _, _, docs_untouched, stdout = demo
    assert docs_untouched, "the demo changed docs/ without --update-docs"
    for name in ("ppo_clip_higher", "bapo_paper"):
        assert f"[{name}] step 1/{DEMO_STEPS}  reward" in stdout, stdout[-2000:]


def test_demo_trains_both_variants_through_the_engine_with_agreeing_ranks(demo):
    out, result, _, _ = demo
    assert result["ranks_agree"] is True and result["dp_group_forwarded"] is True
    assert all_finite(result) and (out / "report.png").stat().st_size > 10_000
    for name in ("ppo_clip_higher", "bapo_paper"):
        rows = report.load_rows(out / name / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(DEMO_STEPS))
        assert all(len(r["pairs"]) == CALLS_PER_STEP and r["ranks_agree"] for r in rows)
        assert 0.0 < result[name]["final_entropy"] <= math.log(tasks.VOCAB_SIZE) + 1e-6
        # with no lag yet, the engine's log-probs of the sampled tokens are the sampler's own
        assert rows[0]["lag"] == 0 and rows[0]["logprob_layout_err"] < 1e-4
        assert all(r["logprob_layout_err"] is None for r in rows if r["lag"] > 0)


def test_demo_bapo_stays_in_the_paper_ranges_and_ppo_is_fixed(demo):
    out, _, _, _ = demo
    bapo = report.load_rows(out / "bapo_paper" / "metrics.jsonl")
    ppo = report.load_rows(out / "ppo_clip_higher" / "metrics.jsonl")
    assert bapo[0]["rollout_reward"] == ppo[0]["rollout_reward"]  # same seeds, same rollout
    for row in bapo:
        assert all(0.6 <= low <= 0.9 and 1.2 <= high <= 3.0 for low, high in row["pairs"])
        assert row["rho_surrogate"] == pytest.approx(row["rho"], abs=1e-6)  # Eq. 8 cross-check
    assert all(pair == [0.8, 1.28] for row in ppo for pair in row["pairs"])


def test_quick_study_trains_every_run_and_writes_its_reports(tmp_path):
    before = docs_files()
    done = run_module("scripts.experiment", "--quick", "--out", tmp_path)
    result = last_json(done)
    assert before == docs_files(), "the study changed docs/ without --update-docs"
    assert result["runs_finished"] == 6 * 2 * 2 and all_finite(result)
    # every launch reports each run's first and last step, and the study each launch's end
    launches = [f"{level}/seed{seed}" for level in ("near_on_policy", "stale") for seed in (0, 1)]
    for tag in launches:
        for name in ("ppo", "bapo_paper", "bapo_authors"):
            for step in (1, result["steps"]):
                assert f"[{tag} {name}] step {step}/{result['steps']}  " in done.stdout, tag
    assert done.stdout.count(" launches ended in ") == len(launches)
    for name in ("table.md", "summary.json", "report.png"):
        assert (tmp_path / name).stat().st_size > 0
    paths = list(tmp_path.glob("*/seed*/*/metrics.jsonl"))
    assert len(paths) == result["runs_finished"]
    for path in paths:
        rows = report.load_rows(path)
        assert len(rows) == result["steps"], path
        assert all(r["dp_group_forwarded"] and all_finite(r) for r in rows), path
        if path.parts[-2] in ("ppo", "ppo_clip_higher", "bapo_fixed_start"):
            assert not any(r["moved"] for r in rows), path


@pytest.fixture(scope="module")
def bench():
    done = run_module("scripts.bench", "--quick")
    return done, last_json(done)


@pytest.mark.parametrize(
    "key, value, want",
    [
        ("bapo_over_ppo_loss", 1.9, "PASS"),  # goal 2.0, hard limit 3.0, lower is better
        ("bapo_over_ppo_loss", 2.5, "MISS (within the hard limit)"),
        ("bapo_over_ppo_loss", 3.1, "MISS (past the hard limit)"),
        ("speedup_vs_literal_loop", 3.5, "PASS"),  # goal 3.0, hard limit 2.0, higher is better
        ("speedup_vs_literal_loop", 2.5, "MISS (within the hard limit)"),
        ("speedup_vs_literal_loop", 1.5, "MISS (past the hard limit)"),
        ("collectives_per_call", 1, "PASS"),  # must equal 1
        ("collectives_per_call", 2, "MISS"),
        ("collectives_per_call", None, "MISS"),  # not measured
    ],
)
def test_bench_verdict_hand_examples(key, value, want):
    from scripts.bench import verdict

    assert verdict(key, value) == want


def test_bench_prints_every_figure_with_the_verdict_of_its_value(bench):
    done, result = bench
    from scripts.bench import TARGETS, verdict

    assert result["errors"] == {}
    summary = done.stdout.split("## Summary", 1)[1].splitlines()[1 : 1 + len(TARGETS)]
    for line, (key, (label, _, _, _)) in zip(summary, TARGETS.items()):
        value = result[key]
        assert isinstance(value, (int, float)) and math.isfinite(value), key
        assert line.split()[: len(label.split())] == label.split(), line
        assert line.endswith(verdict(key, value)) and f"{value:.2f}" in line, line
    if not torch.cuda.is_available():
        assert "## CUDA: skipped, no CUDA device" in done.stdout


def test_bench_dp_call_is_one_all_reduce_of_header_and_candidates(bench):
    _, result = bench
    assert result["collectives_per_call"] == 1
    # header (failed ranks, 3 fingerprint lanes and their squares) + 37 upper (1.2..3.0)
    # + 16 lower (0.6..0.9) + the non-finite count
    assert result["all_reduce_values_per_call"] == 1 + 3 + 3 + 37 + 16 + 1
    assert result["checks"]["dp_collectives"]["loss_unsynced"] == 0
    assert result["checks"]["dp_collectives"]["literal"] == 52  # one per pair on the path
    assert result["same_pair"] is True and result["bapo_search_steps"] == 51


@pytest.mark.parametrize("seed,negative_share", [(0, 0.85), (1, 0.5), (2, 0.2)])
def test_bench_baseline_walks_algorithm1(seed, negative_share):
    from scripts.harness.cases import literal_search

    batch = bench_batch((4, 128), seed=seed, negative_share=negative_share)
    tokens = ref.token_lists(
        batch["logprob"], batch["old_logprob"], batch["action_mask"], batch["advantages"]
    )
    ratio = torch.exp(torch.clamp(batch["logprob"] - batch["old_logprob"], -20.0, 20.0))
    # A target halfway between rho at upper steps 4 and 5: the walk must stop at step 5.
    rho4, rho5 = (ref.rho(tokens, 0.6, 1.2 + 0.05 * k, "surrogate") for k in (4, 5))
    for target in ((rho4 + rho5) / 2, 1.0, 0.0):
        grid = dict(PAPER, positive_contribution_target=target)
        want = ref.algorithm1(tokens, 0.6, 0.9, 0.02, 1.2, 3.0, 0.05, target, "surrogate")
        assert literal_search(ratio, batch["advantages"], batch["action_mask"], grid) == want


def test_cuda_figures_run_their_code_path_on_cpu():
    from scripts.bench import bench_cuda

    result = bench_cuda(quick=True, device="cpu")
    for key in ("bapo_over_ppo_fwd", "bapo_over_ppo_fwd_bwd", "search_ms"):
        assert result[key] and all(v > 0 and math.isfinite(v) for v in result[key].values())
    assert math.isfinite(result["step_overhead_share"])


def test_stop_reward_hand_examples():
    prompt, eos = [3, 4, 5, tasks.SEP], tasks.EOS
    assert tasks.reward_stop(prompt, [5, 3, 4, eos, 0, 0]) == pytest.approx(1.0)  # any order
    assert tasks.reward_stop(prompt, [3, eos]) == pytest.approx(1 / 3)  # one of three
    assert tasks.reward_stop(prompt, [3, 3, 4, 5, eos]) == pytest.approx(3 / 4)  # one too many
    assert tasks.reward_stop(prompt, [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) == 0.0  # no EOS
    assert tasks.reward_stop(prompt, [eos]) == 0.0


def test_cover_reward_hand_examples():
    prompt = [3, 4, 5, tasks.SEP]
    assert tasks.reward_cover(prompt, [5, 3, 4]) == pytest.approx(1.0)
    assert tasks.reward_cover(prompt, [3, 9, 9, 4, 5]) == pytest.approx(3 / 5)
    assert tasks.reward_cover(prompt, [3, 4, 9, 9, 9, 9, 9, 9, 9, 9]) == 0.0  # not covered
    assert tasks.reward_cover(prompt, [3, 4, tasks.EOS]) == 0.0  # stopped before covering


def test_group_advantages_hand_example():
    adv = tasks.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5]), 3)
    assert adv[:3].tolist() == pytest.approx([2 / 3**0.5, -1 / 3**0.5, -1 / 3**0.5], rel=1e-5)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # equal rewards: no signal


def test_cover_sampler_ends_a_response_once_its_goal_is_covered():
    prompts, mask = torch.tensor([[0, 3, 4, 5, 1]] * 64), torch.tensor([[0, 1, 1, 1, 1]] * 64)
    goal = tasks.goal_tokens("cover", [[7, 1]] * 64)  # one wanted token, 7
    gen = torch.Generator().manual_seed(0)
    responses, rmask, _, _ = sample_responses(build_model(0), prompts, mask, gen, goal)
    ends = []
    for row, length in zip(responses.tolist(), rmask.sum(dim=1).tolist()):
        assert 7 not in row[: length - 1]  # the goal token, if present, is the last one
        assert row[length - 1] in (7, tasks.EOS) or length == tasks.RESPONSE_LEN
        ends.append(row[length - 1])
    assert 7 in ends  # some rows did end on the goal (random policy, 64 rows)


def test_final_window_and_collapse_rule():
    rows = [{"reward": r} for r in [0.1] * 10 + [0.8] * 10]
    assert report.final(rows, "reward") == pytest.approx(0.8)  # last 10% = last 2 steps
    assert not report.collapsed(rows)
    assert report.collapsed([{"reward": r} for r in [0.1] * 5 + [0.8] * 10 + [0.3] * 5])
    assert not report.collapsed([{"reward": r} for r in [0.1] * 5 + [0.8] * 10 + [0.5] * 5])
