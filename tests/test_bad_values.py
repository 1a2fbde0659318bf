"""Bad values never reach the weights: the buffer rejects out-of-range values with the field and the
sample named (both wire forms), and the trainer skips (or refuses) a step whose loss or gradient is
not finite, so a NaN that gets past every check still changes no weight and no checkpoint."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch

from buffer.record import Sample, samples_to_batch
from buffer.validate import check_batch
from buffer.wire import SCHEMA_VERSION, Ingest, ProtocolError, decode


def _sample(**over) -> Sample:
    kw = dict(
        uid="s-1",
        group_id="g",
        group_index=0,
        group_size=2,
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        rollout_logprobs=[-0.5, -1.0],
        versions=[0, 0],
        loss_mask=[1, 1],
        reward=1.0,
    )
    kw.update(over)
    return Sample.build(**kw)


BAD = {  # the inputs that were acked before, and the words the rejection must contain
    "nan reward": (dict(reward=math.nan), "reward nan is not finite"),
    "inf reward": (dict(reward=math.inf), "reward inf is not finite"),
    "-inf reward": (dict(reward=-math.inf), "reward -inf is not finite"),
    "nan logprob": (dict(rollout_logprobs=[-0.5, math.nan]), "rollout_logprobs holds nan"),
    "positive logprob": (dict(rollout_logprobs=[-0.5, 0.7]), "logprob must be finite and <= 0"),
    "loss_mask 7": (dict(loss_mask=[1, 7]), "loss_mask holds 7"),
    "token id -5": (dict(response_ids=[4, -5]), "token id -5 is negative"),
    "negative version": (dict(versions=[0, -3]), "versions holds -3"),
    "group_size 1e9": (dict(group_size=10**9), "group_size 1000000000 outside"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_msgpack_ingest_rejects_bad_values_naming_field_and_uid(case):
    over, words = BAD[case]
    msg = msgspec.msgpack.encode(
        Ingest(schema=SCHEMA_VERSION, producer="p", seq=7, samples=[_sample(**over)])
    )
    with pytest.raises(ProtocolError, match="s-1") as e:
        decode(msg)
    assert words in str(e.value) and e.value.category == "invalid_sample"


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_arrow_batches_reject_the_same_values(case):
    over, words = BAD[case]
    good = _sample(uid="ok-0")
    bad = _sample(uid="bad-1", group_index=1, **{k: v for k, v in over.items() if k != "group_size"})
    if "group_size" in over:
        bad = msgspec.structs.replace(bad, group_size=over["group_size"])
    batch = samples_to_batch([good, bad])
    with pytest.raises(ProtocolError, match="bad-1") as e:
        check_batch(batch)
    assert words in str(e.value)
    check_batch(samples_to_batch([good]))  # the good one alone passes


def test_group_index_past_int32_is_invalid_input_not_an_internal_error():
    msg = msgspec.msgpack.encode(
        Ingest(schema=SCHEMA_VERSION, producer="p", seq=1, samples=[_sample(group_index=2**31)])
    )
    with pytest.raises(ProtocolError, match="group_index 2147483648 outside") as e:
        decode(msg)
    assert e.value.category == "invalid_sample"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from stages.trainer.testing import make_tiny_hf

    return make_tiny_hf(str(tmp_path_factory.mktemp("m") / "qwen2"), "qwen2")


def _nan_batch():
    from stages.trainer.testing import make_samples

    samples = make_samples(2, 4, seed=3)
    samples[0] = msgspec.structs.replace(samples[0], reward=math.nan)
    return samples_to_batch(samples)


def test_a_nan_reward_changes_no_weight_and_the_next_step_trains(model_path, tmp_path):
    from trainer_setup import make_trainer

    from pipeline.config import RunConfig
    from stages.trainer.model import unwrap
    from stages.trainer.testing import ListSource, make_batch

    cfg = RunConfig()
    cfg.trainer.batch_groups, cfg.trainer.micro_batch_tokens = 2, 64
    tr = make_trainer(cfg, ListSource([_nan_batch(), make_batch(2, 4, seed=4)]), model_path, str(tmp_path))
    before = {k: v.clone() for k, v in unwrap(tr.policy.model).state_dict().items() if torch.is_tensor(v)}
    m = tr.step()
    assert m["optimizer/skipped"] == 1.0 and m["optimizer/skipped_total"] == 1
    after = unwrap(tr.policy.model).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # not one weight moved
    # nor did the policy version: the skipped step made no new policy (the buffer and the generators'
    # staleness count from it)
    assert tr.version == 0 and m["version"] == 0
    m2 = tr.step()
    assert m2["optimizer/skipped"] == 0.0 and math.isfinite(m2["loss"]) and m2["grad_norm"] > 0
    assert tr.version == 1 and m2["version"] == 1
    changed = unwrap(tr.policy.model).state_dict()
    assert any(not torch.equal(before[k], changed[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in changed.values() if torch.is_tensor(v))
    tr.close()  # the final checkpoint is saved: it is finite


def test_on_nonfinite_stop_fails_with_the_version_named(model_path, tmp_path):
    from trainer_setup import make_trainer

    from pipeline.config import RunConfig
    from stages.trainer.testing import ListSource

    cfg = RunConfig()
    cfg.trainer.batch_groups, cfg.trainer.micro_batch_tokens, cfg.trainer.on_nonfinite = 2, 64, "stop"
    tr = make_trainer(cfg, ListSource([_nan_batch()]), model_path, str(tmp_path))
    with pytest.raises(FloatingPointError, match="version 0.*not finite.*on_nonfinite=skip"):
        tr.step()


def test_values_within_bounds_pass():
    s = _sample(rollout_logprobs=[0.0, -30.0], loss_mask=[0, 1], reward=-2.5, versions=[0, 9])
    s.validate()
    check_batch(samples_to_batch([s]))
    assert np.isfinite(s.reward)


def test_a_port_in_use_names_the_key():
    import socket

    from stages.weights import make_sender
    from stages.weights.config import WeightsConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=rf"weights.bind=tcp://127.0.0.1:{port}: cannot bind"):
            make_sender(WeightsConfig(transport="cpu", bind=f"tcp://127.0.0.1:{port}"))


def test_a_direct_push_to_torch_engines_is_refused_at_start_naming_the_keys():
    """weights.snapshot=direct hands the sender a lazy source; the CPU transport (torch engines) keeps
    every push for engines that join later, so the pair is refused when the sender is made, before
    any training, not at the first push."""
    from stages.weights import make_sender
    from stages.weights.config import WeightsConfig

    with pytest.raises(ValueError, match=r"weights.snapshot=direct .* use weights.snapshot=auto"):
        make_sender(WeightsConfig(snapshot="direct"))  # auto without SGLang servers: the cpu transport
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"weights.snapshot=direct needs trainer.pp=1"):  # at load
        load_config("configs/gpu-4x-dp2.yaml", ["weights.snapshot=direct", "trainer.pp=2"])
