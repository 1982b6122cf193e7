"""Turn the workers' metrics.jsonl files into the figure, the summary and the verdict.

Runs in the parent process, after the workers have exited, and needs only the JSON lines.
"""

import json
from pathlib import Path
from typing import Dict, List

ALGOS = ("ppo", "bapo")
COLOURS = {"ppo": "tab:blue", "bapo": "tab:orange"}
LABELS = {"ppo": "PPO, fixed clip (0.8, 1.28)", "bapo": "BAPO, adaptive clip (paper defaults)"}
WINDOW = 10  # steps averaged for the "first" and "final" numbers; rewards are noisy
RHO_TARGET = 0.4


def load_metrics(path: Path) -> List[Dict]:
    """The rows of one metrics.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def window_mean(rows: List[Dict], key: str, last: bool) -> float:
    """Mean of ``key`` over the first or the last WINDOW steps."""
    part = rows[-WINDOW:] if last else rows[:WINDOW]
    return sum(r[key] for r in part) / len(part)


def summarise(rows: List[Dict]) -> Dict:
    """The per-algorithm numbers of the final JSON line."""
    pairs = [p for r in rows for p in r["pairs"]]
    moved = sum(1 for r in rows if any(p != r["start_pair"] for p in r["pairs"]))
    out = {
        "steps": len(rows),
        "first_reward": window_mean(rows, "reward", last=False),
        "final_reward": window_mean(rows, "reward", last=True),
        "first_entropy": window_mean(rows, "entropy", last=False),
        "final_entropy": window_mean(rows, "entropy", last=True),
        "final_rho": window_mean(rows, "rho", last=True),
        "clip_low_range": [min(p[0] for p in pairs), max(p[0] for p in pairs)],
        "clip_high_range": [min(p[1] for p in pairs), max(p[1] for p in pairs)],
        "steps_with_moved_bounds": moved,
        "ranks_agree": all(r["ranks_agree"] for r in rows),
        "pair_checks": sum(r["pair_checks"] for r in rows),
        "dp_group_forwarded": all(r["dp_group_forwarded"] for r in rows),
        "engine": rows[-1].get("engine"),
        "train_wall_s": rows[-1]["wall_s"],
        "logprob_layout_max_err": max(
            r["logprob_layout_err"] for r in rows if r["logprob_layout_err"] is not None
        ),
    }
    if "rho_check_err" in rows[0]:
        out["rho_check_max_err"] = max(r["rho_check_err"] for r in rows)
    return out


def smooth(values: List[float], width: int = WINDOW) -> List[float]:
    """Running mean over the last ``width`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= width:
            acc -= values[i - width]
        out.append(acc / min(i + 1, width))
    return out


def plot(runs: Dict[str, List[Dict]], path: Path, title: str) -> None:
    """Four panels, both algorithms on the same axes: reward, entropy, rho, clip bounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    (ax_r, ax_e), (ax_rho, ax_b) = axes
    for algo, rows in runs.items():
        steps = [r["step"] for r in rows]
        colour, label = COLOURS.get(algo), LABELS.get(algo, algo)
        for ax, key in ((ax_r, "reward"), (ax_e, "entropy"), (ax_rho, "rho")):
            values = [r[key] for r in rows]
            ax.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
            ax.plot(steps, smooth(values), color=colour, linewidth=1.8, label=label)
        ax_b.plot(
            steps,
            [r["clip_high_max"] for r in rows],
            color=colour,
            linewidth=1.2,
            label=f"{algo} upper",
        )
        ax_b.plot(
            steps,
            [r["clip_low_max"] for r in rows],
            color=colour,
            linewidth=1.2,
            linestyle="--",
            label=f"{algo} lower",
        )
    ax_r.set_title("reward of the (stale) rollouts")
    ax_e.set_title("token entropy of the current policy")
    ax_rho.set_title("positive contribution rho (Eq. 8) at the pair used")
    ax_rho.axhline(RHO_TARGET, color="grey", linestyle=":", label=f"BAPO target {RHO_TARGET}")
    ax_b.set_title("clip bounds (max per step; shaded: BAPO ranges)")
    ax_b.axhspan(1.2, 3.0, color="tab:orange", alpha=0.06)
    ax_b.axhspan(0.6, 0.9, color="tab:orange", alpha=0.06)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("training step")
    ax_r.legend(fontsize=8, loc="lower right")
    ax_rho.legend(fontsize=8, loc="lower right")
    ax_b.set_ylim(0.5, 3.1)
    ax_b.legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    _shrink(path)


def _shrink(path: Path) -> None:
    """Re-save with a 64-colour palette: a quarter of the bytes for a figure of flat lines."""
    from PIL import Image  # pillow ships with matplotlib

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=64)
    small.save(path, optimize=True)


def human_summary(summaries: Dict[str, Dict]) -> List[str]:
    """The summary lines printed before the final JSON line."""
    lines = []
    for algo, s in summaries.items():
        low, high = s["clip_low_range"], s["clip_high_range"]
        line = (
            f"{algo:4s}: reward {s['first_reward']:.3f} -> {s['final_reward']:.3f}, "
            f"entropy {s['first_entropy']:.3f} -> {s['final_entropy']:.3f}, "
            f"rho (last {WINDOW}) {s['final_rho']:.3f}, lower bound {low[0]:.2f}..{low[1]:.2f}, "
            f"upper bound {high[0]:.2f}..{high[1]:.2f}"
        )
        if algo == "bapo":
            line += (
                f", bounds left the start pair at {s['steps_with_moved_bounds']}/{s['steps']}"
                f" steps, rho recomputed independently (max diff {s['rho_check_max_err']:.1e})"
            )
        lines.append(line)
    layout = max(s["logprob_layout_max_err"] for s in summaries.values())
    lines.append(
        f"where the rollout policy was the engine's own weights, the engine's log-probs match "
        f"the sampler's to {layout:.1e}"
    )
    checks = sum(s["pair_checks"] for s in summaries.values())
    agree = all(s["ranks_agree"] for s in summaries.values())
    lines.append(
        f"clip pair all-gathered at {checks} loss calls: "
        + ("every rank used the same pair" if agree else "RANKS DISAGREED")
    )
    return lines
