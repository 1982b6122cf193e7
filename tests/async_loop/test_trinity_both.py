"""Trinity's asynchronous loop: ``trinity run`` in ``mode: both`` with a vLLM explorer on CPUs.

One launch of ``scripts/trinity_run.py --mode both`` for 4 steps, as ``make trinity-run
TRINITY_RUN_ARGS="--mode both"`` runs it, in the environment of ``make setup-vllm``: the explorer
rolls out with vLLM, the trainer trains BAPO on 2 ranks from the queue, and the synchronizer hands
the trainer's checkpoints back to the explorer (``sync_interval: 2``, ``sync_offset: 1``). What
happened is read from Trinity's own log and the ranks' records, apart from the launcher's report.

Not part of ``make test`` (pyproject's ``norecursedirs``): ``make test-async`` runs it, after
setting up that environment. ``BOTH_MODE_ARGS`` adds launcher arguments, as a control:
``--sync-interval 5`` (no reload within the run) must fail it.
"""

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from scripts.harness.launch import REPO, tail
from scripts.harness.ray_local import link_dir, ray_processes
from tests.test_trinity_run import BAPO_METRICS, git_status, logged_steps, rank_records

STEPS = 4
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The launch, in a new folder of its own, and what it left behind."""
    out = tmp_path_factory.mktemp("trinity-both") / "run"
    status, started = git_status(), time.monotonic()
    cmd = [VLLM_PYTHON, "-m", "scripts.trinity_run", "--mode", "both", "--steps", str(STEPS)]
    cmd += ["--out", str(out), *shlex.split(os.environ.get("BOTH_MODE_ARGS", ""))]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    print(f"trinity-run --mode both test launch: {time.monotonic() - started:.0f} s")
    return dict(
        out=out,
        done=done,
        git_status_new=sorted(git_status() - status),
        link_left=link_dir(out / "ray").exists(),
        left_running=ray_processes(out / "ray"),
    )


def versions_in_log(out: Path, pattern: str) -> list:
    """The versions that Trinity's log names where ``pattern``'s group matches, in order."""
    return [int(v) for v in re.findall(pattern, (out / "trinity.log").read_text())]


def test_the_launch_exits_0_with_its_report(run):
    done = run["done"]
    assert done.returncode == 0, f"exit {done.returncode}\n{tail(done.stdout + done.stderr)}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["steps"] == list(range(1, STEPS + 1)) and report["ranks_agree"] is True


def test_the_explorer_reloaded_a_trainer_checkpoint(run):
    reloaded = versions_in_log(run["out"], r"New model weights version: (\d+)")  # the explorer's
    saved = versions_in_log(
        run["out"], r"state_dict save initiated: path=\S+/global_step_(\d+)/actor"
    )
    assert reloaded, "the explorer never reloaded the trainer's weights"
    assert all(version > 0 and version in saved for version in reloaded), (reloaded, saved)
    rolled = [m["rollout/model_version"] for m in logged_steps(run["out"], "rollout/").values()]
    assert max(rolled) in reloaded, "no rollout with a reloaded version"


def test_some_step_trained_on_stale_samples(run):
    trained = logged_steps(run["out"])
    stale = {
        step: metrics["sample/model_version/min"]
        for step, metrics in trained.items()
        if metrics["sample/model_version/min"] < step - 1  # the trainer's version at step N
    }
    assert stale, {s: m["sample/model_version/min"] for s, m in trained.items()}


def test_bapo_metrics_at_every_step(run):
    trained = logged_steps(run["out"])
    assert sorted(trained) == list(range(1, STEPS + 1))
    for metrics in trained.values():
        assert all(f"actor/bapo_{name}" in metrics for name in BAPO_METRICS), sorted(metrics)
        assert 0.0 <= metrics["actor/bapo_positive_contribution"] <= 1.0


def test_the_ranks_chose_the_same_pair_at_every_call(run):
    calls = rank_records(run["out"])
    pairs = [
        [(c["metrics"]["bapo_clip_low"], c["metrics"]["bapo_clip_high"]) for c in r] for r in calls
    ]
    assert len(pairs[0]) >= STEPS and pairs[0] == pairs[1]


def test_nothing_left_running_or_written_into_the_checkout(run):
    assert run["left_running"] == []
    assert run["git_status_new"] == [], "the run wrote into the checkout"
    assert not run["link_left"], "the short link to Ray's temp dir is left"
