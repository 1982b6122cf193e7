"""The trainer's output as summaries, markdown tables and figures (demo, study, sensitivity).

"Final" is the mean over the last ``FINAL_SHARE`` of a run's steps, since one step's reward is
noisy. A run "collapsed" when that mean is below ``COLLAPSE_FRACTION`` of its best window's.
"""

import json
import shutil
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from scripts.harness.launch import REPO
from scripts.harness.variants import variant

FINAL_SHARE = 0.1
COLLAPSE_FRACTION = 0.5
PANELS = {"reward": "reward, fresh samples", "entropy": "token entropy, fresh samples"}
PANELS.update(rho="rho at the pair used", clip_low="c_low (mean of calls)")
PANELS["clip_high"] = "c_high (mean of calls)"
# The rollouts' imbalance, averaged over a run's steps
IMBALANCE = ("neg_token_share", "neg_mass_share", "truncated_share")
FIGURES = ("final_reward", "final_entropy", "moved_share", "mean_rho", *IMBALANCE)
# How BAPO's calls ended: start pair kept; target met after moving; on (b-, b+), target missed
OUTCOMES = ("kept_start", "met_after_moving", "ended_at_last_pair")


def load_rows(path: Path) -> List[Dict]:
    """The JSON lines of one run, with the pairs summed up as mean lower and upper bounds."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["clip_low"] = statistics.fmean(p[0] for p in row["pairs"])
        row["clip_high"] = statistics.fmean(p[1] for p in row["pairs"])
    return rows


def window(rows: Sequence[Dict]) -> int:
    """How many steps the final figures average."""
    return max(1, round(len(rows) * FINAL_SHARE))


def final(rows: Sequence[Dict], key: str) -> float:
    """Mean of ``key`` over the run's last window."""
    return statistics.fmean(r[key] for r in rows[-window(rows) :])


def collapsed(rows: Sequence[Dict]) -> bool:
    """The stated rule: final reward below COLLAPSE_FRACTION of the best window's mean."""
    w, rewards = window(rows), [r["reward"] for r in rows]
    best = max(statistics.fmean(rewards[i : i + w]) for i in range(len(rewards) - w + 1))
    return best > 0 and final(rows, "reward") < COLLAPSE_FRACTION * best


def mean_of(rows: Sequence[Dict], key: str) -> float:
    """The mean of ``key`` over the steps that have it."""
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.fmean(values) if values else float("nan")


def last_pair(name: str) -> Optional[List[float]]:
    """A BAPO variant's last grid pair (b-, b+); None for PPO."""
    args = variant(name).args
    return [args["ratio_lower_max"], args["ratio_upper_max"]] if "ratio_lower_max" in args else None


def outcomes(rows: Sequence[Dict], last: List[float]) -> Dict:
    """The share of BAPO's calls in each of OUTCOMES (they add to 1), and the lower phase.

    ``lower_phase`` (``upper_first``): calls, those that raised c_low, rho grew at it, ran to b-.
    """
    calls = [c for r in rows for c in zip(r["pairs"], r["search_steps"], r["target_met"])]
    kept = sum(steps == 0 for _, steps, _ in calls)
    met = sum(steps > 0 and hit for _, steps, hit in calls)
    end = sum(steps > 0 and not hit and pair == last for pair, steps, hit in calls)
    shares = [kept / len(calls), met / len(calls), end / len(calls)]
    lower = [(p, g) for r in rows for p, g in zip(r["pairs"], r.get("lower_grew", []))]
    lower = [(pair, grew) for pair, grew in lower if grew is not None]
    phase = {"calls": len(calls), "entered": len(lower), "grew": sum(g for _, g in lower)}
    phase["ran_to_b_minus"] = sum(pair[0] == last[0] for pair, _ in lower)
    upper_first = "lower_grew" in rows[0]
    out = {**dict(zip(OUTCOMES, shares)), "outcome_sum": sum(shares)}
    return {**out, "lower_phase": phase if upper_first else None}


def run_summary(rows: Sequence[Dict], last: Optional[List[float]] = None) -> Dict:
    """One run's figures, what the trainer checked at every step, and (BAPO) its calls' ends."""
    return {
        **(outcomes(rows, last) if last else {}),
        "first_reward": statistics.fmean(r["reward"] for r in rows[: window(rows)]),
        "final_reward": final(rows, "reward"),
        "final_entropy": final(rows, "entropy"),
        "moved_share": sum(r["moved"] for r in rows) / len(rows),
        "collapsed": collapsed(rows),
        "mean_rho": mean_of(rows, "rho"),
        **{key: mean_of(rows, key) for key in IMBALANCE},
        "ranks_agree": all(r["ranks_agree"] for r in rows),
        "dp_group_forwarded": all(r["dp_group_forwarded"] for r in rows),
    }


def mean_std(values: Sequence[float]) -> Dict:
    """Mean and sample standard deviation over seeds (std 0 for a single seed)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": round(statistics.fmean(values), 4), "std": round(std, 4)}


def group_summary(runs: Sequence[Sequence[Dict]], last=None) -> Dict:
    """A variant at one level, over its seeds; BAPO's call outcomes, its lower phase summed."""
    each = [run_summary(rows, last) for rows in runs]
    keys = FIGURES + (OUTCOMES + ("outcome_sum",) if last else ())
    out: Dict[str, Any] = {k: mean_std([e[k] for e in each]) for k in keys}
    if last:
        phase = [e["lower_phase"] for e in each]
        out["lower_phase"] = {k: sum(p[k] for p in phase) for k in phase[0]} if phase[0] else None
    return {**out, "collapsed_runs": sum(e["collapsed"] for e in each), "runs": len(each)}


def markdown(header: str, rows: List[List[Any]]) -> str:
    """A markdown table: ``header`` names the columns, separated by '|'."""
    lines = [f"| {header} |", "|" + "---|" * (header.count("|") + 1)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def table(summary: Dict, labels: Dict[str, str]) -> str:
    """The study's table, one row per level and variant, and BAPO's calls by how they ended."""
    rows, calls, phases = [], [], ("entered", "grew", "ran_to_b_minus")
    for level, variants in summary.items():
        for name, s in variants.items():
            cells = {
                k: f"{s[k]['mean']:.3f} ± {s[k]['std']:.3f}" for k in FIGURES + OUTCOMES if k in s
            }
            collapsed = f"{s['collapsed_runs']} of {s['runs']}"
            rows.append([level, labels[name], *(cells[k] for k in FIGURES[:4]), collapsed])
            if "lower_phase" in s:
                phase = s["lower_phase"] or dict.fromkeys(phases, "-")
                ends = [*(cells[k] for k in OUTCOMES), f"{s['outcome_sum']['mean']:.3f}"]
                calls.append([level, labels[name], *ends, *(phase[k] for k in phases)])
    head = "staleness | variant | final reward | final entropy | steps with moved bounds | mean rho"
    head_calls = "staleness | variant | kept the start pair | met the target after moving | "
    head_calls += "ended at (b-, b+), missed | sum | calls that raised c_low | rho grew | ran to b-"
    return markdown(head + " | collapsed runs", rows) + "\n\n" + markdown(head_calls, calls)


def sensitivity_table(rows: List[Dict]) -> str:
    """One row per rank count and micro-batch size: the pairs chosen and their distance."""
    head = "ranks | sequences per call and rank | decided per | calls | pairs chosen (count) | "
    head += "whole mini-batch's pair | mean abs dc_low | mean abs dc_high | same pair"
    cells = [
        [r["ranks"], r["micro"], r["scope"].replace("_", "-"), r["calls"], r["pairs"]]
        + [r["reference"]]
        for r in rows
    ]
    for cell, r in zip(cells, rows):
        cell += [f"{r['d_low']:.3f}", f"{r['d_high']:.3f}", f"{r['same_pair']:.2f}"]
    return markdown(head, cells)


def smooth(values: List[float], width: int) -> np.ndarray:
    """Running mean over the last ``width`` values (fewer at the start)."""
    total = np.cumsum(values)
    total[width:] = total[width:] - total[:-width]
    return total / np.minimum(np.arange(1, len(values) + 1), width)


def figure(rows: int, columns: int):
    """A grid of panels, on the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, columns, figsize=(4 * columns, 3.4 * rows), squeeze=False)


def save(fig, path: Path, docs: Optional[str]) -> None:
    """Write the figure under ``path`` and, given ``docs``, copy it into docs/."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    if docs:
        shutil.copyfile(path, REPO / "docs" / docs)


def plot(runs: Dict, labels: Dict[str, str], path: Path, title: str, docs=None) -> None:
    """Rows: levels; columns: PANELS (mean and ±1 std per variant), BAPO's calls by OUTCOMES."""
    fig, axes = figure(len(runs), len(PANELS) + 1)
    for i, (level, variants) in enumerate(runs.items()):
        for ax, (key, name) in zip(axes[i], PANELS.items()):
            for k, (run, seeds) in enumerate(variants.items()):
                width = max(1, window(seeds[0]))
                curves = np.array([smooth([r[key] for r in rows], width) for rows in seeds])
                mean, std, steps = curves.mean(0), curves.std(0), np.arange(curves.shape[1])
                ax.plot(steps, mean, color=f"C{k}", label=labels[run], linewidth=1.2)
                ax.fill_between(steps, mean - std, mean + std, color=f"C{k}", alpha=0.15)
            ax.set(title=f"{level}: {name}", xlabel="step")
            ax.grid(alpha=0.3)
        bapo = [name for name in variants if last_pair(name)]
        shares = [group_summary(variants[name], last_pair(name)) for name in bapo]
        bottom = np.zeros(len(bapo))
        for k, key in enumerate(OUTCOMES):
            height = np.array([s[key]["mean"] for s in shares])
            axes[i][-1].bar(range(len(bapo)), height, bottom=bottom, color=f"C{k + 7}", label=key)
            bottom += height
        axes[i][-1].set_xticks(range(len(bapo)), bapo, fontsize=7)
        axes[i][-1].set_title(f"{level}: how BAPO's calls ended")
    for ax in (axes[0][0], axes[0][-1]):
        ax.legend(fontsize=6, loc="lower right")
    for ax in axes.flat:
        ax.title.set_fontsize(8)
    fig.suptitle(title, fontsize=10)
    save(fig, path, docs)


def sensitivity_plot(rows: List[Dict], path: Path, docs: bool) -> None:
    """Mean |dc_low| + |dc_high| and the same-pair share per micro-batch size and rank count.

    Decisions per call (the default); those per update take the reference's pair throughout.
    """
    fig, axes = figure(1, 2)
    per = "micro_batch"
    titles = ["mean |dc_low| + |dc_high|", "share of calls with the same pair"]
    for ax, title, key in zip(axes[0], titles, ("distance", "same_pair")):
        for ranks in sorted({r["ranks"] for r in rows}):
            mine = [(r["micro"], r[key]) for r in rows if (r["ranks"], r["scope"]) == (ranks, per)]
            ax.plot(*zip(*mine), "o-", label=f"{ranks} ranks")
        ax.set(xticks=[1, 2, 4, 8], xlabel="sequences per call and rank", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, path, "sensitivity.png" if docs else None)
