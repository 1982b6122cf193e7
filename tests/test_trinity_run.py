"""Trinity's own ``trinity run --config`` trains BAPO on 2 data-parallel CPU ranks under Ray.

One launch of ``scripts/trinity_run.py`` for 2 steps, as ``make trinity-run`` runs it: the CLI,
config loading and validation, the sqlite buffer, Ray, the trainer, verl's worker ranks, the
engine, ``TrinityPolicyLoss`` with its group, and the checkpoint. Its folder's name holds what
YAML text would misread (``" #"``, ``": "``), and its TMPDIR is 120 characters long, more than
Ray's socket paths leave room for. The steps and metrics are read from what Trinity logged, the
agreement from each rank's own record of its loss calls; then nothing of that Ray may be left
running, and nothing written outside its folder. While it trains in ``X/<name>``, a launch given
``X`` must refuse at once. Before it starts, a stand-in for a Ray that a killed launch left runs:
the launch must name it with the command that stops it, and leave it running until that command.

Three launches cut short by a real signal, each at its moment: SIGHUP before Ray is up, SIGINT
to the process group while Ray starts, SIGTERM while the ranks train. Each must leave no process
it started, no process of its Ray and no link, and end by its signal after a last JSON line.
"""

import argparse
import ast
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import psutil
import pytest
import yaml

from scripts.harness.launch import REPO, tail
from scripts.harness.ray_local import (
    MARK_ENV,
    kill_ray,
    launcher_alive,
    left_rays,
    link_dir,
    name_left_rays,
    ray_processes,
)
from scripts.harness.trinity_launch import agreement, exit_code, numbers, problems

STEPS = 2
NAME = "test-trinity-run #1: yaml"  # a comment and a mapping in YAML text
LONG_TMPDIR = 120  # characters: an HPC job's TMPDIR, too long to hold Ray's sockets
EXAMPLE = REPO / "examples" / "bapo_gsm8k" / "gsm8k.yaml"
BAPO_METRICS = ["clip_low", "clip_high", "positive_contribution", "target_met", "search_steps"]
START, FAR = (0.6, 1.2), (0.9, 3.0)  # the paper's start pair and its grid's last pair
REFUSED_WITHIN_S, CLEAN_WITHIN_S = 5, 10


def snapshot(folder: Path):
    """Every path under ``folder`` with its modification time (None where there is no folder)."""
    if not folder.exists():
        return None
    return sorted((str(p), p.stat().st_mtime_ns) for p in folder.rglob("*"))


def git_status() -> set:
    """The lines of ``git status --porcelain`` (ignored files, such as runs/, not listed)."""
    cmd = ["git", "status", "--porcelain", "--untracked-files=all"]
    return set(subprocess.run(cmd, cwd=REPO, capture_output=True, text=True).stdout.splitlines())


def until(condition, timeout_s: float, what: str) -> float:
    """Wait for ``condition()``, failing after ``timeout_s``; the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"no {what} after {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - started


def running(procs: list) -> list:
    """Those of ``procs`` (``psutil.Process``) that still run: a zombie has ended."""
    found = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


class Started:
    """A command run from the repo's root, leading a process group, read as it prints."""

    def __init__(self, cmd: list, env=None):
        """Start it, in ``env`` or else this one's: stdout lines to ``lines``, stderr to a file."""
        self.lines, self.err = list[str](), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            list(map(str, cmd)),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            start_new_session=True,
            env=env,
        )
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self) -> None:
        """Collect the stdout lines until the command closes it."""
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))

    def printed(self, part: str) -> bool:
        """Whether a line holding ``part`` was printed."""
        return any(part in line for line in self.lines)

    def tree(self) -> list:
        """Every process it started, however deep, now."""
        return psutil.Process(self.proc.pid).children(recursive=True)

    def end(self, timeout_s: float) -> int:
        """Its exit code; past ``timeout_s`` it is killed with all it started (the test failed)."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self.reader.join(10)
        return self.proc.returncode

    def kill(self) -> None:
        """Kill its process group and every process it started."""
        for proc in running(self.tree()):
            proc.kill()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def errors(self) -> str:
        """Everything it wrote on stderr."""
        self.err.seek(0)
        return self.err.read()

    def output(self) -> str:
        """Everything it printed, for a failure's message."""
        return tail("\n".join(self.lines) + "\n" + self.errors())


class Launch(Started):
    """``python -m scripts.trinity_run`` on ``out``."""

    def __init__(self, out: Path, *args, env=None):
        """Start it with ``args`` after ``--out out``."""
        self.out = out
        super().__init__([sys.executable, "-m", "scripts.trinity_run", "--out", out, *args], env)

    def kill(self) -> None:
        """Kill it, all it started, and its Ray."""
        super().kill()
        kill_ray(self.out / "ray")


def training(launch: Launch) -> bool:
    """Whether a rank of this launch has made a loss call (its inputs built, its record begun)."""
    return launch.printed("inputs built") and (launch.out / "calls" / "rank0.jsonl").exists()


def refused_launch(out: Path) -> dict:
    """A launch on a folder that holds a run: its exit code, seconds, and stderr's lines."""
    cmd = [sys.executable, "-m", "scripts.trinity_run", "--out", out]
    started = time.monotonic()
    done = subprocess.run(list(map(str, cmd)), cwd=REPO, capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - started
    return dict(code=done.returncode, seconds=seconds, stderr=done.stderr.strip().splitlines())


# A launcher's stand-in: it starts a process marked as start_ray marks a Ray's head, under the
# folder argv[1], leading a process group of its own as that head does, prints its PID, and waits
LAUNCHER = (
    "import os, subprocess, sys, time; from pathlib import Path; "
    "from scripts.harness.ray_local import mark; "
    "env = {**os.environ, **mark(Path(sys.argv[1]))}; "
    "ray = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], env=env, "
    "start_new_session=True); print(ray.pid, flush=True); time.sleep(600)"
)


def stand_in_ray(folder: Path, killed: bool) -> tuple:
    """A stand-in launcher's marked process under ``folder``: (launcher, PID of the process).

    ``killed``: its launcher is killed with SIGKILL first, as no handler sees.
    """
    cmd = [sys.executable, "-c", LAUNCHER, str(folder)]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    pid = int(launcher.stdout.readline())  # type: ignore[union-attr]
    if killed:
        launcher.kill()
        launcher.wait()
    return launcher, pid


def stop_named(err: str, folder: Path) -> Optional[str]:
    """The stop command of the line on ``err`` that names a Ray left under ``folder``, if any."""
    for line in err.splitlines():
        if line.startswith(f"a Ray left by a killed launch runs under {folder} "):
            return line.split(" with: ", 1)[1]
    return None


def kill_pid(pid: int) -> None:
    """Kill ``pid`` if it still runs (a test's cleanup)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def long_tmpdir():
    """A folder of ``LONG_TMPDIR`` characters, removed afterwards with what the run left there."""
    with tempfile.TemporaryDirectory() as short:
        folder = Path(short) / ("t" * (LONG_TMPDIR - len(short) - 1))
        folder.mkdir()
        yield folder


@pytest.fixture(scope="module")
def run(long_tmpdir, tmp_path_factory):
    """The launch, its report, what it left behind, a launch on its parent refused meanwhile.

    Before it, a Ray a killed launch left; after it, the command it named runs.
    """
    parent = tmp_path_factory.mktemp("trinity-run")
    out, left_folder = parent / NAME, tmp_path_factory.mktemp("left") / "ray"
    ray_home, status = Path.home() / ".ray", git_status()
    before, started = snapshot(ray_home), time.monotonic()
    _, left = stand_in_ray(left_folder, killed=True)
    try:
        first = Launch(out, "--steps", STEPS, env={**os.environ, "TMPDIR": str(long_tmpdir)})
        try:
            until(lambda: training(first) or first.proc.poll() is not None, 600, "a loss call")
            second = refused_launch(parent) if first.proc.poll() is None else None
        finally:
            code = first.end(900)
        seconds = time.monotonic() - started
        assert code == 0 and first.lines, f"exit {code}\n{first.output()}"
        stop, left_ran_on = stop_named(first.errors(), left_folder), alive(left)
        if stop is not None:  # kill_ray returns once no process of that Ray runs
            subprocess.run(shlex.split(stop), cwd=REPO, capture_output=True, timeout=60)
        left_stopped = stop is not None and not alive(left)
    finally:
        kill_pid(left)
    with pytest.MonkeyPatch.context() as patch:  # the link the launch made under its TMPDIR
        patch.setattr(tempfile, "tempdir", str(long_tmpdir))
        link = link_dir(out / "ray")
    return dict(
        out=out,
        report=json.loads(first.lines[-1]),
        progress=first.lines[:-1],
        ray_home_unchanged=snapshot(ray_home) == before,
        git_status_new=sorted(git_status() - status),
        link=link,
        link_left=link.exists(),  # its own: another run's may be up meanwhile
        left_running=ray_processes(out / "ray"),
        seconds=seconds,
        second=second,
        parent=parent,
        left=dict(
            pid=left, folder=left_folder, stop=stop, ran_on=left_ran_on, stopped=left_stopped
        ),
    )


def logged_steps(out: Path, role: str = "actor/") -> dict:
    """One role's ``Step N: {...}`` lines in a run's log, read apart from the launcher.

    A role's lines hold a metric named ``role...`` (the trainer's ``actor/``); a step's lines of
    that role are merged.
    """
    steps: dict = {}
    for line in (out / "trinity.log").read_text().splitlines():
        found = re.search(r"Step (\d+): \{(.*)\}", line)
        if found and f"'{role}" in found.group(2):
            pairs = re.findall(r"'([^']+)': (nan|[-+0-9.e]+)", found.group(2))
            steps.setdefault(int(found.group(1)), {}).update({k: float(v) for k, v in pairs})
    return steps


def rank_records(out: Path) -> list:
    """Each rank's loss calls, as the recorder in its Ray worker appended them."""
    return [
        [json.loads(line) for line in (out / "calls" / f"rank{r}.jsonl").read_text().splitlines()]
        for r in range(2)
    ]


def test_every_step_trained_and_logged_with_bapo_metrics(run):
    steps = logged_steps(run["out"])
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert len(run["progress"]) >= STEPS and run["report"]["steps"] == sorted(steps)
    for step, metrics in steps.items():
        low, high = metrics["actor/bapo_clip_low"], metrics["actor/bapo_clip_high"]
        assert all(f"actor/bapo_{name}" in metrics for name in BAPO_METRICS), sorted(metrics)
        assert START[0] <= low <= FAR[0] and START[1] <= high <= FAR[1]
        rho = metrics["actor/bapo_positive_contribution"]
        assert 0.0 <= rho <= 1.0 and not math.isnan(metrics["actor/pg_loss"])
        assert run["report"]["clip_pairs"][step - 1] == [low, high]
        assert run["report"]["rho"][step - 1] == rho


def test_both_ranks_received_the_group_and_chose_the_same_pair_at_every_call(run):
    calls = rank_records(run["out"])
    assert len(calls[0]) == len(calls[1]) >= STEPS
    pairs = [
        [(c["metrics"]["bapo_clip_low"], c["metrics"]["bapo_clip_high"]) for c in r] for r in calls
    ]
    assert pairs[0] == pairs[1]
    assert all(c["group_ranks"] == [0, 1] for rank in calls for c in rank)
    assert any(pair != START for pair in pairs[0]), "the stale data never moved the search"
    assert run["report"]["ranks_agree"] is True and run["report"]["sync_across_dp"] is True


def test_the_last_step_is_saved(run):
    saved = run["out"] / run["report"]["checkpoint"]
    assert saved.name == "actor" and saved.parent.name == f"global_step_{STEPS}"
    assert any(path.is_file() for path in saved.rglob("*"))


def test_the_run_trained_the_examples_algorithm_and_trainer_settings(run):
    out = run["out"]
    example, used = (yaml.safe_load(p.read_text()) for p in (EXAMPLE, out / "config.yaml"))
    assert used["mode"] == "train" and used["cluster"]["gpu_per_node"] == 2
    assert used["model"]["model_path"] == str(out / "model")  # the folder's name whole
    assert used["algorithm"]["algorithm_type"] == example["algorithm"]["algorithm_type"] == "bapo"
    # the launcher writes the CPU's token budget and the run's length over the example's
    kept = example["trainer"].keys() - {"max_token_len_per_gpu", "total_steps", "save_interval"}
    assert kept  # every other trainer setting of the example is the run's
    for key in kept:
        assert used["trainer"][key] == example["trainer"][key]


def test_nothing_left_running_or_written_outside_its_folder(run):
    assert run["left_running"] == []
    assert run["ray_home_unchanged"], "the run wrote under ~/.ray"
    assert run["git_status_new"] == [], "the run wrote into the checkout"
    assert not run["link_left"], "the short link to Ray's temp dir is left"
    assert run["link"].parent == Path("/tmp")  # its TMPDIR was too long for Ray's sockets
    assert [p.name for p in run["parent"].iterdir()] == [NAME]
    print(f"trinity-run test launch: {run['seconds']:.0f} s")


def test_a_launch_given_the_folder_around_a_live_run_refuses_at_once_naming_it(run):
    second = run["second"]
    assert second["code"] == 1 and second["seconds"] < REFUSED_WITHIN_S, second
    assert second["stderr"] == [
        f"{run['parent']} is not empty; --out takes a new or an empty folder, and nothing in "
        "this one is touched"
    ]
    assert run["report"]["interrupted"] is False  # and the first ran whole: the tests above


def test_a_ray_a_killed_launch_left_is_named_and_runs_on_until_its_command_stops_it(run):
    left = run["left"]
    folder = shlex.quote(str(left["folder"]))
    assert (
        left["stop"] == f"{shlex.quote(sys.executable)} -m scripts.harness.ray_local stop {folder}"
    )
    assert left["ran_on"], "the launch stopped a Ray that was not its own"
    assert left["stopped"], "the command named did not stop it"


def test_only_a_ray_whose_launcher_is_gone_is_left_and_named_with_its_pids(tmp_path, capsys):
    launcher, live = stand_in_ray(tmp_path / "live" / "ray", killed=False)
    _, left = stand_in_ray(tmp_path / "left" / "ray", killed=True)
    try:
        found = {f: pids for f, pids in left_rays().items() if tmp_path in f.parents}
        assert found == {tmp_path / "left" / "ray": [left]}  # the live launcher's is not
        name_left_rays()
        named = [line for line in capsys.readouterr().err.splitlines() if str(tmp_path) in line]
        assert len(named) == 1 and f" (pids {left}); stop it " in named[0]
        assert alive(left) and alive(live)  # named, not stopped
    finally:
        for pid in (left, live):
            kill_pid(pid)
        launcher.kill()
        launcher.wait()
    me = psutil.Process()
    assert launcher_alive(f"{me.pid}:{me.create_time()!r}")
    assert not launcher_alive(f"{me.pid}:{me.create_time() - 1!r}")  # its PID taken by another


@pytest.mark.parametrize(
    "signum, moment",
    [
        (signal.SIGHUP, "before Ray is up"),
        (signal.SIGINT, "while Ray starts"),
        (signal.SIGTERM, "during training"),
    ],
)
def test_a_signal_ends_every_process_of_the_launch_and_the_last_line_says_interrupted(
    signum, moment, tmp_path
):
    out = tmp_path / "run"
    launch = Launch(out, "--steps", 1)
    try:
        reached = MOMENTS[moment]
        until(lambda: reached(launch) or launch.proc.poll() is not None, 600, moment)
        assert launch.proc.poll() is None, f"ended before {moment}\n{launch.output()}"
        tree = launch.tree()
        if signum == signal.SIGINT:  # as Ctrl-C sends it, to the process group
            os.killpg(launch.proc.pid, signum)
        else:
            os.kill(launch.proc.pid, signum)
        signalled = time.monotonic()
        code = launch.end(CLEAN_WITHIN_S)
        until(lambda: not ray_processes(out / "ray"), CLEAN_WITHIN_S, "Ray stopped")
        until(lambda: not running(tree), CLEAN_WITHIN_S, "every process it started ended")
        assert time.monotonic() - signalled < CLEAN_WITHIN_S
    finally:
        launch.end(0)  # a no-op unless the test failed with it alive
    assert code == -signum, launch.output()
    assert not link_dir(out / "ray").exists(), "the short link to Ray's temp dir is left"
    last = json.loads(launch.lines[-1])
    assert last["interrupted"] is True and last["signal"] == signal.Signals(signum).name
    assert last["trinity_exit"] is None and last["requested_steps"] == 1
    progress = [int(line.split()[1].split("/")[0]) for line in launch.lines if line[:5] == "step "]
    assert last["steps"] == progress  # the steps so far
    assert (last["calls_per_rank"][0] > 0) == (moment == "during training")
    # the moment: no Ray folder before Ray is up; no trinity run while Ray starts
    assert (out / "ray").exists() == (moment != "before Ray is up")
    assert (out / "trinity.log").exists() == (moment == "during training")


def preparing(launch: Launch) -> bool:
    """Whether the launch has begun to build its inputs in its folder."""
    return (launch.out / "calls").exists()


def starting_ray(launch: Launch) -> bool:
    """Whether the launch has built its inputs and a process of its Ray is alive."""
    return launch.printed("inputs built") and bool(ray_processes(launch.out / "ray"))


MOMENTS = {
    "before Ray is up": preparing,
    "while Ray starts": starting_ray,
    "during training": training,
}


# A launch of the lifecycle alone, no Ray: it reads a line from stdin while it writes its report,
# so that the test chooses the moment
OWNER = """
import sys
from scripts.harness.owned_run import owned_run

def summary():
    print("reporting", flush=True)
    sys.stdin.readline()
    return {"steps": [1]}

with owned_run(summary) as run:
    run.finish()
"""


# A process that holds a file open (appending, so that nothing in it changes) until killed
HOLD = "import sys, time; f = open(sys.argv[1], 'a'); print('open', flush=True); time.sleep(60)"
# A process with the given environment that starts a child without its mark, titled as Ray's
# agents title themselves over their environment, and prints the child's PID
HIDE = (
    "import os, subprocess, sys, time; env = dict(os.environ); del env[sys.argv[1]]; "
    "child = subprocess.Popen(['ray::DashboardAgent', '-c', 'import time; time.sleep(60)'], "
    "executable=sys.executable, env=env); print(child.pid, flush=True); time.sleep(60)"
)


def holder(path: Path) -> subprocess.Popen:
    """Someone else's process titled ``ray::`` (argv[0]) holding ``path`` open, once it does."""
    cmd = ["ray::Stranger", "-c", HOLD, str(path)]
    proc = subprocess.Popen(cmd, executable=sys.executable, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "open\n"  # type: ignore[union-attr]
    return proc


def marked(folder: Path) -> tuple:
    """A process with the mark of the Ray under ``folder``, and its child's PID, without it."""
    env = {**os.environ, MARK_ENV: str(folder.resolve())}
    cmd = [sys.executable, "-c", HIDE, MARK_ENV]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())  # type: ignore[union-attr]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_rays_processes_are_its_marked_ones_and_their_children_alone(tmp_path):
    """A child of a marked process is found without the mark; a stranger holding a log is not.

    Ray's agents retitle themselves over their environment, mark included; a process of
    someone else's may hold a file open under the folder, and is left alone.
    """
    folder = tmp_path / "ray"
    (folder / "logs").mkdir(parents=True)
    stranger = holder(folder / "logs" / "agent.log")
    parent, child = marked(folder)
    try:
        assert sorted(ray_processes(folder)) == sorted([parent.pid, child])
        kill_ray(folder)
        assert parent.wait(10) == -signal.SIGKILL and stranger.poll() is None
        until(lambda: not alive(child), 10, "the child's end")
    finally:
        for proc in (stranger, parent):
            proc.kill()
            proc.wait()


def test_a_signal_during_the_report_ends_the_run_by_it_after_the_json_line():
    cmd = [sys.executable, "-c", OWNER]
    pipe = subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=pipe, stdout=pipe, stderr=pipe, text=True)
    assert proc.stdout.readline() == "reporting\n"  # type: ignore[union-attr]
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the handler runs in the reading main thread, then the read goes on
    out, err = proc.communicate("go on\n", timeout=30)
    assert proc.returncode == -signal.SIGTERM, err
    assert json.loads(out.splitlines()[-1]) == {
        "steps": [1],
        "interrupted": True,
        "signal": "SIGTERM",
    }


def test_step_lines_are_read_as_trinitys_monitor_writes_them():
    from trinity.utils.monitor import Monitor

    data = {"actor/bapo_clip_low": 0.62, "actor/bapo_positive_contribution": math.nan}
    data.update({"actor/pg_loss": -1.234567891, "time/step": 3, "name": "bapo, run {1}"})
    line = Monitor.format_data_str(None, data, 7)  # self unused: the format alone
    found = re.search(r"Step 7: (\{.*\})", line)
    assert found, line
    read = numbers(found.group(1))
    assert set(read) == {
        "actor/bapo_clip_low",
        "actor/bapo_positive_contribution",
        "actor/pg_loss",
        "time/step",
    }
    assert read["actor/bapo_clip_low"] == 0.62 and math.isnan(
        read["actor/bapo_positive_contribution"]
    )
    assert read["actor/pg_loss"] == -1.23457 and read["time/step"] == 3.0  # 6 significant digits


def call(low, high, group=(0, 1)):
    """One recorded loss call with the pair (low, high)."""
    return {"group_ranks": list(group), "metrics": {"bapo_clip_low": low, "bapo_clip_high": high}}


def test_agreement_counts_the_calls_where_ranks_chose_apart():
    same = agreement([[call(0.6, 1.2), call(0.7, 3.0)], [call(0.6, 1.2), call(0.7, 3.0)]])
    assert same == dict(
        calls_per_rank=[2, 2],
        pass_calls_per_rank=[0, 0],
        ranks_agree=True,
        calls_apart=0,
        groups=[(0, 1)],
    )
    passes = [dict(call(0.6, 1.2), metrics={}), call(0.7, 3.0)]  # a pass call chooses nothing
    counted = agreement([passes, [call(0.7, 3.0)]])
    assert (counted["calls_per_rank"], counted["pass_calls_per_rank"]) == ([1, 1], [1, 0])
    apart = agreement([[call(0.6, 1.2), call(0.7, 3.0)], [call(0.6, 1.25), call(0.7, 3.0)]])
    assert (apart["ranks_agree"], apart["calls_apart"]) == (False, 1)
    assert agreement([[call(0.6, 1.2)], [call(0.6, 1.2), call(0.6, 1.2)]])["ranks_agree"] is False
    assert agreement([[], []])["ranks_agree"] is False


WHOLE = dict(requested_steps=3, steps=[1, 2, 3], checkpoint="c", trinity_exit=0)
WHOLE.update(ranks_agree=True, sync_across_dp=True, clip_pairs=[[0.6, 1.2]] * 3)


@pytest.mark.parametrize(
    "change, code",
    [
        ({}, 0),
        ({"steps": [1, 2]}, 1),  # trinity run exited 0, a step is missing
        ({"steps": [1, 3]}, 1),
        ({"checkpoint": ""}, 1),
        ({"trinity_exit": -9}, 1),  # killed at the timeout
        ({"ranks_agree": False}, 1),
        ({"ranks_agree": False, "sync_across_dp": False}, 0),  # the control may disagree
        ({"clip_pairs": [[0.6, 1.2], [None, None], [0.6, 1.2]]}, 1),  # a step without the pair
    ],
)
def test_exit_code_is_1_unless_the_run_is_whole(change, code):
    assert exit_code({**WHOLE, **change}) == code


def test_stand_ins_are_inert_unless_the_launcher_turns_them_on(monkeypatch):
    from importlib import metadata

    from scripts.harness import cpu

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(metadata, "version", metadata.version)
    before, lookup = list(sys.meta_path), metadata.version
    for off in (None, "0", ""):
        for switch in (cpu.STAND_INS_ENV, cpu.VLLM_STAND_INS_ENV):
            if off is None:
                monkeypatch.delenv(switch, raising=False)
            else:
                monkeypatch.setenv(switch, off)
        cpu.install_from_env()
        assert sys.meta_path == before and metadata.version is lookup
    monkeypatch.setenv(cpu.STAND_INS_ENV, "1")
    cpu.install_from_env()
    hook = sys.meta_path[0]
    assert isinstance(hook, cpu.AfterImport) and hook.name == cpu.WORKERS_MODULE
    assert hook.then is cpu.ray_worker_stand_ins and metadata.version is lookup
    monkeypatch.setenv(cpu.VLLM_STAND_INS_ENV, "1")
    monkeypatch.setenv(cpu.STAND_INS_ENV, "0")
    cpu.install_from_env()
    hooks = {(h.name, h.then) for h in sys.meta_path[:2] if isinstance(h, cpu.AfterImport)}
    assert hooks == {
        (cpu.VLLM_WORKER_MODULE, cpu.vllm_cpu_worker),
        (cpu.TRANSFER_MODULE, cpu.checkpoint_transfer_alone),
    }
    assert metadata.version("torch") == lookup("torch")  # other distributions as before
    with pytest.raises(metadata.PackageNotFoundError, match="vllm-cpu"):
        metadata.version("vllm")  # asked of the CPU build, which this environment lacks


def test_the_hook_runs_once_after_its_module_has_executed(tmp_path, monkeypatch):
    from scripts.harness.cpu import AfterImport

    (tmp_path / "watched_by_the_hook.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    seen = []
    sys.meta_path.insert(0, AfterImport("watched_by_the_hook", lambda: seen.append(module().VALUE)))

    def module():
        return sys.modules["watched_by_the_hook"]

    import watched_by_the_hook  # noqa: F401

    assert seen == [41] and not any(isinstance(f, AfterImport) for f in sys.meta_path)
    monkeypatch.delitem(sys.modules, "watched_by_the_hook")


BOTH = dict(WHOLE, requested_steps=2, steps=[1, 2], clip_pairs=[[0.6, 1.2], [0.7, 2.0]], syncs=1)


@pytest.mark.parametrize(
    "change, code",
    [
        ({}, 0),
        ({"syncs": 0}, 1),  # the explorer never reloaded a trainer checkpoint
        ({"steps": [1]}, 1),
        ({"clip_pairs": [[0.6, 1.2], [None, None]]}, 1),  # a step without BAPO's pair
        ({"checkpoint": ""}, 1),
        ({"trinity_exit": 1}, 1),
        ({"ranks_agree": False}, 1),
    ],
)
def test_mode_both_exits_1_unless_the_loop_is_whole(change, code):
    assert exit_code({**BOTH, **change}) == code


def test_mode_both_splits_the_trainers_step_lines_from_the_explorers():
    from scripts.trinity_both import split_roles

    lines = [
        (1, {"rollout/model_version": 0.0, "rollout/reward/mean": 0.5}),
        (1, {"explore/time/sync_interval": 3.0}),  # a second explorer line of the same step
        (1, {"actor/bapo_clip_low": 0.6, "sample/model_version/min": 0.0}),
        (2, {"rollout/model_version": 2.0}),
    ]
    trainer, explorer = split_roles(lines)
    assert trainer == {1: {"actor/bapo_clip_low": 0.6, "sample/model_version/min": 0.0}}
    assert explorer == {
        1: {
            "rollout/model_version": 0.0,
            "rollout/reward/mean": 0.5,
            "explore/time/sync_interval": 3.0,
        },
        2: {"rollout/model_version": 2.0},
    }


def test_the_parity_reward_is_the_share_of_words_of_the_tasks_parity():
    from scripts.harness.trinity_inputs import ParityReward

    reward = ParityReward()
    assert reward(response="w2 w3 w10 w7", truth="even") == {"parity": 0.5}
    assert reward(response="w3 w5 w4 <eos>", truth="odd") == {"parity": 2 / 3}
    assert reward(response="", truth="odd") == {"parity": 0.0}


def test_mode_both_config_passes_trinitys_checks_with_the_staleness_asked_for(tmp_path):
    from scripts.harness.trinity_inputs import Rollout, write_config, write_tasks
    from trinity.common.config import load_config

    write_tasks(tmp_path / "tasks", 8)
    tasks = [
        json.loads(line)
        for line in (tmp_path / "tasks" / "train.jsonl").read_text().split("\n")
        if line
    ]
    assert [t["answer"] for t in tasks[:2]] == ["even", "odd"]
    assert [t["question"].split()[0] for t in tasks[:2]] == ["w2", "w3"]
    config = load_config(str(write_config(tmp_path, 4, True, rollout=Rollout(3, 1))))
    config = config.check_and_update()
    assert config.mode == "both" and config.algorithm.algorithm_type == "bapo"
    assert (config.synchronizer.sync_method.value, config.synchronizer.sync_interval) == (
        "checkpoint",
        3,
    )
    assert config.synchronizer.sync_offset == 1 and config.explorer.rollout_model.engine_num == 1
    queue = config.buffer.trainer_input.experience_buffer
    assert config.cluster.gpu_per_node == 3 and queue.storage_type == "queue"
    assert queue.path.startswith(f"{tmp_path}{os.sep}")  # its copy kept inside the run's folder


def test_mode_both_says_what_is_missing():
    assert problems(BOTH) == []
    assert problems({**BOTH, "syncs": 0}) == ["the explorer reloaded no trainer checkpoint"]
    assert problems({**BOTH, "steps": [], "clip_pairs": [], "trinity_exit": None}) == [
        "trainer steps logged: [] of 2",
        "trinity run exited None",
    ]


def test_an_out_path_with_yamls_special_characters_keeps_the_run_inside_it(tmp_path):
    """``" #"`` would start a comment in YAML text, ``": "`` a mapping, ``"?"`` a URL's query."""
    from scripts.harness.trinity_inputs import Rollout, fill_buffer, write_config
    from trinity.common.config import load_config

    out = tmp_path / "run #2: a?b%20c"
    out.mkdir()
    config = load_config(str(write_config(out, 1, True))).check_and_update()
    assert config.model.model_path == str(out / "model")
    assert config.checkpoint_root_dir == str(out / "checkpoints")
    fill_buffer(out / "config.yaml", 1)
    assert (out / "buffer.db").stat().st_size > 0
    both = yaml.safe_load(write_config(out, 1, True, rollout=Rollout(2, 1)).read_text())
    assert both["buffer"]["explorer_input"]["taskset"]["path"] == str(out / "tasks")
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # nothing written beside it


def test_the_short_link_goes_where_rays_sockets_fit_under_a_long_tmpdir(tmp_path, monkeypatch):
    from ray._private.utils import validate_socket_filepath

    long = tmp_path / ("t" * (120 - len(str(tmp_path)) - 1))
    long.mkdir()
    assert len(str(long)) == 120
    monkeypatch.setattr(tempfile, "tempdir", str(long))  # what gettempdir() read from TMPDIR
    link = link_dir(tmp_path / "ray")
    assert link.parent == Path("/tmp")  # where Ray's own /tmp/ray goes
    # Ray's longest socket path: the folder of one start (its time, the head's largest PID), then
    # plasma's socket
    start = f"session_{time.strftime('%Y-%m-%d_%H-%M-%S')}_000000_"
    start += Path("/proc/sys/kernel/pid_max").read_text().strip()
    validate_socket_filepath(str(link / "tmp" / start / "sockets" / "plasma_store"))
    with pytest.raises(OSError, match="cannot exceed 107 bytes"):  # the check holds under TMPDIR
        validate_socket_filepath(str(long / link.name / "tmp" / start / "sockets" / "plasma_store"))


def test_a_temp_dir_that_leaves_rays_sockets_no_room_is_refused_naming_it(tmp_path, monkeypatch):
    from scripts.harness import trinity_launch

    long = str(tmp_path / ("t" * 120))
    monkeypatch.setattr(tempfile, "tempdir", long)
    monkeypatch.setattr(os, "access", lambda path, mode: path != "/tmp")  # /tmp unwritable
    args = argparse.Namespace(out=tmp_path / "out")
    with pytest.raises(SystemExit, match=re.escape(f"temp dir {long} would exceed 107 bytes")):
        trinity_launch.launch(args, None, {}, {}, None, None)
    assert not args.out.exists()


def imports_of(path: Path) -> set:
    """The modules a file imports, at its top or inside a function, and the names it imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def test_no_module_of_scripts_imports_one_that_imports_it_back():
    files = {  # module name: file, a package named by its __init__.py
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): path
        for path in (REPO / "scripts").rglob("*.py")
    }
    graph = {name: imports_of(path) & files.keys() - {name} for name, path in files.items()}

    def reached(start: str) -> set:
        """Every module that ``start`` imports, directly or through others."""
        seen: set = set()
        todo = [start]
        while todo:
            new = graph[todo.pop()] - seen
            seen |= new
            todo += new
        return seen

    assert "scripts.trinity_both" in graph["scripts.trinity_run"]  # the graph sees imports
    assert [(a, b) for a in graph for b in graph[a] if a in reached(b)] == []
