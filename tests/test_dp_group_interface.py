"""The `dp_group` policy-loss interface (patches 0001 and 0002).

verl 0.8's engine calls `loss_fn(model_output, data, dp_group=...)`; the patched
`TrinityPolicyLoss` forwards it, and the patched metaclass hands it only to losses that declare
it in `_runtime_keys`; it is never a data key. So every registered loss gives the same loss,
gradient and metrics with and without a group, and as called directly on padded tensors (the
pre-patch behaviour); a loss that declares another runtime key gets that key, never the group.
That the group itself reaches BAPO, and subclasses, the pull request's own tests show
(tests/algorithm/bapo_data_parallel_test.py). The batch is the engine's: a `TensorDict`, the
log-probs flat over each sequence (response token j of a sequence with prompt length p at
p - 1 + j, the rule the oracle uses directly).
"""

from datetime import timedelta
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from scripts.harness.engine import trinity_layout
from trinity.algorithm import ENTROPY_LOSS_FN, KL_FN, POLICY_LOSS_FN
from trinity.algorithm.policy_loss_fn.policy_loss_fn import PolicyLossFn
from trinity.common.config import AlgorithmConfig
from trinity.trainer.verl.losses import TrinityPolicyLoss

TIMEOUT = timedelta(seconds=30)  # a one-rank gloo group must never wait; fail instead of hang


PROMPT_LENS = [3, 1, 4, 2]
RESPONSE_LENS = [5, 3, 6, 2]
MASKED_INSIDE = [(0, 2), (2, 0), (2, 4)]  # response tokens excluded from the loss (tool output)


def _source(seed: int = 0) -> Dict[str, torch.Tensor]:
    """Per-token values right-padded with zeros (as Trinity pads), and the flat model log-probs."""
    gen = torch.Generator().manual_seed(seed)
    batch, width = len(RESPONSE_LENS), max(RESPONSE_LENS)
    valid = torch.arange(width) < torch.tensor(RESPONSE_LENS)[:, None]
    mask = valid.clone()
    for i, j in MASKED_INSIDE:
        mask[i, j] = False

    seq_lens = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    flat_logprob = -(torch.rand(sum(seq_lens), generator=gen, dtype=torch.float32) * 2.0 + 0.05)
    starts = [sum(seq_lens[:i]) for i in range(batch)]
    response_logprob = torch.zeros(batch, width, dtype=torch.float32)
    for i in range(batch):
        first = starts[i] + PROMPT_LENS[i] - 1  # the last prompt position predicts token 0
        response_logprob[i, : RESPONSE_LENS[i]] = flat_logprob[first : first + RESPONSE_LENS[i]]

    def per_token(scale: float, shift: float = 0.0) -> torch.Tensor:
        noise = torch.randn(batch, width, generator=gen, dtype=torch.float32)
        return torch.where(valid, noise * scale + shift, torch.zeros(()))

    return {
        "flat_logprob": flat_logprob,
        "offsets": torch.tensor([0] + [sum(seq_lens[: i + 1]) for i in range(batch)]),
        "starts": torch.tensor(starts),
        "valid": valid,
        "response_mask": mask,
        "response_logprob": response_logprob,  # what the loss must see as `logprob`
        # log-ratios with std 0.4, so that PPO-style clipping is active on both sides
        "old_log_probs": torch.where(valid, response_logprob + per_token(0.4), torch.zeros(())),
        "ref_log_prob": torch.where(valid, response_logprob + per_token(0.2), torch.zeros(())),
        "advantages": per_token(1.0),
        "expert_mask": torch.tensor([False, True, False, True]),
        "step": torch.full((batch,), 3, dtype=torch.long),
    }


def _token_ids(gen):
    """Left-padded prompt ids then right-padded response ids, with the attention mask."""
    batch, p_width, r_width = len(PROMPT_LENS), max(PROMPT_LENS), max(RESPONSE_LENS)
    attention = torch.zeros(batch, p_width + r_width, dtype=torch.long)
    for i in range(batch):
        attention[i, p_width - PROMPT_LENS[i] : p_width] = 1
        attention[i, p_width : p_width + RESPONSE_LENS[i]] = 1
    ids = torch.randint(5, 1000, attention.shape, generator=gen) * attention
    return ids, attention


def _jagged(rows: List[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


RESPONSE_FIELDS = ("response_mask", "old_log_probs", "ref_log_prob", "advantages")


def build_batch(src, layout: str) -> TensorDict:
    """The micro-batch as the engine passes it to the loss.

    `padded`: Trinity's trainer layout (`left_right_2_no_padding`): the response fields stay
    padded, `input_ids` is jagged. `jagged`: verl's nested layout, every response field jagged.
    """
    gen = torch.Generator().manual_seed(1)
    ids, attention = _token_ids(gen)
    p_width, batch = max(PROMPT_LENS), len(PROMPT_LENS)
    per_sample = {"expert_mask": src["expert_mask"], "step": src["step"]}
    if layout == "padded":
        split = [p_width, attention.shape[1] - p_width]
        (prompts, responses), (p_mask, r_mask) = ids.split(split, 1), attention.split(split, 1)
        old, adv = src["old_log_probs"].clone(), src["advantages"].clone()
        data = trinity_layout(prompts, p_mask, responses, r_mask, old, adv)
        data["ref_log_prob"] = src["ref_log_prob"].clone()
        data["response_mask"] = src["response_mask"].long()  # holes; the loss takes non-bool masks
        data.update(per_sample)
        return data
    assert layout == "jagged"
    fields = {
        "prompts": _jagged([ids[i, p_width - PROMPT_LENS[i] : p_width] for i in range(batch)]),
        "responses": _jagged([ids[i, p_width : p_width + RESPONSE_LENS[i]] for i in range(batch)]),
        **{
            key: _jagged([src[key][i, : RESPONSE_LENS[i]] for i in range(batch)])
            for key in RESPONSE_FIELDS
        },
        "response_mask": _jagged(
            [src["response_mask"][i, : RESPONSE_LENS[i]].long() for i in range(batch)]
        ),
        **per_sample,
    }
    return TensorDict(fields, batch_size=[batch])


def model_output(src):
    """Flat log-probs as a leaf (so the test can read its gradient), wrapped as the engine does."""
    values = src["flat_logprob"].clone().requires_grad_(True)
    return {"log_probs": torch.nested.nested_tensor_from_jagged(values, src["offsets"])}, values


def algorithm_config(name: str, kl_loss_fn: str = "none") -> AlgorithmConfig:
    """As the config validator resolves it: every fn with its registered default_args()."""
    return AlgorithmConfig(
        policy_loss_fn=name,
        policy_loss_fn_args=POLICY_LOSS_FN.get(name).default_args(),
        kl_loss_fn=kl_loss_fn,
        kl_loss_fn_args=KL_FN.get(kl_loss_fn).default_args(),
        entropy_loss_fn="none",
        entropy_loss_fn_args=ENTROPY_LOSS_FN.get("none").default_args(),
        loss_agg_mode="token-mean",
    )


def through_engine_loss(name, src, layout, kl_loss_fn="none", **call_kwargs):
    """One call of the patched TrinityPolicyLoss; returns (loss, metrics, flat grad)."""
    loss_fn = TrinityPolicyLoss(algorithm_config(name, kl_loss_fn))
    output, leaf = model_output(src)
    loss, metrics = loss_fn(output, build_batch(src, layout), **call_kwargs)
    loss.backward()
    return loss.detach(), metrics, leaf.grad


def called_directly(name, src, kl_loss_fn="none"):
    """Run the old behaviour: the loss fn on padded tensors.

    Returned as TrinityPolicyLoss reports it ("actor/" prefix, plus the KL term and
    `final_loss`); the gradient is scattered back to the flat positions the response tokens
    came from.
    """
    algo = algorithm_config(name, kl_loss_fn)
    policy_loss = POLICY_LOSS_FN.get(name)(backend="verl", **algo.policy_loss_fn_args)
    logprob = src["response_logprob"].clone().requires_grad_(True)
    inputs = {key: src[key] for key in ("old_log_probs", "ref_log_prob", "advantages")}
    inputs.update(expert_mask=src["expert_mask"], step=src["step"])
    loss, raw = policy_loss(logprob=logprob, response_mask=src["response_mask"], **inputs)
    metrics = {f"actor/{key}": value for key, value in raw.items()}
    if kl_loss_fn != "none":
        kl_loss, kl_raw = KL_FN.get(kl_loss_fn)(**algo.kl_loss_fn_args).calculate_kl_loss(
            logprob=logprob,
            ref_logprob=src["ref_log_prob"],
            response_mask=src["response_mask"],
            loss_agg_mode="token-mean",
            old_logprob=src["old_log_probs"],
        )
        loss = loss + kl_loss
        metrics.update({f"actor/{key}": value for key, value in kl_raw.items()})
    loss.backward()
    metrics["final_loss"] = loss.item()

    flat_grad = torch.zeros_like(src["flat_logprob"])
    for i, (start, p_len, r_len) in enumerate(zip(src["starts"], PROMPT_LENS, RESPONSE_LENS)):
        first = int(start) + p_len - 1
        flat_grad[first : first + r_len] = logprob.grad[i, :r_len]
    return loss.detach(), metrics, flat_grad


def assert_same_result(got, expected, what: str):
    loss, metrics, grad = got
    exp_loss, exp_metrics, exp_grad = expected
    torch.testing.assert_close(loss, exp_loss, rtol=1e-6, atol=1e-7, msg=f"{what}: loss")
    torch.testing.assert_close(grad, exp_grad, rtol=1e-6, atol=1e-7, msg=f"{what}: gradient")
    assert set(metrics) == set(exp_metrics), f"{what}: metric keys"
    for key, value in exp_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), f"{what}: {key}"


@pytest.fixture(scope="module")
def dp_group(tmp_path_factory):
    """A one-rank gloo sub-group, distinct from WORLD, so identity checks mean something."""
    owns_world = not dist.is_initialized()
    if owns_world:
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=TIMEOUT
        )
    try:
        group = dist.new_group(ranks=[0], backend="gloo", timeout=TIMEOUT)
        assert group is not dist.group.WORLD
        yield group
    finally:
        if owns_world:
            dist.destroy_process_group()


# The registry has no public listing of its lazily imported names; the mapping is the registry.
# Every registered loss (trinity-rft 0.6.0's 15 and bapo) runs on the batch below.
REGISTERED = sorted(POLICY_LOSS_FN._default_mapping)


@pytest.mark.parametrize("name", REGISTERED)
def test_dp_group_is_never_a_data_key(name):
    loss_fn = POLICY_LOSS_FN.get(name)(backend="verl", **POLICY_LOSS_FN.get(name).default_args())
    assert "dp_group" not in loss_fn.select_keys and "bapo" in REGISTERED


@pytest.mark.parametrize("layout", ["padded", "jagged"])
@pytest.mark.parametrize("name", REGISTERED)
def test_same_result_with_and_without_dp_group(name, layout, dp_group):
    src = _source()
    expected = called_directly(name, src)
    without = through_engine_loss(name, src, layout)
    with_group = through_engine_loss(name, src, layout, dp_group=dp_group)
    assert_same_result(without, expected, f"{name} without dp_group vs direct call")
    assert_same_result(with_group, expected, f"{name} with dp_group vs direct call")
    assert expected[2].abs().sum() > 0, "the gradient check needs a non-zero gradient"


@pytest.mark.parametrize("name", ["ppo", "bapo"])
def test_same_result_with_kl_loss(name, dp_group):
    """With a KL loss the wrapper also reads ref_log_prob (and old_log_probs) from the batch."""
    src = _source(seed=2)
    expected = called_directly(name, src, kl_loss_fn="k2")
    assert "actor/kl_loss" in expected[1]
    for layout in ("padded", "jagged"):
        without = through_engine_loss(name, src, layout, kl_loss_fn="k2")
        with_group = through_engine_loss(name, src, layout, kl_loss_fn="k2", dp_group=dp_group)
        assert_same_result(without, expected, f"{name}+k2 ({layout}) without dp_group")
        assert_same_result(with_group, expected, f"{name}+k2 ({layout}) with dp_group")


def recording_loss(runtime_keys=()):
    """A policy loss declaring ``runtime_keys``; it records the keyword arguments it receives.

    Its ``__call__`` takes the data and ``**kwargs``, so only the class's ``_runtime_keys``
    decide what else reaches it; each call returns a plain PPO-like loss.
    """

    def call(self, logprob, old_logprob, action_mask, advantages, **kwargs):
        self.calls.append(dict(kwargs))
        loss = -(torch.exp(logprob - old_logprob) * advantages * action_mask).sum()
        return loss / action_mask.sum(), {}

    def init(self, backend: str = "verl"):
        PolicyLossFn.__init__(self, backend=backend)
        self.calls = []

    body = {"__init__": init, "__call__": call, "default_args": classmethod(lambda cls: {})}
    return type("RecordingLoss", (PolicyLossFn,), {"_runtime_keys": set(runtime_keys), **body})()


def engine_loss_with(policy_loss) -> TrinityPolicyLoss:
    # TrinityPolicyLoss builds its policy loss from the registry; the test loss replaces the
    # built one rather than being registered, so the global registry stays untouched.
    engine_loss = TrinityPolicyLoss(algorithm_config("ppo"))
    engine_loss.policy_loss_fn = policy_loss
    return engine_loss


@pytest.mark.parametrize("runtime_keys", [(), ("batch_num_tokens",)])
def test_undeclared_dp_group_is_not_passed(dp_group, runtime_keys):
    """A loss that does not declare dp_group never sees it; what it declares, it gets.

    No runtime key is a batch field: the batch (which holds none) is read without a KeyError.
    """
    src = _source()
    recorder = recording_loss(runtime_keys)
    assert recorder.select_keys == ["old_log_probs", "response_mask", "advantages"]
    engine_loss = engine_loss_with(recorder)
    engine_loss(model_output(src)[0], build_batch(src, "padded"), dp_group=dp_group)
    recorder(  # and directly: the metaclass filters it, like any key the loss does not read
        logprob=src["response_logprob"],
        old_log_probs=src["old_log_probs"],
        response_mask=src["response_mask"],
        advantages=src["advantages"],
        dp_group=dp_group,
        batch_num_tokens=7,
    )
    assert recorder.calls == [{}, {"batch_num_tokens": 7} if runtime_keys else {}]
