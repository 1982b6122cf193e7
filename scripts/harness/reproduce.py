"""Did this machine's demo reproduce the documented runs? A digest of each step, compared.

The pinned numerics make a run the same from one launch to the next on a machine, but not on
every CPU (docs/results.md, Reproducibility). ``DIGESTS`` holds, per reference machine and
variant, a hash of every step's metrics (all fields but the wall time) and the step's reward on
fresh samples, so ``make demo`` can say where a run parts from each reference: at the first step
with any other bit, and at the first step where the sampled answers, and so the rewards, differ.
Record a run: ``python -m scripts.harness.reproduce LABEL RANKS LAG VARIANT=METRICS.jsonl ...``.
"""

import hashlib
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

DIGESTS = Path(__file__).with_name("demo_digests.json")


def step_digest(row: Dict) -> str:
    """A short hash of one step's metrics, every field but ``wall_s`` (the only one that varies)."""
    fields = {key: value for key, value in row.items() if key != "wall_s"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]


def run_digest(path: Path) -> Dict[str, List]:
    """The digest of one run's metrics file: a hash and the reward (6 digits) of every step."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {
        "steps": [step_digest(r) for r in rows],
        "reward": [round(r["reward"], 6) for r in rows],
    }


def first_difference(mine: List, reference: List) -> Optional[int]:
    """The first step where two runs differ (over the steps both have); None if none does."""
    return next((step for step, (a, b) in enumerate(zip(mine, reference)) if a != b), None)


def compare(runs: Dict[str, Path], settings: Dict) -> Dict[str, Dict]:
    """Per reference machine with these settings: where each variant's run parts from it."""
    mine = {name: run_digest(path) for name, path in runs.items()}
    verdicts = {}
    for label, entry in json.loads(DIGESTS.read_text()).items():
        if entry["settings"] != settings or set(entry["runs"]) != set(mine):
            continue
        verdicts[label] = {
            name: {
                "steps_compared": min(len(run["steps"]), len(entry["runs"][name]["steps"])),
                "parted_at": first_difference(run["steps"], entry["runs"][name]["steps"]),
                "rewards_parted_at": first_difference(run["reward"], entry["runs"][name]["reward"]),
            }
            for name, run in mine.items()
        }
    return verdicts


def sentence(verdicts: Dict[str, Dict]) -> str:
    """One line for a user: which documented run this one reproduced, or where it parted."""
    if not verdicts:
        return "no documented run has these ranks and lag: this run was not compared"
    lines = []
    for label, per in verdicts.items():
        parted = {name: v for name, v in per.items() if v["parted_at"] is not None}
        if not parted:
            steps = min(v["steps_compared"] for v in per.values())
            lines.append(
                f"this run reproduced the documented run on {label} at every step ({steps})"
            )
            continue
        where = ", ".join(
            f"{name} from step {v['parted_at']} (rewards from step {v['rewards_parted_at']})"
            for name, v in parted.items()
        )
        lines.append(f"this run parted from the documented run on {label}: {where}")
    return "; ".join(lines)


def add(label: str, settings: Dict, runs: Dict[str, Path]) -> None:
    """Record the digest of ``runs`` (variant -> metrics file) as the reference ``label``."""
    digests = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    entry = {"settings": settings, "runs": {name: run_digest(p) for name, p in runs.items()}}
    digests[label] = entry
    DIGESTS.write_text(json.dumps(digests) + "\n")


if __name__ == "__main__":
    name, ranks, lag, *pairs = sys.argv[1:]
    given = dict(pair.split("=", 1) for pair in pairs)
    add(name, {"ranks": int(ranks), "lag": int(lag)}, {k: Path(v) for k, v in given.items()})
