"""`make pr`'s two patches each apply alone to the Trinity-RFT 0.6.0 sdist, and their tests pass.

Each patch goes through `git apply --check` and `git apply` on its own fresh sdist (from PyPI,
cached under build/sdist/; skipped only where it cannot be had); the touched files must equal the
installed ones and ours, and its unit test must pass there. The config fix's test must also fail
on the released tree, or it would prove nothing.
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SDIST = REPO / "build" / "sdist" / "trinity_rft-0.6.0.tar.gz"
SITE = Path(str(importlib.metadata.distribution("trinity-rft").locate_file("")))
PATCHES = REPO / "patches"
# name -> (its parts in order, the files it adds, its unit test and how many tests that runs)
PULL_REQUESTS = {
    "bapo": (
        [
            "0001-policy-loss-runtime-keys.patch",
            "0002-engine-loss-forwards-dp-group.patch",
            "0003-legacy-actor-forwards-dp-group.patch",
            "0004-register-bapo.patch",
            "0005-readme-lists-bapo.patch",
        ],
        {
            "trinity/algorithm/policy_loss_fn/bapo_policy_loss.py",
            "trinity/algorithm/policy_loss_fn/bapo_search.py",
            "trinity/algorithm/policy_loss_fn/bapo_sync.py",
            "examples/bapo_gsm8k/gsm8k.yaml",
            "examples/bapo_gsm8k/gsm8k_colocate.yaml",
            "examples/bapo_gsm8k/async_explorer.yaml",
            "examples/bapo_gsm8k/async_trainer.yaml",
            "examples/bapo_gsm8k/README.md",
            "tests/algorithm/bapo_policy_loss_test.py",
            "tests/algorithm/bapo_data_parallel_test.py",
        },
        ("tests/algorithm", "bapo_*_test.py", 15),
    ),
    "loss-agg-mode": (
        ["loss-agg-mode-0001-config-copies-loss-agg-mode.patch"],
        {"tests/common/loss_agg_mode_config_test.py"},
        ("tests/common", "loss_agg_mode_config_test.py", 5),
    ),
}


def run(*cmd: str | Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Run a command with a timeout, so a hang fails the test rather than the suite."""
    full_env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(cwd.parent), **env}
    return subprocess.run(
        list(map(str, cmd)), cwd=cwd, env=full_env, capture_output=True, text=True, timeout=600
    )


def touched_by(names) -> set[str]:
    """Paths the given patches change."""
    text = "".join((PATCHES / name).read_text() for name in names)
    return set(re.findall(r"^\+\+\+ b/(\S+)", text, re.M))


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """The folder `make pr` wrote both patches into (downloading the sdist if need be)."""
    output = tmp_path_factory.mktemp("pr")
    done = run(sys.executable, "-m", "scripts.make_pr", output, cwd=REPO)
    if done.returncode != 0 and "cannot download" in done.stderr:
        pytest.skip(f"the trinity-rft 0.6.0 source distribution cannot be had:\n{done.stderr}")
    assert done.returncode == 0, done.stderr
    return output


def fresh_tree(tmp_path_factory) -> Path:
    """A newly unpacked sdist."""
    unpacked = tmp_path_factory.mktemp("sdist")
    with tarfile.open(SDIST) as archive:
        archive.extractall(unpacked, filter="data")
    return unpacked / "trinity_rft-0.6.0"


@pytest.fixture(scope="module", params=sorted(PULL_REQUESTS))
def applied(request, written, tmp_path_factory):
    """(name, tree, touched paths) for one pull request applied alone to its own sdist tree."""
    patch = written / f"trinity-rft-{request.param}.patch"
    tree = fresh_tree(tmp_path_factory)
    assert (tree / "trinity" / "__init__.py").is_file()
    check = run("git", "apply", "--check", patch, cwd=tree)
    assert check.returncode == 0, check.stderr
    done = run("git", "apply", patch, cwd=tree)
    assert done.returncode == 0, done.stderr
    touched = re.findall(r"^diff --git a/\S+ b/(\S+)$", patch.read_text(), re.M)
    return request.param, tree, touched


def unit_test(tree: Path, folder: str, pattern: str, path=()) -> subprocess.CompletedProcess:
    """Run the unittest files ``pattern`` against the tree's code (after ``path``)."""
    return run(
        sys.executable,
        *("-m", "unittest", "discover", "-v", "-s", folder, "-p", pattern),
        cwd=tree,
        PYTHONPATH=os.pathsep.join([*map(str, path), str(tree)]),
    )


# What a file of a pull request must not name: this repository's tooling and layout
OUR_TOOLING = re.compile(
    r"\bmake (setup|test|lint|pr|demo|bench|experiment|dp-check)\b|`make`"
    r"|\bpatches/|\bdocs/|\.venv\b|\bscripts/"
)


@pytest.mark.parametrize("name", sorted(PULL_REQUESTS))
def test_pull_requests_name_none_of_this_repositorys_tooling(written, name) -> None:
    text = (written / f"trinity-rft-{name}.patch").read_text()
    assert [line for line in text.splitlines() if OUR_TOOLING.search(line)] == []


def test_make_pr_writes_exactly_the_two_pull_requests(written) -> None:
    names = sorted(p.name for p in written.iterdir())
    assert names == sorted(f"trinity-rft-{name}.patch" for name in PULL_REQUESTS)


def test_the_pull_requests_hold_the_whole_installed_series() -> None:
    """Every installed patch is in one pull request; the README row is the only extra part."""
    series = (PATCHES / "series").read_text().split()
    parts = [name for patches, _, _ in PULL_REQUESTS.values() for name in patches]
    assert sorted(set(parts) - set(series)) == ["0005-readme-lists-bapo.patch"]
    assert set(series) <= set(parts) and len(parts) == len(set(parts))
    assert touched_by(["0005-readme-lists-bapo.patch"]) == {"README.md"}


@pytest.mark.parametrize("name", sorted(PULL_REQUESTS))
def test_subjects_are_numbered_against_their_own_series(name) -> None:
    patches = PULL_REQUESTS[name][0]
    for index, part in enumerate(patches, start=1):
        first = (PATCHES / part).read_text().splitlines()[0]
        assert first.startswith(f"Subject: [PATCH {index}/{len(patches)}] "), (part, first)


def test_each_patch_holds_its_parts_and_files(applied) -> None:
    name, _, touched = applied
    patches, added, _ = PULL_REQUESTS[name]
    assert set(touched) == touched_by(patches) | added


def test_every_touched_file_equals_ours(applied) -> None:
    name, tree, touched = applied
    added = PULL_REQUESTS[name][1]
    for rel in touched:
        got = (tree / rel).read_bytes()
        if rel.startswith("trinity/"):
            assert got == (SITE / rel).read_bytes(), f"{rel} differs from the installed file"
        if rel in added:
            assert got == (REPO / rel).read_bytes(), f"{rel} differs from the repo's file"


def test_unit_test_passes_against_the_patched_tree(applied) -> None:
    name, tree, _ = applied
    folder, pattern, count = PULL_REQUESTS[name][2]
    if name == "bapo":
        where = run(
            sys.executable,
            "-c",
            "import trinity.algorithm.policy_loss_fn.bapo_policy_loss as m; print(m.__file__)",
            cwd=tree,
            PYTHONPATH=str(tree),
        )
        assert Path(where.stdout.strip()).is_relative_to(tree), where.stderr
    done = unit_test(tree, folder, pattern)
    assert done.returncode == 0, done.stderr
    assert f"Ran {count} tests" in done.stderr and "OK" in done.stderr, done.stderr


def test_config_fix_test_fails_on_the_released_tree(written, tmp_path_factory) -> None:
    tree = fresh_tree(tmp_path_factory)
    rel = "tests/common/loss_agg_mode_config_test.py"
    (tree / rel).parent.mkdir(parents=True)
    (tree / rel).write_bytes((REPO / rel).read_bytes())
    done = unit_test(tree, "tests/common", "loss_agg_mode_config_test.py")
    assert done.returncode != 0 and "FAILED (failures=" in done.stderr, done.stderr


# What each of the BAPO pull request's claims rests on, undone in the patched tree, and a test
# of the pull request's own that must then fail.
BREAKAGES = {
    "all_reduce_does_nothing": "setUpClass (bapo_data_parallel_test.BAPODataParallelTest)",
    "trinity_policy_loss_passes_no_group": "test_trinity_policy_loss_hands_the_engine_group",
    "metaclass_ignores_runtime_keys": "test_dp_group_is_no_batch_field",
}


def bapo_tree(written: Path, tmp_path_factory) -> Path:
    """A fresh sdist with the BAPO pull request alone applied."""
    tree = fresh_tree(tmp_path_factory)
    assert run("git", "apply", written / "trinity-rft-bapo.patch", cwd=tree).returncode == 0
    return tree


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_bapo_tests_fail_when_a_claim_is_undone(breakage, written, tmp_path_factory) -> None:
    tree, path = bapo_tree(written, tmp_path_factory), []
    if breakage == "all_reduce_does_nothing":  # in every process, the spawned ranks included
        path.append(tmp_path_factory.mktemp("hook"))
        hook = "import torch.distributed\ntorch.distributed.all_reduce = lambda *a, **k: None\n"
        (path[0] / "sitecustomize.py").write_text(hook)
    elif breakage == "trinity_policy_loss_passes_no_group":
        losses = tree / "trinity" / "trainer" / "verl" / "losses.py"
        text = losses.read_text()
        assert text.count("dp_group=dp_group") == 1
        losses.write_text(text.replace("dp_group=dp_group", "dp_group=None"))
    else:  # the released metaclass, which reads no _runtime_keys
        rel = "trinity/algorithm/policy_loss_fn/policy_loss_fn.py"
        (tree / rel).write_bytes((fresh_tree(tmp_path_factory) / rel).read_bytes())
    done = unit_test(tree, "tests/algorithm", "bapo_*_test.py", path)
    failed = re.findall(r"^(?:FAIL|ERROR): (.+)$", done.stderr, re.M)
    assert done.returncode != 0 and any(BREAKAGES[breakage] in name for name in failed), failed


# Writes each mode where the example configs write it, then loads them through the tree's own
# loader and offline validators and builds the trainer's loss: (algorithm's, loss's) modes.
EXAMPLE_MODES = """
import json, sys, yaml
from trinity.algorithm import POLICY_LOSS_FN
from trinity.common.config import load_config
from trinity.common.config_validator import BufferConfigValidator, validators

found = {}
for name in ("gsm8k", "gsm8k_colocate", "async_trainer"):
    written = yaml.safe_load(open(f"examples/bapo_gsm8k/{name}.yaml"))
    assert "loss_agg_mode" in written["algorithm"], name  # the example writes it in both places
    assert "loss_agg_mode" in written["algorithm"]["policy_loss_fn_args"], name
    for mode in sys.argv[1:]:
        written["algorithm"]["loss_agg_mode"] = mode
        written["algorithm"]["policy_loss_fn_args"]["loss_agg_mode"] = mode
        yaml.safe_dump(written, open("config.yaml", "w"))
        config = load_config("config.yaml")
        for validator in validators:
            if not isinstance(validator, BufferConfigValidator):
                validator.validate(config)
        args = config.algorithm.policy_loss_fn_args
        loss = POLICY_LOSS_FN.get(config.algorithm.policy_loss_fn)(**args)
        found[f"{name}/{mode}"] = [config.algorithm.loss_agg_mode, loss.loss_agg_mode]
print(json.dumps(found))
"""
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def test_examples_reach_the_loss_with_their_mode_without_the_config_fix(
    written, tmp_path_factory
) -> None:
    """On 0.6.0 with the BAPO PR alone, each mode written as the examples write it is BAPO's."""
    tree = bapo_tree(written, tmp_path_factory)
    checkpoints = str(tmp_path_factory.mktemp("checkpoints"))
    done = run(
        sys.executable,
        *("-c", EXAMPLE_MODES, *AGG_MODES),
        cwd=tree,
        PYTHONPATH=str(tree),
        TRINITY_CHECKPOINT_ROOT_DIR=checkpoints,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == 3 * len(AGG_MODES)
    assert all(modes == [key.split("/")[1]] * 2 for key, modes in found.items()), found
