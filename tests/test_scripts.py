"""The scripts end to end, short, each held to a value computed apart from them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.bench import SIZES, TARGETS, bench_step, cuda_loss, step_inputs, verdict
from scripts.harness import report, reproduce, tasks
from scripts.harness.cases import PAPER, authors_loop, bench_batch
from scripts.harness.launch import REPO
from scripts.harness.model import build_model, build_qwen2, sample_responses
from scripts.harness.run_folder import new_folder
from scripts.harness.variants import variant
from tests import oracle

DEMO_STEPS = 6
CALLS_PER_STEP = 4  # the demo's 2 epochs x 1 mini-batch x 2 micro-batches
LOWER, UPPER = len(range(60, 91, 2)), len(range(120, 301, 5))  # the paper grid's 16 and 37
FIXED = ("ppo", "ppo_clip_higher", "bapo_fixed_start")  # variants whose pair never moves
PAIR = ("bapo_paper", "bapo_update")  # the paper defaults decided per call and per update
# the bench's CUDA step code at a size the CPU runs in seconds
TINY_QWEN2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512)
TINY_QWEN2.update(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def run_module(module: str, *argv, timeout: int = 900, cwd=REPO) -> subprocess.CompletedProcess:
    """Run a module from the repo root as the Makefile runs it, or from ``cwd`` (runs/ is there)."""
    cmd = [sys.executable, "-m", module, *map(str, argv)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def last_json(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def expected(batches, order: str, target=PAPER["positive_contribution_target"]):
    """The oracle's (c_low, c_high, steps) and rho on the union of ``batches``."""
    fields = ("logprob", "old_logprob", "action_mask", "advantages")
    tokens = [t for b in batches for t in oracle.token_lists(*(b[k] for k in fields))]
    kwargs = dict(PAPER, search_order=order, positive_contribution_target=target)
    pair = list(oracle.search(tokens, kwargs))
    return pair, oracle.rho(tokens, *pair[:2])


def assert_choice(got, batches, order: str):
    """``got`` (c_low, c_high, steps[, rho]) is the oracle's on ``batches``."""
    pair, rho = expected(batches, order)
    assert list(got[:3]) == pair
    assert len(got) == 3 or got[3] == pytest.approx(rho, rel=1e-5)


def call_ends(rows, name: str) -> dict:
    """A BAPO run's calls by how they ended, and its lower phase, counted from its metrics."""
    args = variant(name).args
    last = [args["ratio_lower_max"], args["ratio_upper_max"]]
    calls = [c for r in rows for c in zip(r["pairs"], r["search_steps"], r["target_met"])]
    ends = [0 if steps == 0 else 1 if met else 2 for _, steps, met in calls]
    assert all(pair == last for (pair, _, _), end in zip(calls, ends) if end == 2)
    shares = [ends.count(k) / len(ends) for k in range(3)]
    if "lower_grew" not in rows[0]:  # no lower phase but under upper_first with room for it
        return {"shares": shares, "lower_phase": None}
    raised = [(p, g) for r in rows for p, g in zip(r["pairs"], r["lower_grew"])]
    raised = [(p, g) for p, g in raised if p[0] > args["ratio_lower_start"]]
    assert all(g is not None for _, g in raised)  # the trainer followed each raise
    phase = {"calls": len(calls), "entered": len(raised), "grew": sum(g for _, g in raised)}
    phase["ran_to_b_minus"] = sum(p[0] == last[0] for p, _ in raised)
    return {"shares": shares, "lower_phase": phase}


def docs_files() -> dict:
    """Each file under docs/ with its size and modification time."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in (REPO / "docs").glob("*.png")}


@pytest.fixture(scope="module")
def bench():
    done = run_module("scripts.bench", "--quick")
    return done, last_json(done)


def test_bench_pairs_are_the_oracles_on_the_bench_inputs(bench):
    _, result = bench
    assert_choice(result["pair"], [bench_batch(SIZES["quick"]["shape"], seed=0)], "upper_first")
    # the 4 DP ranks each hold one row of 1,024 tokens: every rank takes the union's pair
    union = [bench_batch((1, SIZES["quick"]["dp_tokens"]), seed=1000 + r) for r in range(4)]
    assert result["dp"]["ranks_agree"] is True and result["same_pair"] is True
    assert_choice(result["dp"]["pairs"]["loss"], union, "upper_first")
    assert_choice(result["dp"]["pairs"]["authors"], union, "lower_first")
    assert_choice(result["dp"]["pairs"]["ours"], union, "lower_first")


def test_bench_dp_call_is_one_all_reduce_and_the_baseline_one_per_candidate(bench):
    _, result = bench
    collectives = result["dp"]["collectives"]
    assert result["collectives_per_call"] == 1  # a fresh loss's first call
    # Eq. 8's P at each of the 37 upper bounds and N at each of the 16 lower
    assert result["all_reduce_values_per_call"] == UPPER + LOWER
    assert collectives["loss_unsynced"] == 0
    # the authors' loop reads rho at each of the 16 lower bounds, then at each of the 37 upper
    assert collectives["authors"] == LOWER + UPPER


def test_bench_prints_every_figure_with_the_verdict_of_its_value(bench):
    done, result = bench
    summary = done.stdout.split("## Summary", 1)[1].splitlines()[1 : 1 + len(TARGETS)]
    for line, (key, (label, _, _, _)) in zip(summary, TARGETS.items()):
        assert line.split()[: len(label.split())] == label.split(), line
        assert line.endswith(verdict(key, result[key])) and f"{result[key]:.2f}" in line, line
    met = all(verdict(key, result[key]) == "PASS" for key in TARGETS)
    assert result["all_targets_met"] is met
    medians = result["dp"]["median_s"]
    assert result["dp_speedup_vs_per_candidate_allreduce"] == pytest.approx(
        medians["authors"] / medians["ours"]
    )


def test_bench_update_pass_share_is_the_extra_time_of_an_update_over_one_without(bench):
    _, result = bench
    medians = result["update_pass"]["median_s"]
    assert min(medians.values()) > 0 and result["update_pass"]["micro"] == 8
    extra = (medians["update"] - medians["micro_batch"]) / medians["micro_batch"]
    assert result["update_pass_share_of_step"] == pytest.approx(extra)


def test_bench_verdict_hand_examples():
    within, past = "MISS (within the hard limit)", "MISS (past the hard limit)"
    # goal 2.0, hard limit 3.0, lower is better
    assert [verdict("bapo_over_ppo_loss", v) for v in (1.9, 2.5, 3.1)] == ["PASS", within, past]
    # goal 10, hard limit 5, higher is better
    speedups = [verdict("dp_speedup_vs_per_candidate_allreduce", v) for v in (12, 7, 4)]
    assert speedups == ["PASS", within, past]
    # must equal 1; None: not measured
    assert [verdict("collectives_per_call", v) for v in (1, 2, None)] == ["PASS", "MISS", "MISS"]


@pytest.mark.parametrize("seed,negative_share", [(0, 0.85), (1, 0.5), (2, 0.2)])
def test_authors_loop_baseline_takes_the_oracles_lower_first_pairs(seed, negative_share):
    batch = bench_batch((4, 128), seed=seed, negative_share=negative_share)
    ratio = torch.exp(batch["logprob"] - batch["old_logprob"])  # |log r| is far below the clamp
    tokens = oracle.token_lists(*batch.values())
    # Eq. 8's rho falls as c_low rises and grows with c_high: the walk raises c_low to 0.9, then
    # stops at the first upper candidate past the target
    start = oracle.rho(tokens, 0.6, 1.2)
    upper = [oracle.rho(tokens, 0.9, 1.2 + 0.05 * k) for k in range(UPPER)]
    k = next(k for k, r in enumerate(upper) if r > start)
    targets = {(upper[k] + upper[k + 1]) / 2: LOWER + k, start * (1 - 1e-6): 0, 1.0: 51}
    for rho0, steps in targets.items():
        pair, _ = expected([batch], "lower_first", rho0)
        assert pair[2] == steps
        grid = dict(PAPER, positive_contribution_target=rho0)
        assert list(authors_loop(ratio, batch["advantages"], batch["action_mask"], grid)) == pair


def test_bench_skips_its_cuda_part_in_one_line_without_a_device(bench):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the bench runs its CUDA part")
    done, result = bench
    assert result["cuda"] == {"skipped": "no CUDA device"}
    parts = [line for line in done.stdout.splitlines() if line.startswith("## CUDA")]
    assert parts == ["## CUDA loss and step: skipped, no CUDA device"]


def test_bench_cuda_loss_part_on_cpu_takes_the_oracles_pair():
    result = cuda_loss(SIZES["quick"], device="cpu")
    assert_choice(result["pairs"][4096], [bench_batch((4, 1024), seed=0)], "upper_first")
    assert all(v > 0 for v in result["search_ms"].values())


@pytest.mark.parametrize("negative_share", [0.85, 0.6])  # the bench's whole walk; a stop after 12
def test_bench_cuda_step_on_cpu_takes_the_oracles_pair_on_the_models_log_probs(negative_share):
    model, step = build_qwen2(TINY_QWEN2, torch.float32, "cpu"), (2, 8, 120)
    result = bench_step(model, step, rounds=1, negative_share=negative_share)
    ids, batch = step_inputs(model, step, negative_share)
    with torch.no_grad():  # the log-probs apart from the bench: every position's logits
        logits = model(input_ids=ids).logits[:, step[1] - 1 : -1]
    targets = ids[:, step[1] :]
    logprob = -torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    assert_choice(result["pair"], [dict(batch, logprob=logprob)], "upper_first")
    ms = result["ms"]
    assert result["overhead_pct"] == pytest.approx((ms["bapo"] - ms["ppo"]) / ms["ppo"] * 100)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo without ``--out``, from a directory whose runs/demo holds an earlier run."""
    cwd, before = tmp_path_factory.mktemp("demo"), docs_files()
    earlier = new_folder(cwd / "runs" / "demo")
    (earlier / "metrics.jsonl").write_text("an earlier run's numbers\n")
    kept = (earlier / "metrics.jsonl").stat().st_mtime_ns, sorted(earlier.iterdir())
    done = run_module("scripts.experiment", "demo", "--steps", DEMO_STEPS, cwd=cwd)
    out = (cwd / "runs" / "demo" / "latest").resolve()
    earlier_kept = kept == (
        (earlier / "metrics.jsonl").stat().st_mtime_ns,
        sorted(earlier.iterdir()),
    )
    return out, last_json(done), before == docs_files(), done.stdout, (earlier, earlier_kept)


def test_a_demo_without_out_writes_a_new_folder_and_leaves_the_earlier_one_as_it_was(demo):
    out, _, _, stdout, (earlier, earlier_kept) = demo
    assert out.parent == earlier.parent and out != earlier
    assert f"writing under {out}" in stdout.splitlines()
    assert earlier_kept and (earlier / "metrics.jsonl").read_text() == "an earlier run's numbers\n"
    assert (out / "report.png").exists() and (out / "bapo_paper" / "metrics.jsonl").exists()


def test_demo_trains_both_through_the_engine_with_agreeing_ranks_and_counts_bapo_ends(demo):
    out, result, docs_untouched, stdout, _ = demo
    assert docs_untouched, "the demo changed docs/ without --update-docs"
    assert result["ranks_agree"] is True and result["dp_group_forwarded"] is True
    for name in ("ppo_clip_higher", "bapo_paper"):
        assert f"[{name}] step 1/{DEMO_STEPS}  reward" in stdout, stdout[-2000:]
        rows = report.load_rows(out / name / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(DEMO_STEPS))
        assert all(len(r["pairs"]) == CALLS_PER_STEP and r["ranks_agree"] for r in rows)
    bapo = report.load_rows(out / "bapo_paper" / "metrics.jsonl")
    ppo = report.load_rows(out / "ppo_clip_higher" / "metrics.jsonl")
    assert bapo[0]["rollout_reward"] == ppo[0]["rollout_reward"]  # same seeds, same rollout
    for row in bapo:
        assert all(0.6 <= low <= 0.9 and 1.2 <= high <= 3.0 for low, high in row["pairs"])
        assert row["rho_surrogate"] == pytest.approx(row["rho"], abs=1e-6)  # Eq. 8 apart
    assert all(pair == [0.8, 1.28] for row in ppo for pair in row["pairs"])
    shares = [result["bapo_paper"][key] for key in report.OUTCOMES]
    assert shares == pytest.approx(call_ends(bapo, "bapo_paper")["shares"])
    assert sum(shares) == result["bapo_paper"]["outcome_sum"] == pytest.approx(1.0)
    documented = json.loads(reproduce.DIGESTS.read_text())  # compared with every 2-rank, lag-4 run
    assert set(result["reproduced"]) == {
        k for k, e in documented.items() if e["settings"] == {"ranks": 2, "lag": 4}
    }
    compared = [v["steps_compared"] for per in result["reproduced"].values() for v in per.values()]
    assert compared and set(compared) == {DEMO_STEPS}
    assert reproduce.sentence(result["reproduced"]) in stdout


def test_small_study_trains_every_run_and_counts_how_bapo_calls_ended(tmp_path):
    before = docs_files()
    argv = ("study", "--steps", 3, "--seeds", 1, "--out", tmp_path)
    done = run_module("scripts.experiment", *argv)
    result = last_json(done)
    assert before == docs_files(), "the study changed docs/ without --update-docs"
    assert result["runs_finished"] == 6 * 2 and result["steps"] == 3
    ends = [line for line in done.stdout.splitlines() if " launches ended in " in line]
    counts = [line.split(": ")[1].split(" in ")[0] for line in ends]
    assert counts == ["1 of 2 launches ended", "2 of 2 launches ended"]
    assert ends[-1].endswith("about 0 min left")  # none left after the last
    for path in tmp_path.glob("*/seed0/*/metrics.jsonl"):
        level, name = path.parts[-4], path.parts[-2]
        rows = report.load_rows(path)
        assert len(rows) == 3 and all(r["dp_group_forwarded"] for r in rows), path
        if name in FIXED:
            assert not any(r["moved"] for r in rows), path
        else:
            assert all(r["rho_surrogate"] == pytest.approx(r["rho"], abs=1e-6) for r in rows)
        if name.startswith("bapo"):
            got, counted = result["variants"][level][name], call_ends(rows, name)
            assert [got[k]["mean"] for k in report.OUTCOMES] == pytest.approx(
                counted["shares"], abs=1e-4
            )
            assert got["outcome_sum"]["mean"] == pytest.approx(1.0)
            assert got["lower_phase"] == counted["lower_phase"]
            upper_first = name in ("bapo_paper", "bapo_update")  # with room on both ranges
            assert (got["lower_phase"] is None) is not upper_first
    table = (tmp_path / "table.md").read_text()
    assert table.count("|\n") == (2 + 2 * 6) + (2 + 2 * 4)  # two tables: all runs, BAPO's calls
    for level in ("near_on_policy", "stale"):  # one call per update: per update is per call
        runs = [report.load_rows(tmp_path / level / "seed0" / n / "metrics.jsonl") for n in PAIR]
        assert [r["pairs"] for r in runs[0]] == [r["pairs"] for r in runs[1]], level
        assert [r["reward"] for r in runs[0]] == [r["reward"] for r in runs[1]], level


def test_sensitivity_one_micro_batch_per_rank_is_the_whole_mini_batch_decision(tmp_path):
    out = tmp_path / "a${oc.env:HOME}b"  # no config reader here: the name is kept as it is
    argv = ["--steps", 2, "--sequences", 8, "--ranks", "1,2", "--micro", "2,4,8", "--out", out]
    result = last_json(run_module("scripts.experiment", "sensitivity", *argv))
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
    updates = [s for s in result["splits"] if s["scope"] == "update"]
    splits = {(s["ranks"], s["micro"]): s for s in result["splits"] if s["scope"] == "micro_batch"}
    assert sorted(splits) == [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4)]  # 4 sequences a rank
    # decided per update, every call of every split takes the whole mini-batch's pair
    assert [(s["ranks"], s["micro"]) for s in updates] == sorted(splits)
    assert all(s["same_pair"] == 1.0 and s["distance"] == 0.0 for s in updates), updates
    assert [s["calls"] for s in updates] == [splits[key]["calls"] for key in sorted(splits)]
    assert [splits[key]["calls"] for key in sorted(splits)] == [4, 2, 1, 2, 1]
    assert all(split["ranks_agree"] for split in splits.values())
    # one micro-batch of the whole mini-batch, or one of each half synced over 2 ranks
    for key in ((1, 8), (2, 4)):
        assert splits[key]["same_pair"] == 1.0 and splits[key]["distance"] == 0.0
    record = json.loads((out / "ranks1.json").read_text())
    for split in [s for s in record["splits"] if s["scope"] == "micro_batch"]:
        lp, old, adv = (torch.tensor(row) for row in split["tokens"])
        tokens = oracle.token_lists(lp, old, torch.ones_like(lp), adv)
        assert len(tokens) > 0 and split["reference"] == list(oracle.search(tokens, PAPER)[:2])
        low, high = split["reference"]
        mean = sum(abs(a - low) + abs(b - high) for a, b in split["pairs"]) / len(split["pairs"])
        assert splits[(1, split["micro"])]["distance"] == pytest.approx(mean)


def test_stop_and_cover_rewards_and_group_advantages_hand_examples():
    prompt, eos = [3, 4, 5, tasks.SEP], tasks.EOS
    assert tasks.reward_stop(prompt, [5, 3, 4, eos, 0, 0]) == pytest.approx(1.0)  # any order
    assert tasks.reward_stop(prompt, [3, eos]) == pytest.approx(1 / 3)  # one of three
    assert tasks.reward_stop(prompt, [3, 3, 4, 5, eos]) == pytest.approx(3 / 4)  # one too many
    assert tasks.reward_stop(prompt, [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) == 0.0  # no EOS
    assert tasks.reward_stop(prompt, [eos]) == 0.0
    assert tasks.reward_cover(prompt, [5, 3, 4]) == pytest.approx(1.0)
    assert tasks.reward_cover(prompt, [3, 9, 9, 4, 5]) == pytest.approx(3 / 5)
    assert tasks.reward_cover(prompt, [3, 4, 9, 9, 9, 9, 9, 9, 9, 9]) == 0.0  # not covered
    assert tasks.reward_cover(prompt, [3, 4, tasks.EOS]) == 0.0  # stopped before covering
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


def test_reproduce_names_the_first_step_and_the_first_reward_that_differ(tmp_path, monkeypatch):
    rows = [{"step": s, "reward": s / 7, "grad_norm": 1.0 + s, "wall_s": 0.5} for s in range(5)]

    def write(name: str, changed: dict) -> Path:
        lines = [json.dumps({**row, **changed.get(row["step"], {})}) for row in rows]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
        return tmp_path / name

    monkeypatch.setattr(reproduce, "DIGESTS", tmp_path / "digests.json")
    reproduce.add("reference", {"ranks": 2, "lag": 4}, {"a": write("ref.jsonl", {})})
    cases = {  # changed fields per step -> (parted_at, rewards_parted_at)
        "same.jsonl": ({1: {"wall_s": 9.0}}, (None, None)),
        "bits.jsonl": ({2: {"grad_norm": 3.0000000000000004}}, (2, None)),
        "answers.jsonl": ({1: {"grad_norm": 0.0}, 3: {"reward": 0.5}}, (1, 3)),
    }
    for name, (changed, (parted, rewards)) in cases.items():
        verdict = reproduce.compare({"a": write(name, changed)}, {"ranks": 2, "lag": 4})
        run = verdict["reference"]["a"]
        assert (run["parted_at"], run["rewards_parted_at"], run["steps_compared"]) == (
            parted,
            rewards,
            5,
        )
        assert ("reproduced" in reproduce.sentence(verdict)) == (parted is None)
    assert reproduce.compare({"a": tmp_path / "same.jsonl"}, {"ranks": 4, "lag": 4}) == {}
