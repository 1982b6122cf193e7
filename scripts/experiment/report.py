"""Turn the runs' metrics into the table, the figure and the final JSON line.

"Final" means the mean over the last ``FINAL_SHARE`` of a run's steps (at least one step), since
a single step's fresh-sample reward is noisy. A run's reward "collapsed" when that final mean is
below ``COLLAPSE_FRACTION`` of the best mean over any earlier window of the same length: it
reached something and lost most of it.
"""

import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Sequence

from demo.report import smooth

FINAL_SHARE = 0.1
COLLAPSE_FRACTION = 0.5
PANELS = (
    ("reward", "reward, fresh samples"),
    ("entropy", "token entropy, fresh samples"),
    ("rho", "rho at the pair used"),
    ("clip_low", "lower bound used (mean of calls)"),
    ("clip_high", "upper bound used (mean of calls)"),
)


def load_rows(path: Path) -> List[Dict]:
    """The JSON lines of one run, with the pair split into mean lower and upper bounds."""
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
    w = window(rows)
    rewards = [r["reward"] for r in rows]
    best = max(statistics.fmean(rewards[i : i + w]) for i in range(len(rewards) - w + 1))
    return best > 0 and final(rows, "reward") < COLLAPSE_FRACTION * best


def _mean_of(rows: Sequence[Dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def run_summary(rows: Sequence[Dict]) -> Dict:
    """One run's figures."""
    return {
        "steps": len(rows),
        "final_reward": final(rows, "reward"),
        "final_entropy": final(rows, "entropy"),
        "moved_share": sum(r["moved"] for r in rows) / len(rows),
        "collapsed": collapsed(rows),
        "mean_rho": _mean_of(rows, "rho"),
        "neg_token_share": _mean_of(rows, "neg_token_share"),
        "neg_mass_share": _mean_of(rows, "neg_mass_share"),
        "truncated_share": _mean_of(rows, "truncated_share"),
        "len_pos": _mean_of(rows, "len_pos"),
        "len_neg": _mean_of(rows, "len_neg"),
    }


def mean_std(values: Sequence[float]) -> Dict:
    """Mean and sample standard deviation over seeds (std 0 for a single seed)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": round(statistics.fmean(values), 4), "std": round(std, 4)}


def group_summary(runs: Sequence[Sequence[Dict]]) -> Dict:
    """A variant at one staleness level, over its seeds."""
    each = [run_summary(rows) for rows in runs]
    out: Dict[str, Any] = {
        k: mean_std([e[k] for e in each])
        for k in (
            "final_reward",
            "final_entropy",
            "moved_share",
            "mean_rho",
            "neg_token_share",
            "neg_mass_share",
            "truncated_share",
            "len_pos",
            "len_neg",
        )
    }
    out["collapsed_runs"] = sum(e["collapsed"] for e in each)
    out["runs"] = len(each)
    return out


def _pm(stat: Dict, digits: int = 3) -> str:
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def table(summary: Dict, labels: Dict[str, str]) -> str:
    """A markdown table: one row per (level, variant)."""
    lines = [
        "| staleness | variant | final reward | final entropy | steps with moved bounds "
        "| mean rho | collapsed runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for level, variants in summary.items():
        for name, s in variants.items():
            lines.append(
                f"| {level} | {labels[name]} | {_pm(s['final_reward'])} "
                f"| {_pm(s['final_entropy'])} | {_pm(s['moved_share'], 2)} "
                f"| {_pm(s['mean_rho'])} | {s['collapsed_runs']} of {s['runs']} |"
            )
    return "\n".join(lines)


def _band(ax, curves: List[List[float]], colour: str, label: str) -> None:
    import numpy as np

    arr = np.array(curves, dtype=float)
    mean, std = arr.mean(axis=0), arr.std(axis=0)
    steps = np.arange(arr.shape[1])
    ax.plot(steps, mean, color=colour, label=label, linewidth=1.2)
    ax.fill_between(steps, mean - std, mean + std, color=colour, alpha=0.15, linewidth=0)


def plot(runs: Dict, labels: Dict[str, str], path: Path, title: str) -> None:
    """Rows: staleness levels; columns: PANELS; a mean line and a ±1 std band per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(runs)
    fig, axes = plt.subplots(
        len(levels), len(PANELS), figsize=(4 * len(PANELS), 3.4 * len(levels)), squeeze=False
    )
    colours = [f"C{k}" for k in range(10)]  # matplotlib's default colour cycle
    for i, level in enumerate(levels):
        for j, (key, name) in enumerate(PANELS):
            ax = axes[i][j]
            for k, (variant, seeds) in enumerate(runs[level].items()):
                width = max(1, window(seeds[0]))
                curves = [smooth([r[key] for r in rows], width) for rows in seeds]
                _band(ax, curves, colours[k % len(colours)], labels[variant])
            ax.set_title(f"{level}: {name}", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
