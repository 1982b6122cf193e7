"""What both modes of ``scripts/trinity_run.py`` share: a launch, from its folder to its report.

``launch`` takes a folder of its own (``scripts/harness/run_folder.py``: a new one under
``runs/trinity-run`` or ``runs/trinity-run-both``, or ``--out``), owns every process it starts
(``scripts/harness/owned_run.py``), builds the inputs there
(``scripts/harness/trinity_inputs.py``), starts a Ray of its own
(``scripts/harness/ray_local.py``) whose worker processes take the CPU stand-ins
(``scripts/harness/cpu.py``) and record each rank's loss calls, runs ``trinity run --config``,
stops that Ray and prints one JSON line: ``report``'s, which a mode extends
(``scripts/trinity_both.py``). ``trinity run`` exits 0 even when training fails, so success is
read from what it logged: ``problems`` says what keeps a run from being whole, the exit code 1.
A mode brings its own inputs, worker environment, progress lines and report; this module
imports no mode.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from scripts.harness.cpu import CALL_LOG_ENV, STAND_INS_ENV
from scripts.harness.launch import PINNED_NUMERICS, REPO, spawn
from scripts.harness.owned_run import owned_run
from scripts.harness.ray_local import link_base
from scripts.harness.run_folder import RUNS, claim
from scripts.harness.trinity_inputs import (
    GROUPS_PER_STEP,
    RANKS,
    Rollout,
    build_model,
    fill_buffer,
    run_name,
    write_config,
    write_tasks,
)

STEP_LINE = re.compile(r"Step (\d+): (\{.*\})")
METRIC = re.compile(r"'([^']+)': ([^,}]+)")
PAIR_KEYS = ("actor/bapo_clip_low", "actor/bapo_clip_high", "actor/bapo_positive_contribution")


def run_trinity(config_path: Path, env: Dict[str, str], log_path: Path, timeout_s, show, logged):
    """``trinity run``, calling ``show(step, metrics)`` at each ``Step N:`` line it logs.

    Appends the (step, metrics) of every such line to ``logged``, in order; returns the exit code.
    """
    trinity = str(Path(sys.executable).parent / "trinity")
    with open(log_path, "w") as log:
        proc = spawn(
            [trinity, "run", "--config", str(config_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        kill = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
        kill.start()
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                found = STEP_LINE.search(line)
                if found:
                    logged.append((int(found.group(1)), numbers(found.group(2))))
                    show(*logged[-1])
        finally:
            kill.cancel()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def numbers(logged: str) -> Dict[str, float]:
    """The numeric entries of a logged ``{'name': value, ...}``."""
    found = {}
    for key, value in METRIC.findall(logged):
        try:
            found[key] = float(value)
        except ValueError:  # a string entry
            continue
    return found


def rank_calls(folder: Path) -> List[List[dict]]:
    """Each trainer rank's loss calls, in order, as its recorder wrote them."""
    paths = [folder / f"rank{rank}.jsonl" for rank in range(RANKS)]
    return [
        [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
        for p in paths
    ]


def agreement(calls: List[List[dict]]) -> dict:
    """Whether every rank chose the same pair at every call, and the groups the loss received.

    Calls of a pass over an update's data (``search_scope: update``) choose nothing: counted apart.
    """
    pairs = [
        [tuple(c["metrics"][k.split("/")[1]] for k in PAIR_KEYS[:2]) for c in rank if c["metrics"]]
        for rank in calls
    ]
    same_count = len({len(p) for p in pairs}) == 1 and len(pairs[0]) > 0
    apart = sum(len(set(at)) > 1 for at in zip(*pairs))
    groups = sorted({tuple(c["group_ranks"] or ()) for rank in calls for c in rank})
    return dict(
        calls_per_rank=[len(p) for p in pairs],
        pass_calls_per_rank=[sum(not c["metrics"] for c in rank) for rank in calls],
        ranks_agree=same_count and apart == 0,
        calls_apart=apart,
        groups=groups,
    )


def checkpoint(out: Path, name: str, steps: int) -> str:
    """The folder of the last step's actor checkpoint, or "" where Trinity saved none."""
    found = sorted((out / "checkpoints").glob(f"*/{name}/global_step_{steps}/actor"))
    return str(found[0].relative_to(out)) if found and any(found[0].iterdir()) else ""


def prepare(out: Path, steps: int, sync: bool, scope: str, rollout: Optional[Rollout] = None):
    """The model, config, and buffer or task set in the run's new folder; the config's path.

    The buffer is filled in ``mode: train``; given a ``rollout`` (``mode: both``), the explorer's
    task set is written instead.
    """
    (out / "calls").mkdir()
    build_model(out / "model", rollout=rollout is not None)
    config_path = write_config(out, steps, sync, scope, rollout)
    if rollout is None:
        fill_buffer(config_path, steps)
    else:
        write_tasks(out / "tasks", steps * GROUPS_PER_STEP)
    return config_path


def worker_env(out: Path) -> Dict[str, str]:
    """What Ray's worker processes get: the stand-ins on, where to record, our sitecustomize."""
    site = [REPO / "scripts" / "harness" / "ray_site", REPO, os.environ.get("PYTHONPATH", "")]
    env = {STAND_INS_ENV: "1", CALL_LOG_ENV: str(out / "calls"), **PINNED_NUMERICS}
    env.update(PYTHONPATH=os.pathsep.join(str(p) for p in site if p), OMP_NUM_THREADS="1")
    return env


def report(out: Path, args, code: Optional[int], lines: List[Tuple[int, dict]]) -> dict:
    """The JSON line: steps, pairs and rho as Trinity logged them, the ranks' own agreement.

    ``code`` is None where ``trinity run`` did not end (a signal cut the launch short).
    """
    logged, sync = dict(lines), not args.no_sync
    steps = sorted(logged)
    return dict(
        requested_steps=args.steps,
        steps=steps,
        clip_pairs=[[logged[s].get(k) for k in PAIR_KEYS[:2]] for s in steps],
        rho=[logged[s].get(PAIR_KEYS[2]) for s in steps],
        sync_across_dp=sync,
        search_scope=args.search_scope,
        **agreement(rank_calls(out / "calls")),
        checkpoint=checkpoint(out, run_name(sync), args.steps),
        trinity_exit=code,
        log=str(out / "trinity.log"),
    )


def problems(result: dict) -> List[str]:
    """What keeps the run from being whole, in words: ``trinity run`` exits 0 even then.

    Whole: every requested step logged with BAPO's pair, the last step's checkpoint saved,
    ``trinity run`` ended with 0, the ranks chose the same pair at every call where the sync is
    on, and in mode both (which counts ``syncs``) the explorer reloaded a trainer checkpoint.
    """
    found = []
    if result["steps"] != list(range(1, result["requested_steps"] + 1)):
        found.append(f"trainer steps logged: {result['steps']} of {result['requested_steps']}")
    if not all(None not in pair for pair in result["clip_pairs"]):
        found.append("a step without BAPO's pair")
    if result.get("syncs") == 0:
        found.append("the explorer reloaded no trainer checkpoint")
    if not result["checkpoint"]:
        found.append("no checkpoint of the last step")
    if result["trinity_exit"] != 0:
        found.append(f"trinity run exited {result['trinity_exit']}")
    if not result["ranks_agree"] and result["sync_across_dp"]:
        found.append("the ranks chose apart")
    return found


def exit_code(result: dict) -> int:
    """0 where the run is whole (no ``problems``), else 1."""
    return 1 if problems(result) else 0


def launch(args, rollout: Optional[Rollout], workers_for, driver: dict, show, summarize) -> int:
    """Take a folder, build, start Ray, run ``trinity run``, stop Ray, report: the exit code.

    ``rollout``: ``mode: both``, with a GPU slot more for the engine; else ``mode: train``.
    ``workers_for(out)``, ``driver``: the environments of Ray's workers and of the CLI (over
    Ray's). ``show``: the progress lines of ``steps``; ``summarize``: the JSON line, as ``report``.
    """
    started, job = time.monotonic(), "trinity-run-both" if rollout else "trinity-run"
    refuse_before_work(args.out or RUNS / job)
    lines: List[Tuple[int, Dict[str, float]]] = []  # trinity run's Step lines, as they come
    ended: List[int] = []  # trinity run's exit code, once it has one
    with owned_run() as run:
        out = claim(args.out, job)

        def summary() -> dict:
            result = summarize(out, args, ended[0] if ended else None, lines)
            return dict(result, seconds=round(time.monotonic() - started, 1))

        run.summary = summary
        config_path = prepare(out, args.steps, not args.no_sync, args.search_scope, rollout)
        print(f"inputs built under {out}; starting Ray and `trinity run`", flush=True)
        head = run.start_ray(out / "ray", RANKS + (rollout is not None), workers_for(out))
        env = {**head.env, **driver, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        log = out / "trinity.log"
        ended.append(run_trinity(config_path, env, log, args.timeout, show(args.steps), lines))
        result = run.finish()
        found = problems(result)
        if found:
            reasons = "; ".join([*filter(None, [result.get("error")]), *found])
            print(f"mode {args.mode} failed: {reasons} ({result['log']})", file=sys.stderr)
        return exit_code(result)


def refuse_before_work(out: Path) -> None:
    """Exit with one line where the run could not keep to its folder, before anything is made.

    Ray's sockets must fit under the temp dir or ``/tmp``. Trinity reads the config with
    OmegaConf, which takes ``${`` in a value for an interpolation: escaped with a backslash it
    passes ``load_config``, but the verl config that Trinity builds from the values read resolves
    it anew (a model path ``a${oc.env:HOME}b`` becomes ``a/home/...b``), so no escape holds.
    """
    try:
        link_base()
    except RuntimeError as err:
        raise SystemExit(str(err)) from None
    if "${" in str(out.resolve()):
        raise SystemExit(
            f"{out}: a path holding '${{' is refused, since Trinity's config reader (OmegaConf) "
            "would resolve it as an interpolation; name a folder without it"
        )
