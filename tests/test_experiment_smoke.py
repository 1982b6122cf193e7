"""Tests for `make experiment` (scripts/bapo_experiment.py and scripts/experiment/).

The smoke test runs the real study with ``--quick`` (every variant, 2 seeds, both staleness
levels, a few steps) and checks its structure: every run wrote one line per step, the table,
the summary and the figure exist, and the final JSON line holds each variant's figures. It
does not judge the numbers: a few steps decide nothing. The smaller tests pin the task's reward
and the study's stated rules (final window, collapse) to hand-worked cases.
"""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
SCRIPT = SCRIPTS / "bapo_experiment.py"
QUICK_STEPS, QUICK_SEEDS = 6, 2
VARIANTS = (
    "ppo",
    "ppo_clip_higher",
    "bapo_fixed_start",
    "bapo_paper",
    "bapo_gradient",
    "bapo_authors",
)
LEVELS = ("near_on_policy", "stale")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

sys.path.insert(0, str(SCRIPTS))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Run the quick study once for the module."""
    out = tmp_path_factory.mktemp("experiment")
    # Its own process group, so a hang kills the study's pool processes too, not just the parent.
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the quick study did not finish within 240 s")
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out, proc


def test_quick_study_exits_zero_and_ends_with_json(quick_run):
    """The final JSON line holds every level and variant with mean and std figures."""
    out, proc = quick_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["runs_finished"] == len(VARIANTS) * QUICK_SEEDS * len(LEVELS)
    assert set(result["variants"]) == set(LEVELS)
    for level in LEVELS:
        assert set(result["variants"][level]) == set(VARIANTS)
        for figures in result["variants"][level].values():
            for key in ("final_reward", "final_entropy", "moved_share"):
                assert set(figures[key]) == {"mean", "std"}
                assert math.isfinite(figures[key]["mean"]) and figures[key]["std"] >= 0
            assert 0 <= figures["moved_share"]["mean"] <= 1
            assert 0 <= figures["final_reward"]["mean"] <= 1
        share = result["neg_token_share"][level]["mean"]
        assert 0 <= share <= 1


def test_every_run_wrote_every_step(quick_run):
    """Every run finished: one metrics line per step, each with the per-step fields."""
    out, _ = quick_run
    for level in LEVELS:
        for variant in VARIANTS:
            for seed in range(QUICK_SEEDS):
                path = out / level / variant / f"seed{seed}" / "metrics.jsonl"
                rows = [json.loads(line) for line in path.read_text().splitlines()]
                assert [r["step"] for r in rows] == list(range(QUICK_STEPS))
                for row in rows:
                    for key in ("reward", "entropy", "rho", "grad_norm", "pairs", "moved"):
                        assert key in row, (path, key)
                    assert len(row["pairs"]) == (4 if level == "stale" else 2)
                    assert row["dp_group_forwarded"] is True  # the loss saw the run's group


def test_fixed_variants_never_move_and_bapo_stays_in_its_ranges(quick_run):
    """Fixed pairs stay fixed; the authors' BAPO stays inside its ranges."""
    out, _ = quick_run
    fixed = {"ppo": [0.8, 1.2], "ppo_clip_higher": [0.8, 1.28], "bapo_fixed_start": [0.6, 1.2]}
    for level in LEVELS:
        for variant, pair in fixed.items():
            rows = [
                json.loads(x)
                for x in (out / level / variant / "seed0" / "metrics.jsonl")
                .read_text()
                .splitlines()
            ]
            assert all(p == pytest.approx(pair) for r in rows for p in r["pairs"])
            assert not any(r["moved"] for r in rows)
        rows = [
            json.loads(x)
            for x in (out / level / "bapo_authors" / "seed0" / "metrics.jsonl")
            .read_text()
            .splitlines()
        ]
        for r in rows:
            for low, high in r["pairs"]:
                assert 0.6 - 1e-9 <= low <= 0.8 + 1e-9 and 1.2 - 1e-9 <= high <= 2.0 + 1e-9


def test_table_summary_and_figure_are_written(quick_run):
    """The table has one row per level and variant; the figure is a PNG."""
    out, _ = quick_run
    table = (out / "table.md").read_text().splitlines()
    assert len(table) == 2 + len(VARIANTS) * len(LEVELS)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stale"]["bapo_paper"]["runs"] == QUICK_SEEDS
    png = out / "report.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    assert png.stat().st_size > 20_000


# --- the task and the stated rules, against hand-worked cases ---------------------------------


def test_reward_hand_examples():
    """The reward on hand-worked answers, truncation included."""
    from experiment.task import EOS, SEP, reward

    prompt = [3, 4, 5, SEP]
    assert reward(prompt, [5, 3, 4, EOS, 0, 0]) == pytest.approx(1.0)  # any order
    assert reward(prompt, [3, EOS]) == pytest.approx(1 / 3)  # one of three
    assert reward(prompt, [3, 3, 4, 5, EOS]) == pytest.approx(3 / 4)  # one token too many
    assert reward(prompt, [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) == 0.0  # truncated: no EOS
    assert reward(prompt, [EOS]) == 0.0


def test_final_window_and_collapse_rule():
    """The stated final window and collapse rule on hand-made curves."""
    from experiment.report import collapsed, final

    rows = [{"reward": r} for r in [0.1] * 10 + [0.8] * 10]
    assert final(rows, "reward") == pytest.approx(0.8)  # last 10% = last 2 steps
    assert not collapsed(rows)
    fell = [{"reward": r} for r in [0.1] * 5 + [0.8] * 10 + [0.3] * 5]
    assert collapsed(fell)  # 0.3 < 0.5 * 0.8
    held = [{"reward": r} for r in [0.1] * 5 + [0.8] * 10 + [0.5] * 5]
    assert not collapsed(held)  # 0.5 >= 0.4


def test_cover_reward_hand_examples():
    """The ``cover`` task's reward: k / length once every prompt token is in, else 0."""
    from experiment.task import EOS, SEP, reward_cover

    prompt = [3, 4, 5, SEP]
    assert reward_cover(prompt, [5, 3, 4]) == pytest.approx(1.0)
    assert reward_cover(prompt, [3, 9, 9, 4, 5]) == pytest.approx(3 / 5)
    assert reward_cover(prompt, [3, 4, 9, 9, 9, 9, 9, 9, 9, 9]) == 0.0  # limit, not covered
    assert reward_cover(prompt, [3, 4, EOS]) == 0.0  # stopped before covering


def test_cover_sampler_ends_a_response_once_its_goal_is_covered():
    """With a goal, no response runs past the token that completes it."""
    import torch

    from demo.policy import build_model, sample_responses
    from experiment.task import EOS, MAX_POSITIONS, RESPONSE_LEN, goal_tokens

    prompts = torch.tensor([[0, 3, 4, 5, 1]] * 64)
    mask = torch.tensor([[0, 1, 1, 1, 1]] * 64)
    goal = goal_tokens([[7, 1]] * 64)  # one wanted token, 7
    gen = torch.Generator().manual_seed(0)
    model = build_model(0, MAX_POSITIONS)
    responses, rmask, _, _ = sample_responses(model, prompts, mask, gen, goal, RESPONSE_LEN)
    stopped_on_goal = 0
    for row, m in zip(responses.tolist(), rmask.sum(dim=1).tolist()):
        body = row[:m]
        assert 7 not in body[:-1]  # the goal token, if present, is the last one
        assert body[-1] in (7, EOS) or m == RESPONSE_LEN
        stopped_on_goal += body[-1] == 7
    assert stopped_on_goal > 0  # some rows did end on the goal (random policy, 64 rows)
