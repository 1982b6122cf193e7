"""`make pr`'s patches apply to the Trinity-RFT 0.6.0 sdist as stated, and their tests pass.

The interface and the config fix apply alone to a fresh sdist (from PyPI, cached in build/sdist/),
BAPO on top of the interface, the fourth on BAPO; touched files equal ours. The config fix's
test must fail on the released tree, and BAPO's and the fourth's when a claim they rest on is
undone, or they would prove nothing.
"""

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Iterator, Optional

import pytest

from scripts.harness.forked_pytest import Server

REPO = Path(__file__).resolve().parents[1]
SDIST = REPO / "build" / "sdist" / "trinity_rft-0.6.0.tar.gz"
SITE = Path(str(importlib.metadata.distribution("trinity-rft").locate_file("")))
PATCHES = REPO / "patches"
KEYS_TEST = "tests/algorithm/test_policy_loss_runtime_keys.py"
BAPO_TESTS = [
    "tests/algorithm/test_bapo_policy_loss.py",
    "tests/algorithm/test_bapo_data_parallel.py",
]
FIX_TEST = "tests/common/test_loss_agg_mode_config.py"
DOCS_ROWS = "bapo-0003-docs-list-bapo.patch"
UPDATE_TEST = "tests/algorithm/test_bapo_update_scope.py"
MODULE = "trinity/algorithm/policy_loss_fn/bapo_policy_loss.py"
# the module's search_scope: reversed in the BAPO pull request, applied in bapo-update-scope
MODULE_SPLIT = PATCHES / "pr" / "bapo-update-scope.module.patch"
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
        [
            "bapo-0001-register-bapo.patch",
            "bapo-0002-algorithm-validator-refuses-tinker-for-bapo.patch",
            DOCS_ROWS,
        ],
        {
            "trinity/algorithm/policy_loss_fn/bapo_policy_loss.py",
            "examples/bapo_gsm8k/gsm8k.yaml",
            "examples/bapo_gsm8k/README.md",
            *BAPO_TESTS,
        },
        "policy-loss-runtime-keys",
    ),
    "loss-agg-mode": (
        ["loss-agg-mode-0001-config-validates-policy-loss-args.patch"],
        {FIX_TEST},
        None,
    ),
    "bapo-update-scope": (
        [
            "update-scope-0001-optimizer-update-pass.patch",
            "update-scope-0002-validator-refuses-update-scope-where-the-pass-differs.patch",
        ],
        {UPDATE_TEST},
        "bapo",
    ),
}


# name -> the files of the pull requests it builds on that it changes (not through a part)
CHANGED_AGAIN = {"bapo-update-scope": {MODULE}}

# BAPO's rows in files the sdist does not ship: their hunks are written against the repository
REPOSITORY_ONLY = [
    "README_zh.md",
    "docs/sphinx_doc/source/main.md",
    "docs/sphinx_doc/source_zh/main.md",
]
SDIST_ONLY = [f"--exclude={rel}" for rel in REPOSITORY_ONLY]


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
        done = run("git", "apply", *args, *SDIST_ONLY, patch, cwd=tree)
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


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    """The process the runs of pytest in a tree fork from, torch and verl imported once."""
    started = Server(tmp_path_factory.mktemp("server"))
    yield started
    started.close()


def pytest_in(
    server: Server, tree: Path, files, path=(), *options: str
) -> subprocess.CompletedProcess:
    """Run test files with pytest against the tree's code (after ``path``, whose hook runs first).

    As `python -m pytest` with ``PYTHONPATH`` would, forked from ``server``, with a timeout.
    """
    env = {
        **os.environ,
        "GIT_CEILING_DIRECTORIES": str(tree.parent),
        "PYTHONPATH": os.pathsep.join([*map(str, path), str(tree)]),
    }
    hook = next((h for p in path if (h := Path(p) / "sitecustomize.py").exists()), None)
    args = ["-q", "-rfE", "-p", "no:cacheprovider", *options, *files]
    return server.pytest(tree, args, env, hook, timeout=600)


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
    """Every installed patch is in one pull request; the docs rows are the only extra part."""
    series = (PATCHES / "series").read_text().split()
    parts = [name for patches, _, _ in PULL_REQUESTS.values() for name in patches]
    assert sorted(set(parts) - set(series)) == [DOCS_ROWS]
    assert set(series) <= set(parts) and len(parts) == len(set(parts))
    assert touched_by([DOCS_ROWS]) == {"README.md", *REPOSITORY_ONLY}


# The row each table of supported algorithms gets, in its file's language: paper, example, code
ROW = re.compile(
    r"^\| BAPO \[\[(Paper|论文)\]\(https://arxiv\.org/pdf/2510\.18927\)\] \| "
    r"\[\[GSM8K (Example|示例)\]\(\S+/examples/bapo_gsm8k\)\] \| "
    r"\[\[(Code|代码)\]\(\S+/trinity/algorithm/policy_loss_fn/bapo_policy_loss\.py\)\] \| "
    r"`algorithm_type: bapo` +\|$"
)


def test_bapo_adds_one_row_after_sapos_to_each_table(written) -> None:
    """One line per file, after SAPO's, in the file's language; blob ids to merge three-way."""
    text = (written / "trinity-rft-bapo.patch").read_text()
    diffs = re.split(r"(?m)^(?=diff --git )", text)
    for rel in ["README.md", *REPOSITORY_ONLY]:
        (diff,) = [d for d in diffs if d.startswith(f"diff --git a/{rel} ")]
        assert re.search(r"^index [0-9a-f]{40}\.\.[0-9a-f]{40} 100644$", diff, re.M), rel
        body = diff.split("\n@@", 1)[1].splitlines()[1:]
        added = [n for n, line in enumerate(body) if line.startswith("+")]
        assert len(added) == 1 and not any(line.startswith("-") for line in body), rel
        row, above = body[added[0]][1:], body[added[0] - 1][1:]
        assert ROW.match(row) and above.startswith("| SAPO ["), (rel, row, above)
        chinese = "zh" in rel
        assert ("论文" in row, "论文" in above) == (chinese, chinese), rel


@pytest.mark.parametrize("name", sorted(PULL_REQUESTS))
def test_subjects_are_numbered_against_their_own_series(name) -> None:
    patches = PULL_REQUESTS[name][0]
    for index, part in enumerate(patches, start=1):
        first = (PATCHES / part).read_text().splitlines()[0]
        assert first.startswith(f"Subject: [PATCH {index}/{len(patches)}] "), (part, first)


def description(written: Path, name: str) -> str:
    """A pull request's commit message, as its patch carries it."""
    return (written / f"trinity-rft-{name}.patch").read_text().split("\n---\n", 1)[0]


def test_bapo_description_names_the_interface_it_builds_on(written) -> None:
    assert "policy loss: runtime keys" in description(written, "bapo")


# Trinity-RFT's pull-request template (.github/PULL_REQUEST_TEMPLATE.md): its four checklist items
TEMPLATE_ITEMS = [
    "Relevant checks and their results are described above",
    "Generated HTML is updated and previewed when tutorial Markdown changes",
    "Instructions and links match the example scripts and supported configurations",
    "Changes are ready for review",
]


@pytest.mark.parametrize("name", sorted(PULL_REQUESTS))
def test_descriptions_hold_the_template_and_speak_of_the_repository(written, name) -> None:
    """Each template item ticked, or marked not applicable with a reason; no word of the sdist."""
    text = description(written, name)
    for item in TEMPLATE_ITEMS:
        (line,) = [line for line in text.splitlines() if item in line]
        assert line.startswith("- [x] ") and (line.endswith(item) or "(" in line), line
    assert not re.search(r"sdist|source distribution|by hand", text), name


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
    assert set(touched) == touched_by(patches) | added | CHANGED_AGAIN.get(name, set())
    text = (written / f"trinity-rft-{name}.patch").read_text()
    created = set(re.findall(r"^diff --git a/\S+ b/(\S+)\nnew file mode", text, re.M))
    assert created == added and not created & UPSTREAM_ONLY


def test_git_am_takes_them_in_order_on_a_repository_of_the_release(
    written, tmp_path_factory
) -> None:
    """As a maintainer opens them: the interface, BAPO, the config fix, BAPO's pair per update.

    The release has no README_zh.md or docs/, so their rows are left out here.
    """
    tree = fresh_tree(tmp_path_factory)
    who = ["-c", "user.name=maintainer", "-c", "user.email=maintainer@example.com"]
    for args in (["init", "-q"], ["add", "-A"], [*who, "commit", "-qm", "v0.6.0"]):
        assert run("git", *args, cwd=tree).returncode == 0
    for name in ("policy-loss-runtime-keys", "bapo", "loss-agg-mode", "bapo-update-scope"):
        patch = written / f"trinity-rft-{name}.patch"
        done = run("git", *who, "am", "-3", "--keep-non-patch", *SDIST_ONLY, patch, cwd=tree)
        assert done.returncode == 0, (name, done.stdout, done.stderr)
    log = run("git", "log", "--format=%s", cwd=tree).stdout.splitlines()
    kinds = ["[Feature]", "[Fix]", "[Feature]", "[Feature]", "v0.6.0"]
    assert [line.split(" ", 1)[0] for line in log] == kinds


def with_the_rest_of_the_series(tree: Path, name: Optional[str], rel: str, tmp_path: Path) -> bytes:
    """The tree's file with the series' parts that other pull requests hold applied too."""
    chain: set[str] = set()
    while name:
        parts, _, base = PULL_REQUESTS[name]
        chain, name = chain | set(parts), base
    rest = [PATCHES / p for p in (PATCHES / "series").read_text().split() if p not in chain]
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_bytes((tree / rel).read_bytes())
    done = run("git", "apply", f"--include={rel}", *rest, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return (tmp_path / rel).read_bytes()


def repo_file(name: str, rel: str, tmp_path: Path) -> bytes:
    """The repository's file as pull request ``name`` holds it (BAPO's module: no search_scope)."""
    if (name, rel) != ("bapo", MODULE):
        return (REPO / rel).read_bytes()
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_bytes((REPO / rel).read_bytes())
    done = run("git", "apply", "-R", MODULE_SPLIT, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return (tmp_path / rel).read_bytes()


def test_every_touched_file_equals_ours(applied, tmp_path) -> None:
    """The installed file, where the rest of the series (another pull request's part) is added."""
    name, tree, touched = applied
    added = PULL_REQUESTS[name][1]
    for rel in set(touched) - set(REPOSITORY_ONLY):
        got = (tree / rel).read_bytes()
        if rel in added or rel in CHANGED_AGAIN.get(name, ()):
            assert got == repo_file(name, rel, tmp_path), f"{rel} differs from the repo's file"
        elif rel.startswith("trinity/"):
            ours = with_the_rest_of_the_series(tree, name, rel, tmp_path)
            assert ours == (SITE / rel).read_bytes(), f"{rel} differs from the installed file"


def test_own_tests_pass_against_the_patched_tree(applied, server) -> None:
    name, tree, _ = applied
    where = run(sys.executable, "-c", "import trinity; print(trinity.__file__)", cwd=tree)
    assert Path(where.stdout.strip()).is_relative_to(tree), where.stderr
    files = own_tests(name)
    count = sum((REPO / rel).read_text().count("\n    def test_") for rel in files)
    done = pytest_in(server, tree, files)
    assert done.returncode == 0 and f"{count} passed" in done.stdout, done.stdout[-3000:]


def test_config_fix_test_fails_on_the_released_tree_as_its_description_counts(
    written, tmp_path_factory, server
) -> None:
    """The description's "all N tests pass ... on the released tree, M of them fail"."""
    stated = re.search(
        r"all (\d+) tests pass.*?released tree, (\d+) of them fail",
        description(written, "loss-agg-mode"),
        re.S,
    )
    assert stated, "the description counts no tests"
    total, failing = map(int, stated.groups())
    assert (REPO / FIX_TEST).read_text().count("\n    def test_") == total
    tree = fresh_tree(tmp_path_factory)
    (tree / FIX_TEST).parent.mkdir(parents=True)
    (tree / FIX_TEST).write_bytes((REPO / FIX_TEST).read_bytes())
    done = pytest_in(server, tree, [FIX_TEST])
    summary = f"{failing} failed, {total - failing} passed"
    assert done.returncode == 1 and summary in done.stdout, done.stdout[-3000:]


def test_bapo_tests_pass_with_the_config_fix_too(written, tmp_path_factory, server) -> None:
    """The validator's BAPO check builds the trainer's loss under either loss_agg_mode rule."""
    tree = patched_tree("bapo", written, tmp_path_factory)
    done = run("git", "apply", written / "trinity-rft-loss-agg-mode.patch", cwd=tree)
    assert done.returncode == 0, done.stderr
    done = pytest_in(server, tree, own_tests("bapo"), (), "-k", "BAPOTinkerTest")
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:]


# What each of the BAPO pull request's claims rests on, undone in the patched tree, and a test
# of the pull request's own that must then fail.
UNION = "BAPODataParallelTest::test_every_rank_takes_the_pair_of_the_union"
POINTS = "BAPOPolicyLossTest::test_bapo_with_point_ranges_is_ppo"
ALGORITHM_1 = "BAPOPolicyLossTest::test_bapo_search_matches_a_literal_algorithm_one"
BREAKAGES = {
    "all_reduce_does_nothing": UNION,
    "trinity_policy_loss_passes_no_group": UNION,
    "metaclass_ignores_runtime_keys": UNION,
    "validator_skips_bapo": "test_the_tinker_trainer_is_refused_before_tinker_or_ray_starts",
    "clip_ratio_c_ignored": POINTS,
    "loss_agg_mode_ignored": POINTS,
    "sync_across_dp_ignored": "test_each_rank_takes_its_own_pair_without_sync_across_dp",
    "a_nan_walks_to_the_end": "test_a_nan_on_one_rank_keeps_the_start_pair_on_every_rank",
    "rho0_is_met_only_above_it": ALGORITHM_1,
    "all_reduce_over_world": "test_the_sums_are_reduced_over_the_group_passed_not_world",
    "trains_at_the_next_c_low": ALGORITHM_1,
}
# What the validator's Tinker refusal, Algorithm 1's stop, the all-reduce's group and the pair PPO
# trains at do, and what undoes them
VALIDATOR = "trinity/common/config_validator.py"
STOP = "not rho(*pair) < self.target"  # a NaN rho, or one equal to rho0, stops the walk
SUM = "dist.all_reduce(sums, op=dist.ReduceOp.SUM"  # the call's one all-reduce, over its group
CHECK_EDITS = {
    "validator_skips_bapo": (
        VALIDATOR,
        'config.algorithm.policy_loss_fn == "bapo" and tinker',
        "False",
    ),
    "a_nan_walks_to_the_end": (MODULE, STOP, "rho(*pair) >= self.target"),
    "rho0_is_met_only_above_it": (MODULE, STOP, "rho(*pair) > self.target"),
    "all_reduce_over_world": (MODULE, f"{SUM}, group=group)  # Eq. 8", f"{SUM})  # Eq. 8"),
    "trains_at_the_next_c_low": (MODULE, "1 - c[i]", "1 - c[min(i + 1, len(self.lower) - 1)]"),
}
# A hook run before the tests (and in the ranks they fork): all_reduce does nothing, or BAPO's
# constructor drops a user's setting for its default, with the module's file untouched
DEFAULT_HOOK = """from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
init = BAPOPolicyLossFn.__init__
def forced(self, *args, **kwargs):
    init(self, *args, **{{k: v for k, v in kwargs.items() if k != {!r}}})
BAPOPolicyLossFn.__init__ = forced
"""
IGNORED = ("clip_ratio_c", "loss_agg_mode", "sync_across_dp")
HOOKS = {f"{name}_ignored": DEFAULT_HOOK.format(name) for name in IGNORED}
NO_ALL_REDUCE = "import torch.distributed\ntorch.distributed.all_reduce = lambda *a, **k: None\n"
HOOKS["all_reduce_does_nothing"] = NO_ALL_REDUCE


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_bapo_tests_fail_when_a_claim_is_undone(
    breakage, written, tmp_path_factory, server
) -> None:
    tree, path = patched_tree("bapo", written, tmp_path_factory), []
    if breakage in HOOKS:  # in the test process, and the ranks it forks
        path.append(tmp_path_factory.mktemp("hook"))
        (path[0] / "sitecustomize.py").write_text(HOOKS[breakage])
    elif breakage == "trinity_policy_loss_passes_no_group":
        losses = tree / "trinity" / "trainer" / "verl" / "losses.py"
        text = losses.read_text()
        assert text.count("dp_group=dp_group") == 1
        losses.write_text(text.replace("dp_group=dp_group", "dp_group=None"))
    elif breakage in CHECK_EDITS:
        rel, old, new = CHECK_EDITS[breakage]
        text = (tree / rel).read_text()
        assert text.count(old) == 1
        (tree / rel).write_text(text.replace(old, new))
    else:  # the released metaclass, which reads no _runtime_keys
        rel = "trinity/algorithm/policy_loss_fn/policy_loss_fn.py"
        (tree / rel).write_bytes((fresh_tree(tmp_path_factory) / rel).read_bytes())
    test = BREAKAGES[breakage]  # run alone, so that no other test's setup is paid for
    done = pytest_in(server, tree, own_tests("bapo"), path, "-k", test.split("::")[-1])
    failed = re.findall(r"^(?:SUB)?(?:FAILED|ERROR)\b.*?(tests/\S+::\S+)", done.stdout, re.M)
    assert done.returncode == 1 and any(test in name for name in failed), done.stdout[-3000:]


# Writes each mode at the algorithm level of the example configs, then loads them through the
# tree's own loader and offline validators and builds the trainer's loss: (algorithm's, loss's).
EXAMPLE_MODES = """
import json, sys, yaml
from trinity.algorithm import POLICY_LOSS_FN
from trinity.common.config import load_config
from trinity.common.config_validator import BufferConfigValidator, validators

found = {}
for name in ("gsm8k",):
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
        found[f"{name}/{mode}"] = [config.algorithm.loss_agg_mode, loss.ppo_args["loss_agg_mode"]]
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
    assert len(found) == len(AGG_MODES)
    # with no loss argument written, the defaults hold the key: even 0.6.0 copies the mode
    assert all(modes == [key.split("/")[1]] * 2 for key, modes in found.items()), found


# What the fourth pull request's claims rest on, undone in its patched tree: (file, text, instead,
# a test of the pull request's own that must then fail)
WORKERS = "trinity/trainer/verl/workers.py"
EVERY_CALL = "test_every_call_of_the_update_takes_the_pair_of_its_union"
UPDATE_BREAKAGES = {
    "the_worker_does_not_route_the_updates": (
        WORKERS,
        "self.actor.train_batch = self.train_batch_in_update",
        "pass",
        EVERY_CALL,
    ),
    "the_hook_hands_over_no_pass": (
        WORKERS,
        "optimizer_update(data, partial(self._update_pass, data))",
        "optimizer_update(data, lambda: None)",
        EVERY_CALL,
    ),
    "bapo_does_not_call_the_pass": (
        MODULE,
        "            run_pass()\n",
        "            pass\n",
        EVERY_CALL,
    ),
    "bapo_keeps_the_pair_after_the_update": (
        MODULE,
        "            self._pass = self._fixed = None\n",
        "            self._pass = None\n",
        "test_the_pair_is_released_after_the_update",
    ),
    "micro_batch_runs_the_pass": (
        MODULE,
        "        if not self.per_update:\n            yield\n",
        "        if not self.per_update:\n            run_pass()\n            yield\n",
        "test_micro_batch_runs_no_pass",
    ),
}


@pytest.mark.parametrize("breakage", sorted(UPDATE_BREAKAGES))
def test_update_scope_tests_fail_when_the_hook_is_undone(
    breakage, written, tmp_path_factory, server
) -> None:
    """Undo a claim the fourth rests on: the test of that claim fails.

    The worker's routing, the pass it hands over, BAPO's call of it, the pair's release after the
    update, and micro_batch's running no pass.
    """
    tree = patched_tree("bapo-update-scope", written, tmp_path_factory)
    rel, old, new, test = UPDATE_BREAKAGES[breakage]
    text = (tree / rel).read_text()
    assert text.count(old) == 1
    (tree / rel).write_text(text.replace(old, new))
    done = pytest_in(server, tree, [UPDATE_TEST], (), "-k", test)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    assert done.returncode == 1 and any(test in name for name in failed), done.stdout[-3000:]


def literal_default_args(source: str) -> dict:
    """The dict ``default_args`` returns, read from the source as a literal (Trinity's style)."""
    (method,) = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.name == "default_args"
    ]
    returned = method.body[-1]
    assert isinstance(returned, ast.Return) and returned.value is not None
    return ast.literal_eval(returned.value)


def test_bapo_holds_the_module_without_search_scope_and_the_fourth_adds_it(
    written, tmp_path_factory
) -> None:
    """The BAPO module ships no argument whose hook it lacks; on top of it the fourth adds it."""
    bapo = (patched_tree("bapo", written, tmp_path_factory) / MODULE).read_text()
    assert "search_scope" not in bapo and "optimizer_update" not in bapo
    assert "search_scope" not in literal_default_args(bapo)
    ours = (REPO / MODULE).read_text()
    assert literal_default_args(ours)["search_scope"] == "micro_batch"
    tree = patched_tree("bapo-update-scope", written, tmp_path_factory)
    assert (tree / MODULE).read_text() == ours


def test_pull_request_tests_name_the_unit_of_every_timedelta():
    """``timedelta(60)`` is 60 days: a test's timeouts say their unit."""
    tests = [rel for _, files, _ in PULL_REQUESTS.values() for rel in files if "tests/" in rel]
    assert len(tests) >= 5
    for rel in tests:
        assert not re.search(r"timedelta\(\s*\d", (REPO / rel).read_text()), rel


def test_bapo_keeps_to_the_size_of_sapos_pull_request(written, tmp_path_factory) -> None:
    """At most 650 lines added, a module of at most 180, one example config, 40 description lines.

    The module guards only what Trinity can hand it: no numpy scalars, no private torch helper
    for non-tensor arguments, no bounds clipped to the ratio's dtype.
    """
    patch = (written / "trinity-rft-bapo.patch").read_text()
    inserted = re.search(r"(\d+) insertions\(\+\)", patch)
    assert inserted and int(inserted.group(1)) <= 650, inserted
    module = (patched_tree("bapo", written, tmp_path_factory) / MODULE).read_text()
    assert len(module.splitlines()) <= 180
    for guard in ("numpy", "_get_object_coll_device", "finfo"):
        assert guard not in module, guard
    assert len(re.findall(r"^\+\+\+ b/examples/\S+\.yaml$", patch, re.M)) == 1
    assert len((PATCHES / "pr" / "bapo.md").read_text().splitlines()) <= 40


def test_the_fourth_description_fits_50_lines_with_m2po_in_3():
    """The hook's second user, M2PO (#616), is told in one paragraph of at most 3 lines."""
    text = (PATCHES / "pr" / "bapo-update-scope.md").read_text()
    assert len(text.splitlines()) <= 50
    (m2po,) = [part for part in text.split("\n\n") if "M2PO" in part]
    assert len(m2po.splitlines()) <= 3 and "run_pass" in m2po and "m2po_mask" in m2po
