"""Every launcher writes only into a folder it made, and a signal ends every process it started.

The folder rule (``scripts/harness/run_folder.py``) in-process, then through each launcher's
command line: a folder that holds anything is refused before any work, with one line, and is
left byte for byte as it was. ``trinity_run`` refuses a path that OmegaConf would resolve.

The signals (``scripts/harness/owned_run.py``): a stand-in launcher that runs sleeping torchrun
launches from a thread pool, as the study does, and ``make demo`` itself, Ctrl-C'd while its
ranks train. Nothing they started may run on, and each ends by its signal.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from scripts.harness import run_folder
from scripts.harness.launch import REPO
from scripts.harness.run_folder import LOCK, claim
from tests.test_trinity_run import Started, git_status, running, until

ENDED_WITHIN_S = 30
ENDED = f"end of every process it started within {ENDED_WITHIN_S} s of the signal"
STAMP = "20250102-030405"
LAUNCHERS = {  # each launcher's command line that writes a run folder
    "demo": ["scripts.experiment", "demo"],
    "study": ["scripts.experiment", "study"],
    "sensitivity": ["scripts.experiment", "sensitivity"],
    "trinity-run": ["scripts.trinity_run"],
    "trinity-run-both": ["scripts.trinity_run", "--mode", "both"],
}


def state(folder: Path) -> dict:
    """Every path under ``folder``, and the folder: its kind, bytes or link target, and mtime."""
    found = {}
    for path in [folder, *folder.rglob("*")]:
        info, what = os.lstat(path), tuple[object, ...]()
        if path.is_symlink():
            what = ("link", os.readlink(path))
        elif path.is_dir():
            what = ("folder", None)
        else:
            what = ("file", path.read_bytes())
        found[str(path)] = (*what, info.st_mtime_ns)
    return found


def refused(module_argv: list, out: Path) -> subprocess.CompletedProcess:
    """A launcher's command line given ``--out out``, expected to stop before any work."""
    cmd = [sys.executable, "-m", *module_argv, "--out", str(out)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_without_out_each_launch_gets_a_new_folder_and_latest_links_the_last(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs/ is under the current directory
    monkeypatch.setattr(time, "strftime", lambda fmt: STAMP)  # every launch in the same second
    first = claim(None, "demo")
    (first / "metrics.jsonl").write_text("a user's numbers\n")
    before = state(first)
    later = [claim(None, "demo") for _ in range(2)]
    assert [first, *later] == [
        tmp_path / "runs" / "demo" / n for n in (STAMP, f"{STAMP}-2", f"{STAMP}-3")
    ]
    assert state(first) == before
    assert all(list(folder.iterdir()) == [] for folder in later)  # made, nothing written
    latest = tmp_path / "runs" / "demo" / "latest"
    assert os.readlink(latest) == f"{STAMP}-3"  # relative: the runs folder may move
    names = sorted(p.name for p in latest.parent.iterdir())
    assert names == sorted([STAMP, f"{STAMP}-2", f"{STAMP}-3", "latest"])  # no temp link left


def test_a_latest_that_is_no_link_is_left_as_it_is(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo" / "latest").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "latest" / "notes.txt").write_text("mine")
    before = state(tmp_path / "runs" / "demo" / "latest")
    made = claim(None, "demo")
    assert made.parent == tmp_path / "runs" / "demo" and made.name != "latest"
    assert state(tmp_path / "runs" / "demo" / "latest") == before
    assert "latest is not a link: left as it is" in capsys.readouterr().err


def test_out_is_made_or_an_empty_folder_claimed_and_anything_else_refused_with_one_line(tmp_path):
    made = claim(tmp_path / "new" / "deeper", "demo")
    assert made == tmp_path / "new" / "deeper" and list(made.iterdir()) == []
    (tmp_path / "empty").mkdir()
    claimed = claim(tmp_path / "empty", "demo")
    assert (claimed / LOCK).read_text() == f"{os.getpid()}\n"
    (tmp_path / "file").write_text("kept")
    (tmp_path / "link").symlink_to(tmp_path / "new")  # to a folder that a launch made
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "held" / "inner").mkdir(parents=True)
    cases = {
        "empty": "is not empty",  # claimed above: a second launch on it is refused
        "new": "is not empty",  # a launch made it, and it holds its folder
        "file": "is not a folder (a file or a link)",
        "link": "is not a folder (a file or a link)",
        "dangling": "is not a folder (a file or a link)",
        "held": "is not empty",
    }
    before = state(tmp_path)
    for name, says in cases.items():
        with pytest.raises(SystemExit) as refusal:
            claim(tmp_path / name, "demo")
        assert str(refusal.value).startswith(f"{tmp_path / name} {says}; --out takes a new or")
        assert "\n" not in str(refusal.value)
    assert state(tmp_path) == before


def test_a_lock_link_in_out_is_never_followed_and_its_target_unchanged(tmp_path, monkeypatch):
    target = tmp_path / "elsewhere.txt"
    target.write_text("a user's file outside --out")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).symlink_to(target)
    before = state(tmp_path)
    with pytest.raises(SystemExit, match="is not empty"):
        claim(out, "demo")
    # the link put there after the launch found the folder empty: the claim does not follow it
    monkeypatch.setattr(run_folder, "holds_anything", lambda folder: False)
    with pytest.raises(SystemExit, match=f"claimed meanwhile \\({LOCK} is there\\)"):
        claim(out, "demo")
    assert state(tmp_path) == before


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_each_launcher_refuses_a_folder_holding_a_users_file_before_any_work(launcher, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_text("a user's results\n")
    os.utime(out / "results.csv", ns=(1, 1_000_000_000))
    before, status = state(tmp_path), git_status()
    done = refused(LAUNCHERS[launcher], out)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"{out} is not empty; --out takes a new or an empty folder, and nothing in this one "
        "is touched"
    ]
    assert state(tmp_path) == before and git_status() == status


@pytest.mark.parametrize("launcher", ["trinity-run", "trinity-run-both"])
def test_trinity_run_refuses_a_path_that_omegaconf_would_resolve(launcher, tmp_path):
    out = tmp_path / "a${oc.env:HOME}b"
    done = refused(LAUNCHERS[launcher], out)
    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"{out}: a path holding '${{' is refused, since Trinity's config reader (OmegaConf) "
        "would resolve it as an interpolation; name a folder without it"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing made, here or at the resolved path
    assert not (tmp_path / f"a{os.environ['HOME']}b").exists()


def holding(token: str) -> list:
    """The processes whose command line holds ``token``."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(token in part for part in proc.info["cmdline"] or []):
            found.append(proc)
    return running(found)


def send(started: Started, signum: int) -> float:
    """``signum`` as a terminal or ``kill`` sends it: SIGINT to the group, others to the process."""
    if signum == signal.SIGINT:
        os.killpg(started.proc.pid, signum)
    else:
        os.kill(started.proc.pid, signum)
    return time.monotonic()


# A launcher's stand-in that trains nothing: as the study does, a pool of 2 threads runs 4
# torchrun launches of one rank each, whose rank sleeps (its code holds argv[1], to find it by)
POOL = """
import sys
from concurrent.futures import ThreadPoolExecutor
from scripts.harness.launch import torchrun
from scripts.harness.owned_run import owned_run

sleep = ["-n", "1", "import time; time.sleep(300)  # " + sys.argv[1]]
with owned_run():
    with ThreadPoolExecutor(2) as pool:
        for launch in [pool.submit(torchrun, 1, "timeit", sleep, 600) for _ in range(4)]:
            launch.result()
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_ends_a_thread_pools_launches_and_starts_no_more(signum):
    token = f"bapo-test-{os.getpid()}-{signum}-{time.time_ns()}"
    started = Started([sys.executable, "-c", POOL, token])
    try:  # 2 torchrun launches and their ranks: the token is on their command lines, as on its own
        until(lambda: len(holding(token)) == 5 or started.proc.poll() is not None, 120, "2 ranks")
        assert started.proc.poll() is None, started.output()
        tree = started.tree()
        sent = send(started, signum)
        code = started.end(ENDED_WITHIN_S)
        until(lambda: not running(tree), sent + ENDED_WITHIN_S - time.monotonic(), ENDED)
        assert holding(token) == []  # the 2 launches queued behind never began (nor their torchrun)
    finally:
        started.end(0)
        for proc in holding(token):
            proc.kill()
    assert code == -signum, started.output()
    assert json.loads(started.lines[-1]) == {
        "interrupted": True,
        "signal": signal.Signals(signum).name,
    }


def test_ctrl_c_on_make_demo_ends_every_process_of_it_while_the_ranks_train(tmp_path):
    out = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    cmd = ["make", "-f", str(REPO / "Makefile"), "demo", f"DEMO_ARGS=--steps 500 --out {out}"]
    status, make = git_status(), Started(cmd, env=env)
    try:
        step = "[ppo_clip_higher] step 1/500 "
        until(lambda: make.printed(step) or make.proc.poll() is not None, 600, "a step")
        assert make.proc.poll() is None, make.output()
        tree = make.tree()
        assert len(tree) >= 4, tree  # the launcher, torchrun and its 2 ranks
        sent = send(make, signal.SIGINT)  # Ctrl-C: the terminal's foreground group
        code = make.end(ENDED_WITHIN_S)
        until(lambda: not running(tree), sent + ENDED_WITHIN_S - time.monotonic(), ENDED)
    finally:
        make.end(0)
    assert code == -signal.SIGINT, make.output()  # make died by it, after its child
    last = json.loads(make.lines[-1])  # the launcher's, as it handled the signal
    assert last == {"interrupted": True, "signal": "SIGINT"}, make.output()
    rows = (out / "ppo_clip_higher" / "metrics.jsonl").read_text().splitlines()
    assert 0 < len(rows) < 500 and git_status() == status  # it trained, and was cut short


def test_a_launch_given_the_folder_above_a_live_one_is_refused_and_the_live_one_finishes(tmp_path):
    live_out = tmp_path / "runs" / "inner"
    live = Started([sys.executable, "-m", *LAUNCHERS["demo"], "--steps", "12", "--out", live_out])
    try:
        step = "[ppo_clip_higher] step 1/12 "
        until(lambda: live.printed(step) or live.proc.poll() is not None, 600, "a step")
        assert live.proc.poll() is None, live.output()
        done = refused(LAUNCHERS["demo"], tmp_path / "runs")
        code = live.end(600)
    finally:
        live.end(0)
    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"{tmp_path / 'runs'} is not empty; --out takes a new or an empty folder, and nothing in "
        "this one is touched"
    ]
    assert code == 0, live.output()
    assert json.loads(live.lines[-1])["ranks_agree"] is True
    for variant in ("ppo_clip_higher", "bapo_paper"):
        rows = (live_out / variant / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == 12, variant  # every step of the live launch, after the refusal
