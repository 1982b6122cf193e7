"""`make pr`'s patches apply to the Trinity-RFT 0.6.0 sdist as stated, and their tests pass.

The interface and the config fix apply alone to a fresh sdist (from PyPI, cached in build/sdist/),
BAPO on top of the interface; touched files equal ours. The config fix's test must fail on the
released tree, and BAPO's when a claim they rest on is undone, or they would prove nothing.
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
KEYS_TEST = "tests/algorithm/policy_loss_runtime_keys_test.py"
BAPO_TESTS = [
    "tests/algorithm/test_bapo_policy_loss.py",
    "tests/algorithm/test_bapo_data_parallel.py",
]
FIX_TEST = "tests/common/loss_agg_mode_config_test.py"
UPDATE_TEST = "tests/algorithm/test_bapo_update_scope.py"
# name -> (its parts in order, the files it adds, the pull request it applies on top of)
PULL_REQUESTS = {
    "policy-loss-runtime-keys": (
        [
            "runtime-keys-0001-policy-loss-runtime-keys.patch",
            "runtime-keys-0002-engine-loss-forwards-dp-group.patch",
        ],
        {KEYS_TEST},
        None,
    ),
    "bapo": (
        ["bapo-0001-register-bapo.patch", "bapo-0002-readme-lists-bapo.patch"],
        {
            "trinity/algorithm/policy_loss_fn/bapo_policy_loss.py",
            "examples/bapo_gsm8k/gsm8k.yaml",
            "examples/bapo_gsm8k/gsm8k_colocate.yaml",
            "examples/bapo_gsm8k/README.md",
            *BAPO_TESTS,
        },
        "policy-loss-runtime-keys",
    ),
    "loss-agg-mode": (["loss-agg-mode-0001-config-copies-loss-agg-mode.patch"], {FIX_TEST}, None),
    "bapo-update-scope": (
        [
            "update-scope-0001-optimizer-update-pass.patch",
            "update-scope-0002-bapo-refuses-update-scope-on-legacy.patch",
        ],
        {UPDATE_TEST},
        "bapo",
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
    """The folder `make pr` wrote the patches into (downloading the sdist if need be)."""
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


def patched_tree(name: str, written: Path, tmp_path_factory) -> Path:
    """A fresh sdist with the pull request applied after the one it builds on, each checked."""
    base = PULL_REQUESTS[name][2]
    tree = patched_tree(base, written, tmp_path_factory) if base else fresh_tree(tmp_path_factory)
    patch = written / f"trinity-rft-{name}.patch"
    for args in (["--check"], []):
        done = run("git", "apply", *args, patch, cwd=tree)
        assert done.returncode == 0, (name, done.stderr)
    return tree


@pytest.fixture(scope="module", params=sorted(PULL_REQUESTS))
def applied(request, written, tmp_path_factory):
    """(name, tree, paths its patch touches) for one pull request applied as stated."""
    tree = patched_tree(request.param, written, tmp_path_factory)
    text = (written / f"trinity-rft-{request.param}.patch").read_text()
    return request.param, tree, re.findall(r"^diff --git a/\S+ b/(\S+)$", text, re.M)


def own_tests(name: str) -> list[str]:
    """The test files a pull request adds."""
    return sorted(rel for rel in PULL_REQUESTS[name][1] if rel.startswith("tests/"))


def pytest_in(tree: Path, files, path=(), *options: str) -> subprocess.CompletedProcess:
    """Run test files with pytest against the tree's code (after ``path``)."""
    return run(
        sys.executable,
        *("-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *options, *files),
        cwd=tree,
        PYTHONPATH=os.pathsep.join([*map(str, path), str(tree)]),
    )


# What a file of a pull request must not name: this repository's tooling and layout
OUR_TOOLING = re.compile(
    r"\bmake (setup|test|lint|pr|demo|bench|experiment|dp-check)\b|`make`"
    r"|\bpatches/|\bdocs/(?!sphinx_doc/)|\.venv\b|\bscripts/"
)


@pytest.mark.parametrize("name", sorted(PULL_REQUESTS))
def test_pull_requests_name_none_of_this_repositorys_tooling(written, name) -> None:
    text = (written / f"trinity-rft-{name}.patch").read_text()
    assert [line for line in text.splitlines() if OUR_TOOLING.search(line)] == []


def test_make_pr_writes_exactly_its_pull_requests(written) -> None:
    names = sorted(p.name for p in written.iterdir())
    assert names == sorted(f"trinity-rft-{name}.patch" for name in PULL_REQUESTS)


def test_the_pull_requests_hold_the_whole_installed_series() -> None:
    """Every installed patch is in one pull request; the README row is the only extra part."""
    series = (PATCHES / "series").read_text().split()
    parts = [name for patches, _, _ in PULL_REQUESTS.values() for name in patches]
    assert sorted(set(parts) - set(series)) == ["bapo-0002-readme-lists-bapo.patch"]
    assert set(series) <= set(parts) and len(parts) == len(set(parts))
    assert touched_by(["bapo-0002-readme-lists-bapo.patch"]) == {"README.md"}


@pytest.mark.parametrize("name", sorted(PULL_REQUESTS))
def test_subjects_are_numbered_against_their_own_series(name) -> None:
    patches = PULL_REQUESTS[name][0]
    for index, part in enumerate(patches, start=1):
        first = (PATCHES / part).read_text().splitlines()[0]
        assert first.startswith(f"Subject: [PATCH {index}/{len(patches)}] "), (part, first)


def test_bapo_description_names_the_interface_it_builds_on(written) -> None:
    description = (written / "trinity-rft-bapo.patch").read_text().split("\ndiff --git", 1)[0]
    assert "policy loss: runtime keys" in description


# Files the repository holds though the sdist does not ship them (names near ours)
UPSTREAM_ONLY = {
    "tests/algorithm/policy_loss_test.py",
    "tests/common/config_test.py",
    "README_zh.md",
    "docs/sphinx_doc/source/main.md",
    "docs/sphinx_doc/source_zh/main.md",
}


def test_each_patch_holds_its_parts_and_files(applied, written) -> None:
    """It changes its parts' files and creates its own, none of which the repository holds."""
    name, _, touched = applied
    patches, added, _ = PULL_REQUESTS[name]
    assert set(touched) == touched_by(patches) | added
    text = (written / f"trinity-rft-{name}.patch").read_text()
    created = set(re.findall(r"^diff --git a/\S+ b/(\S+)\nnew file mode", text, re.M))
    assert created == added and not created & UPSTREAM_ONLY


def test_git_am_takes_them_in_order_on_a_repository_of_the_release(
    written, tmp_path_factory
) -> None:
    """As a maintainer opens them: the interface, BAPO, the config fix, BAPO's pair per update."""
    tree = fresh_tree(tmp_path_factory)
    who = ["-c", "user.name=maintainer", "-c", "user.email=maintainer@example.com"]
    for args in (["init", "-q"], ["add", "-A"], [*who, "commit", "-qm", "v0.6.0"]):
        assert run("git", *args, cwd=tree).returncode == 0
    for name in ("policy-loss-runtime-keys", "bapo", "loss-agg-mode", "bapo-update-scope"):
        patch = written / f"trinity-rft-{name}.patch"
        done = run("git", *who, "am", "-3", "--keep-non-patch", patch, cwd=tree)
        assert done.returncode == 0, (name, done.stdout, done.stderr)
    log = run("git", "log", "--format=%s", cwd=tree).stdout.splitlines()
    kinds = ["[Feature]", "[Fix]", "[Feature]", "[Feature]", "v0.6.0"]
    assert [line.split(" ", 1)[0] for line in log] == kinds


def touched_later(name: str) -> set[str]:
    """Paths that a pull request built on ``name`` changes again: checked in that one's tree."""
    later = [other for other, (_, _, base) in PULL_REQUESTS.items() if base == name]
    return set().union(*(touched_by(PULL_REQUESTS[n][0]) | touched_later(n) for n in later))


def test_every_touched_file_equals_ours(applied) -> None:
    name, tree, touched = applied
    added = PULL_REQUESTS[name][1]
    for rel in touched:
        got = (tree / rel).read_bytes()
        if rel.startswith("trinity/") and rel not in touched_later(name):
            assert got == (SITE / rel).read_bytes(), f"{rel} differs from the installed file"
        if rel in added:
            assert got == (REPO / rel).read_bytes(), f"{rel} differs from the repo's file"


def test_own_tests_pass_against_the_patched_tree(applied) -> None:
    name, tree, _ = applied
    where = run(sys.executable, "-c", "import trinity; print(trinity.__file__)", cwd=tree)
    assert Path(where.stdout.strip()).is_relative_to(tree), where.stderr
    files = own_tests(name)
    count = sum((REPO / rel).read_text().count("\n    def test_") for rel in files)
    done = pytest_in(tree, files)
    assert done.returncode == 0 and f"{count} passed" in done.stdout, done.stdout[-3000:]


def test_config_fix_test_fails_on_the_released_tree(written, tmp_path_factory) -> None:
    tree = fresh_tree(tmp_path_factory)
    (tree / FIX_TEST).parent.mkdir(parents=True)
    (tree / FIX_TEST).write_bytes((REPO / FIX_TEST).read_bytes())
    done = pytest_in(tree, [FIX_TEST])
    assert done.returncode == 1 and "FAILED" in done.stdout, done.stdout[-3000:]


# What each of the BAPO pull request's claims rests on, undone in the patched tree, and a test
# of the pull request's own that must then fail.
BREAKAGES = {
    "all_reduce_does_nothing": "BAPODataParallelTest::test_every_rank_takes_the_pair_of_the_union",
    "trinity_policy_loss_passes_no_group": (
        "test_through_trinity_policy_loss_every_rank_takes_the_pair_of_the_union"
    ),
    "metaclass_ignores_runtime_keys": "BAPORuntimeKeyTest::test_dp_group_is_no_batch_field",
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_bapo_tests_fail_when_a_claim_is_undone(breakage, written, tmp_path_factory) -> None:
    tree, path = patched_tree("bapo", written, tmp_path_factory), []
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
    test = BREAKAGES[breakage]  # run alone, so that no other test's setup is paid for
    done = pytest_in(tree, own_tests("bapo"), path, "-k", test.split("::")[-1])
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    assert done.returncode == 1 and any(test in name for name in failed), done.stdout[-3000:]


# Writes each mode at the algorithm level of the example configs, then loads them through the
# tree's own loader and offline validators and builds the trainer's loss: (algorithm's, loss's).
EXAMPLE_MODES = """
import json, sys, yaml
from trinity.algorithm import POLICY_LOSS_FN
from trinity.common.config import load_config
from trinity.common.config_validator import BufferConfigValidator, validators

found = {}
for name in ("gsm8k", "gsm8k_colocate"):
    written = yaml.safe_load(open(f"examples/bapo_gsm8k/{name}.yaml"))
    assert "policy_loss_fn_args" not in written["algorithm"], name  # the defaults are the paper's
    for mode in sys.argv[1:]:
        written["algorithm"]["loss_agg_mode"] = mode
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


@pytest.mark.parametrize("base", ["bapo", "loss-agg-mode"])
def test_examples_reach_the_loss_with_the_algorithm_mode(base, written, tmp_path_factory) -> None:
    """A mode written at the algorithm level only is BAPO's, with and without the config fix."""
    tree = patched_tree("bapo", written, tmp_path_factory)
    if base == "loss-agg-mode":
        done = run("git", "apply", written / "trinity-rft-loss-agg-mode.patch", cwd=tree)
        assert done.returncode == 0, done.stderr
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
    assert len(found) == 2 * len(AGG_MODES)
    # with no loss argument written, the defaults hold the key: even 0.6.0 copies the mode
    assert all(modes == [key.split("/")[1]] * 2 for key, modes in found.items()), found


def test_update_scope_tests_fail_when_the_pass_is_skipped(written, tmp_path_factory) -> None:
    """With the hook's pass taken out of ``optimizer_update``, the pull request's test fails."""
    tree = patched_tree("bapo-update-scope", written, tmp_path_factory)
    losses = tree / "trinity" / "trainer" / "verl" / "losses.py"
    text, the_pass = losses.read_text(), "engine.infer_batch(data, loss_function=self)"
    assert text.count(the_pass) == 1
    losses.write_text(text.replace(the_pass, "pass"))
    test = "test_every_call_of_the_update_takes_the_pair_of_its_union"
    done = pytest_in(tree, [UPDATE_TEST], (), "-k", test)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    assert done.returncode == 1 and any(test in name for name in failed), done.stdout[-3000:]
