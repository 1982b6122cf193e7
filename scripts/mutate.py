"""`make mutate`: mutation testing of what the pull requests add, against their own tests.

For each pull request of ``make pr``, a git repository under build/mutate/ holds the trinity-rft
0.6.0 source distribution with the pull requests it builds on applied (branch ``base``), then
itself. cosmic-ray mutates the Python files it changes under trinity/, and cosmic-ray's git
filter keeps the mutations on the lines it adds or changes. Each mutant runs the pull request's
own test files (``pytest -x``, a timeout each) in one of a worker copy of the tree per core,
forked from one server that imported torch and verl once (scripts/harness/forked_pytest.py).
The report lists every survivor: one that ``patches/pr/equivalent-mutants.toml`` names (reviewed:
no test can tell it from the code, for the reason given there) is equivalent, any other is
unexplained. The run exits 1 while one is unexplained, or while that file names a mutant that no
longer survives. Run: make mutate (or python -m scripts.mutate [PULL_REQUEST ...])
"""

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from contextlib import ExitStack
from importlib.metadata import version
from pathlib import Path
from typing import Dict, List

from scripts import make_pr
from scripts.harness.forked_pytest import Server

WORK = make_pr.REPO / "build" / "mutate"
EQUIVALENT = make_pr.PATCHES / "pr" / "equivalent-mutants.toml"
BIN = Path(sys.executable).parent  # cosmic-ray's commands, installed beside this Python
CLIENT = make_pr.REPO / "scripts" / "harness" / "forked_pytest.py"
TIMEOUT_S = 120  # one mutant's test run; past it the mutant counts as killed
# The runs load no plugin of the environment's, which would double their time; no bytecode is
# written, which a mutant written within the second of the last could be taken for.
TEST_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def tree(pr: make_pr.PullRequest, patches: Dict[str, str], into: Path) -> Path:
    """The sdist as a git repository: branch ``base`` holds the pull requests ``pr`` builds on."""
    chain = [pr]
    while chain[0].base:
        chain.insert(0, chain[0].base)  # type: ignore[arg-type]
    root = make_pr.unpack(into)
    make_pr.git(root, "init", "-q")
    for step in [None, *chain]:
        if step is pr:
            make_pr.git(root, "branch", "base")
        if step is not None:  # without the files the sdist leaves out (README_zh.md, docs/)
            skip = [f"--exclude={rel}" for rel in make_pr.repository_only(root, step)]
            make_pr.git(root, "apply", *skip, "-", stdin=patches[step.name])
        make_pr.git(root, "add", "-A")
        make_pr.git(root, *make_pr.AUTHOR, "commit", "-q", "-m", step.name if step else "0.6.0")
    return root


def test_command(listen: Path, pr: make_pr.PullRequest) -> List[str]:
    """``pytest -x`` on the pull request's own test files, in the cwd, run by the server."""
    tests = [rel for rel in pr.files if rel.startswith("tests/") and rel.endswith(".py")]
    client = [sys.executable, str(CLIENT), "client", str(listen), str(TIMEOUT_S), "--"]
    return [*client, "-x", "-q", "-p", "no:cacheprovider", *tests]


def config(root: Path, files: List[str], command: List[str], ports: List[int]) -> Path:
    """cosmic-ray's configuration: the files, the test command, the workers, the git filter."""
    urls = [f"http://localhost:{port}" for port in ports]
    (root / "cosmic-ray.toml").write_text(
        f"[cosmic-ray]\nmodule-path = {json.dumps(files)}\ntimeout = {TIMEOUT_S + 30}\n"
        f"excluded-modules = []\ntest-command = {json.dumps(shlex.join(command))}\n"
        f'[cosmic-ray.distributor]\nname = "http"\n'
        f"[cosmic-ray.distributor.http]\nworker-urls = {json.dumps(urls)}\n"
        f'[cosmic-ray.filters.git-filter]\nbranch = "base"\n'
    )
    return root / "cosmic-ray.toml"


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def wait_for(port: int, timeout_s: float = 120) -> None:
    """Return once something listens on ``port``; raise TimeoutError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("localhost", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"no cosmic-ray worker listens on port {port}")


def mutate_and_test(pr: make_pr.PullRequest, root: Path, listen: Path) -> List[list]:
    """Mutate the pull request's lines in ``root`` and test each mutant: cosmic-ray's records."""
    files = make_pr.git(root, "diff", "--name-only", "base", "--", "trinity/*.py").split()
    command, env = test_command(listen, pr), {**os.environ, **TEST_ENV}
    unmutated = subprocess.run(
        command, cwd=root, env={**env, "PYTHONPATH": str(root)}, capture_output=True, text=True
    )
    if unmutated.returncode != 0:
        raise RuntimeError(f"{pr.name}'s tests fail unmutated:\n{unmutated.stdout[-3000:]}")
    ports = [free_port() for _ in range(os.cpu_count() or 1)]
    settings, records = config(root, files, command, ports), root / "mutants.sqlite"
    cosmic = [str(BIN / "cosmic-ray")]
    subprocess.run([*cosmic, "init", settings, records], cwd=root, check=True)
    subprocess.run(
        [str(BIN / "cr-filter-git"), "--config", settings, records], cwd=root, check=True
    )
    with ExitStack() as stack:
        for k, port in enumerate(ports):
            worker = root.parent / f"worker{k}"
            make_pr.git(root.parent, "clone", "-q", str(root), str(worker))
            process = subprocess.Popen(
                [*cosmic, "http-worker", "--port", str(port)],
                cwd=worker,
                env={**env, "PYTHONPATH": str(worker)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            stack.callback(process.wait, 60)
            stack.callback(process.terminate)
            wait_for(port)
        subprocess.run([*cosmic, "exec", settings, records], cwd=root, check=True)
    dump = subprocess.run([*cosmic, "dump", records], cwd=root, check=True, capture_output=True)
    return [json.loads(line) for line in dump.stdout.splitlines()]


def mutants(name: str, records: List[list]) -> List[dict]:
    """Each tested mutant (the git filter skipped the others): where, what, and its outcome."""
    found = []
    for item, result in records:
        if result is None or result["worker_outcome"] == "skipped":
            continue
        diff = result["diff"].splitlines()
        old = " / ".join(line[1:].strip() for line in diff if line[:1] == "-" and line[:3] != "---")
        new = " / ".join(line[1:].strip() for line in diff if line[:1] == "+" and line[:3] != "+++")
        mutation = item["mutations"][0]
        outcome = result["test_outcome"] if result["worker_outcome"] == "normal" else "error"
        found.append(
            dict(pr=name, file=mutation["module_path"], line=mutation["start_pos"][0], old=old)
            | dict(new=new, operator=mutation["operator_name"].split("/")[-1], outcome=outcome)
        )
    return found


def cpu() -> str:
    """The CPU's model name, as lscpu gives it."""
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if "Model name" in line), "?")


def report(found: List[dict], minutes: float) -> int:
    """Print the figures and every survivor, equivalent or not; 1 if any is unexplained."""
    listed = tomllib.loads(EQUIVALENT.read_text())["mutant"]
    why = {(e["pr"], e["file"], e["line"], e["mutant"]): e["why"] for e in listed}
    survivors = [m for m in found if m["outcome"] != "killed"]
    keys = {(m["pr"], m["file"], m["old"], m["new"]) for m in survivors}
    unexplained = [m for m in survivors if (m["pr"], m["file"], m["old"], m["new"]) not in why]
    stale = [key for key in why if key[0] in {m["pr"] for m in found} and key not in keys]
    print(f"# make mutate: cosmic-ray {version('cosmic-ray')}, {os.cpu_count()} workers, {cpu()}")
    for name in dict.fromkeys(m["pr"] for m in found):
        tested = [m for m in found if m["pr"] == name]
        killed = sum(m["outcome"] == "killed" for m in tested)
        print(f"## {name}: {len(tested)} mutants, {killed} killed, {len(tested) - killed} survived")
        for m in (m for m in survivors if m["pr"] == name):
            reason = why.get((m["pr"], m["file"], m["old"], m["new"]), "UNEXPLAINED")
            print(f"   {m['file']}:{m['line']} {m['operator']} ({m['outcome']})")
            print(f"      `{m['old']}` -> `{m['new']}`\n      {reason}")
    for key in stale:
        print(f"   listed as equivalent but not a survivor: {key}")
    equivalent = len(survivors) - len(unexplained)
    print(f"## {len(found)} mutants, {len(found) - len(survivors)} killed, {equivalent} equivalent")
    print(f"{len(unexplained)} unexplained survivors, {minutes:.1f} min")
    return 1 if unexplained or stale else 0


def main(names: List[str]) -> int:
    """Test the mutants of the named pull requests (all four by default); print the report."""
    prs = {pr.name: pr for pr in make_pr.pull_requests()}
    if not set(names) <= set(prs):
        raise SystemExit(f"pull requests: {', '.join(prs)}")
    start = time.monotonic()
    patches = {name: make_pr.format_patch(pr) for name, pr in prs.items()}
    shutil.rmtree(WORK, ignore_errors=True)
    found: List[dict] = []
    with tempfile.TemporaryDirectory(prefix="mutate-") as scratch:
        listen = Path(scratch) / "pytest.sock"
        server = Server(Path(scratch), listen)
        try:
            while not listen.exists():
                assert server.process.poll() is None, "the pytest server stopped"
                time.sleep(0.2)
            for name in names or prs:
                records = mutate_and_test(prs[name], tree(prs[name], patches, WORK / name), listen)
                found += mutants(name, records)
        finally:
            server.close()
    return report(found, (time.monotonic() - start) / 60)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
