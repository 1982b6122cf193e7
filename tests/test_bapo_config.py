"""BAPO as a Trinity algorithm: registration, preset, defaults and the GSM8K example config.

Expected values come from the paper's Sec. 5.1 and the README's settings table. The example goes
through Trinity's own loader and validators, as far as `trinity run`'s path runs offline.
"""

import inspect
from pathlib import Path

import pytest
import yaml

from trinity.algorithm import ALGORITHM_TYPE, POLICY_LOSS_FN
from trinity.algorithm.policy_loss_fn.bapo_policy_loss import BAPOPolicyLossFn
from trinity.common.config import Config, load_config
from trinity.common.config_validator import (
    AlgorithmConfigValidator,
    BufferConfigValidator,
    validators,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "bapo_gsm8k" / "gsm8k.yaml"

# The paper, Sec. 5.1.
PAPER_SEC_5_1 = {
    "ratio_lower_start": 0.6,  # a-
    "ratio_lower_max": 0.9,  # b-
    "ratio_lower_step": 0.02,  # delta_2
    "ratio_upper_start": 1.2,  # a+
    "ratio_upper_max": 3.0,  # b+
    "ratio_upper_step": 0.05,  # delta_1
    "positive_contribution_target": 0.4,  # rho_0 as a share
    "search_order": "upper_first",  # Algorithm 1 order
}
# What the paper leaves open, as the README settles it: rho by Eq. 8 as printed,
# PPO's dual clip at 3.0 (authors' code and Trinity's PPO), verl's token-mean, and the search
# sums shared across data-parallel ranks.
PROJECT_CHOICES = {
    "contribution": "surrogate",
    "clip_ratio_c": 3.0,
    "loss_agg_mode": "token-mean",
    "sync_across_dp": True,
}
DEFAULTS = {**PAPER_SEC_5_1, **PROJECT_CHOICES}
# The preset: GRPO advantages, no critic, no KL, no entropy term.
PRESET = {
    "advantage_fn": "grpo",
    "policy_loss_fn": "bapo",
    "kl_loss_fn": "none",
    "kl_penalty_fn": "none",
    "entropy_loss_fn": "none",
}
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# BufferConfigValidator imports trinity.buffer, which imports sqlalchemy.ext.asyncio; with
# SQLAlchemy >= 2.1 that needs `greenlet`, which trinity-rft 0.6.0 does not declare. The full
# check runs it, skipped (with this reason) where greenlet is missing.
OFFLINE_VALIDATORS = [v for v in validators if not isinstance(v, BufferConfigValidator)]


@pytest.fixture
def job_dirs(tmp_path, monkeypatch):
    """Point the example's ${oc.env:...} settings at the test's own places."""
    monkeypatch.setenv("TRINITY_CHECKPOINT_ROOT_DIR", str(tmp_path / "checkpoints"))
    monkeypatch.delenv("TRINITY_MODEL_PATH", raising=False)
    monkeypatch.delenv("TRINITY_TASKSET_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def example() -> dict:
    """The example file as plain YAML, not through Trinity."""
    return yaml.safe_load(EXAMPLE.read_text())


def load_and_validate(path: Path, selected=None) -> Config:
    """Load a config file with Trinity's loader, then run the validators (default: offline)."""
    config = load_config(str(path))
    for validator in selected if selected is not None else OFFLINE_VALIDATORS:
        validator.validate(config)
    return config


def minimal(tmp_path: Path, **algorithm) -> Config:
    """A config file of `algorithm_type: bapo` and these algorithm fields, loaded and validated."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"algorithm": {"algorithm_type": "bapo", **algorithm}}))
    return load_and_validate(path, [AlgorithmConfigValidator()])


def built_loss(config) -> BAPOPolicyLossFn:
    """The policy loss the trainer would build from a resolved config."""
    algorithm = config.algorithm
    return POLICY_LOSS_FN.get(algorithm.policy_loss_fn)(**algorithm.policy_loss_fn_args)


def assert_preset(algorithm) -> None:
    """Assert the algorithm config carries the BAPO preset."""
    assert {key: getattr(algorithm, key) for key in PRESET} == PRESET


def test_bapo_is_registered_with_its_preset():
    assert POLICY_LOSS_FN.get("bapo") is BAPOPolicyLossFn
    algorithm = ALGORITHM_TYPE.get("bapo")
    assert algorithm is not None
    assert algorithm.use_critic is False
    assert algorithm.use_reference is False
    preset = algorithm.default_config()
    assert {key: preset[key] for key in PRESET} == PRESET


def test_default_args_and_constructor_defaults_are_the_papers():
    """default_args() and the constructor's defaults are both the paper's settings.

    Trinity fills in default_args() only when policy_loss_fn_args is absent; a partial dict
    (say, only sync_across_dp) gets the constructor's defaults for the rest, so the two must
    agree for a partial config to still mean the paper's settings.
    """
    assert BAPOPolicyLossFn.default_args() == DEFAULTS
    parameters = inspect.signature(BAPOPolicyLossFn.__init__).parameters
    skip = ("self", "backend")
    assert {name: p.default for name, p in parameters.items() if name not in skip} == DEFAULTS
    loss = BAPOPolicyLossFn(**BAPOPolicyLossFn.default_args())
    assert loss.sync_across_dp is True
    assert loss.clip_ratio_c == 3.0
    assert loss.loss_agg_mode == "token-mean"


def test_example_writes_the_papers_values():
    """The file itself, read as plain YAML: every argument spelled out, paper values.

    ``loss_agg_mode`` is written at the algorithm level and among the loss arguments, where
    Trinity 0.6.0 reads it for the loss.
    """
    assert example()["algorithm"]["policy_loss_fn_args"] == DEFAULTS
    assert example()["algorithm"]["loss_agg_mode"] == "token-mean"


def assert_resolves_to_bapo_with_the_written_args(config: Config) -> None:
    """Assert the example resolved to the BAPO preset and its written loss args, token-mean."""
    assert config.algorithm.algorithm_type == "bapo"
    assert_preset(config.algorithm)
    written = example()["algorithm"]["policy_loss_fn_args"]
    assert config.algorithm.policy_loss_fn_args == {**written, "loss_agg_mode": "token-mean"}
    assert config.algorithm.loss_agg_mode == "token-mean"


def test_example_resolves_to_bapo_and_builds_the_trainers_loss(job_dirs):
    """What the verl engine worker builds: BAPO alone, no KL loss, no entropy term."""
    from trinity.trainer.verl.losses import TrinityPolicyLoss

    config = load_and_validate(EXAMPLE)
    assert_resolves_to_bapo_with_the_written_args(config)
    assert config.checkpoint_job_dir.startswith(str(job_dirs / "checkpoints"))
    loss = built_loss(config)
    assert type(loss) is BAPOPolicyLossFn
    assert loss.sync_across_dp is True and loss.clip_ratio_c == 3.0
    engine_loss = TrinityPolicyLoss(config.algorithm)
    assert type(engine_loss.policy_loss_fn) is BAPOPolicyLossFn
    assert engine_loss.use_kl_loss is False
    assert engine_loss.calculate_entropy is False


def test_example_passes_the_full_check(job_dirs):
    """Config.check_and_update(), buffer validation included, where trinity.buffer imports."""
    pytest.importorskip("greenlet", reason="trinity.buffer needs greenlet with SQLAlchemy >= 2.1")
    config = load_config(str(EXAMPLE)).check_and_update()
    assert_resolves_to_bapo_with_the_written_args(config)
    assert config.buffer.explorer_input.tasksets[0].repeat_times == 8


# Where loss_agg_mode is written: (key dropped from the example's algorithm, sections written in)
PLACES = {
    "in-both-places": (None, ("algorithm", "policy_loss_fn_args")),  # as the example writes it
    "at-algorithm-level": (None, ("algorithm",)),  # beside written args that hold it too
    "only-among-loss-args": ("loss_agg_mode", ("policy_loss_fn_args",)),
    "at-algorithm-level-with-no-loss-args": ("policy_loss_fn_args", ("algorithm",)),  # defaults
}


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dropped, sections", PLACES.values(), ids=PLACES.keys())
def test_loss_agg_mode_reaches_bapo_and_the_trainer(job_dirs, dropped, sections, mode):
    written = example()
    algorithm = written["algorithm"]
    algorithm.pop(dropped, None)
    for section in sections:
        (algorithm if section == "algorithm" else algorithm[section])["loss_agg_mode"] = mode
    (job_dirs / "config.yaml").write_text(yaml.safe_dump(written))
    config = load_and_validate(job_dirs / "config.yaml")
    assert config.algorithm.loss_agg_mode == mode
    assert built_loss(config).loss_agg_mode == mode


def test_algorithm_type_alone_resolves_to_defaults(tmp_path):
    config = minimal(tmp_path)
    assert_preset(config.algorithm)
    assert config.algorithm.policy_loss_fn_args == BAPOPolicyLossFn.default_args() == DEFAULTS
    assert type(built_loss(config)) is BAPOPolicyLossFn


def test_sync_flag_reaches_the_loss(tmp_path):
    written = {"sync_across_dp": False}
    config = minimal(tmp_path, policy_loss_fn_args=written)
    assert config.algorithm.policy_loss_fn_args == {**written, "loss_agg_mode": "token-mean"}
    loss = built_loss(config)
    assert loss.sync_across_dp is False
    assert loss.clip_ratio_c == 3.0  # the rest keeps the defaults


def test_bad_search_argument_fails_when_the_loss_is_built(tmp_path):
    """A typo in the example's keys must not be silently ignored."""
    config = minimal(tmp_path, policy_loss_fn_args={"positive_contribution_traget": 0.5})
    with pytest.raises(TypeError):
        built_loss(config)


def load_example(name: str) -> Config:
    """One of the example's configs through Trinity's loader and its offline validators."""
    return load_and_validate(EXAMPLE.parent / f"{name}.yaml")


def test_single_gpu_example_colocates_a_small_model_on_one_gpu(job_dirs):
    config = load_example("gsm8k_colocate")
    assert_preset(config.algorithm)
    assert (config.mode, config.cluster.node_num, config.cluster.gpu_per_node) == ("colocate", 1, 1)
    assert config.model.model_path.endswith("Qwen2.5-0.5B-Instruct")  # at most 1B parameters
    assert config.synchronizer.sync_method.value == "memory"
    assert config.explorer.rollout_model.gpu_memory_utilization == 0.25
    assert config.explorer.rollout_model.engine_num == 1 and config.trainer.optimizer_offload
    assert built_loss(config).loss_agg_mode == config.algorithm.loss_agg_mode == "token-mean"


def test_off_policy_example_splits_explorer_and_trainer_over_one_queue(job_dirs):
    """Two processes, two GPUs each, one experience queue, weights every 10 steps."""
    explorer, trainer = load_example("async_explorer"), load_example("async_trainer")
    assert (explorer.mode, trainer.mode) == ("explore", "train")
    assert explorer.name == trainer.name and explorer.project == trainer.project
    queues = [c.buffer.trainer_input.experience_buffer for c in (explorer, trainer)]
    assert queues[0].name == queues[1].name and queues[0].path == queues[1].path
    assert queues[0].storage_type == "queue"
    for config in (explorer, trainer):
        assert_preset(config.algorithm)
        assert config.synchronizer.sync_method.value == "checkpoint"
        assert config.synchronizer.sync_interval == 10
    assert explorer.cluster.explorer_gpu_num == trainer.cluster.trainer_gpu_num == 2
    loss = built_loss(trainer)
    assert loss.sync_across_dp is True and loss.loss_agg_mode == trainer.algorithm.loss_agg_mode
