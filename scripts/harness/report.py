"""The trainer's metrics.jsonl files as summaries, a table and a figure (demo and experiment).

"Final" is the mean over the last ``FINAL_SHARE`` of a run's steps, since one step's reward is
noisy. A run "collapsed" when that mean is below ``COLLAPSE_FRACTION`` of its best window's.
"""

import json
import shutil
import statistics
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np

from scripts.harness.launch import REPO

FINAL_SHARE = 0.1
COLLAPSE_FRACTION = 0.5
PANELS = (
    ("reward", "reward, fresh samples"),
    ("entropy", "token entropy, fresh samples"),
    ("rho", "rho at the pair used"),
    ("clip_low", "lower bound used (mean of calls)"),
    ("clip_high", "upper bound used (mean of calls)"),
)
# The rollouts' imbalance, averaged over a run's steps
IMBALANCE = ("neg_token_share", "neg_mass_share", "truncated_share", "len_pos", "len_neg")
FIGURES = ("final_reward", "final_entropy", "moved_share", "mean_rho", *IMBALANCE)
TABLE = (("final_reward", 3), ("final_entropy", 3), ("moved_share", 2), ("mean_rho", 3))


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
    w = window(rows)
    rewards = [r["reward"] for r in rows]
    best = max(statistics.fmean(rewards[i : i + w]) for i in range(len(rewards) - w + 1))
    return best > 0 and final(rows, "reward") < COLLAPSE_FRACTION * best


def _mean_of(rows: Sequence[Dict], key: str) -> float:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.fmean(values) if values else float("nan")


def run_summary(rows: Sequence[Dict]) -> Dict:
    """One run's figures, and what the trainer checked at every step."""
    errors = [r["logprob_layout_err"] for r in rows if r["logprob_layout_err"] is not None]
    return {
        "first_reward": statistics.fmean(r["reward"] for r in rows[: window(rows)]),
        "final_reward": final(rows, "reward"),
        "final_entropy": final(rows, "entropy"),
        "moved_share": sum(r["moved"] for r in rows) / len(rows),
        "collapsed": collapsed(rows),
        "mean_rho": _mean_of(rows, "rho"),
        **{key: _mean_of(rows, key) for key in IMBALANCE},
        "ranks_agree": all(r["ranks_agree"] for r in rows),
        "dp_group_forwarded": all(r["dp_group_forwarded"] for r in rows),
        "logprob_layout_max_err": max(errors) if errors else None,
    }


def mean_std(values: Sequence[float]) -> Dict:
    """Mean and sample standard deviation over seeds (std 0 for a single seed)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": round(statistics.fmean(values), 4), "std": round(std, 4)}


def group_summary(runs: Sequence[Sequence[Dict]]) -> Dict:
    """A variant at one staleness level, over its seeds."""
    each = [run_summary(rows) for rows in runs]
    out: Dict[str, Any] = {k: mean_std([e[k] for e in each]) for k in FIGURES}
    out["collapsed_runs"] = sum(e["collapsed"] for e in each)
    out["runs"] = len(each)
    return out


def table(summary: Dict, labels: Dict[str, str]) -> str:
    """A markdown table: one row per (level, variant)."""
    lines = [
        "| staleness | variant | final reward | final entropy | steps with moved bounds "
        "| mean rho | collapsed runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for level, variants in summary.items():
        for name, s in variants.items():
            cells = [level, labels[name]]
            for key, digits in TABLE:
                cells.append(f"{s[key]['mean']:.{digits}f} ± {s[key]['std']:.{digits}f}")
            lines.append(f"| {' | '.join(cells)} | {s['collapsed_runs']} of {s['runs']} |")
    return "\n".join(lines)


def smooth(values: List[float], width: int) -> np.ndarray:
    """Running mean over the last ``width`` values (fewer at the start)."""
    total = np.cumsum(values)
    total[width:] = total[width:] - total[:-width]
    return total / np.minimum(np.arange(1, len(values) + 1), width)


def plot(runs: Dict, labels: Dict[str, str], path: Path, title: str, docs=None) -> None:
    """Rows: staleness levels; columns: PANELS; a mean and ±1 std per variant; copied to docs/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(runs)
    fig, axes = plt.subplots(
        len(levels), len(PANELS), figsize=(4 * len(PANELS), 3.4 * len(levels)), squeeze=False
    )
    for i, level in enumerate(levels):
        for j, (key, name) in enumerate(PANELS):
            ax = axes[i][j]
            for k, (variant, seeds) in enumerate(runs[level].items()):
                width = max(1, window(seeds[0]))
                curves = np.array([smooth([r[key] for r in rows], width) for rows in seeds])
                mean, std = curves.mean(axis=0), curves.std(axis=0)
                steps = np.arange(curves.shape[1])
                ax.plot(steps, mean, color=f"C{k % 10}", label=labels[variant], linewidth=1.2)
                ax.fill_between(steps, mean - std, mean + std, color=f"C{k % 10}", alpha=0.15)
            ax.set_title(f"{level}: {name}", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    if docs:
        shutil.copyfile(path, REPO / "docs" / docs)
