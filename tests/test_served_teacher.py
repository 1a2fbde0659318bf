"""On-policy distillation from a served teacher (trainer.distill.server, issue #41): the generators ask an
SGLang server of the teacher for its logprob of each response token (stages/rollout/teacher.py), the
samples carry them (Sample.teacher_logprobs, through the buffer's checks), and the trainer takes them as
the KL's reference instead of holding the teacher.

The SGLang server here is a stub that scores with a transformers model on the CPU and answers as SGLang
0.5.17's /generate does for `logprob_start_len` (scheduler_components/logprob_result_processor.py:
input_token_logprobs from that position on, the first without a logprob)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import ThreadingHTTPServer

import msgspec
import numpy as np
import pyarrow as pa
import pytest
import torch

from buffer.record import ARROW_SCHEMA, F32, LEGACY_SCHEMAS, Status, pack, samples_to_batch, upgrade_batch
from stages.rollout.teacher import TeacherClient, response_logprobs
from stages.trainer.config import TrainerConfig
from stages.trainer.testing import ListSource, make_samples, make_tiny_hf
from tests.http_stub import JsonHandler


class TeacherStub(JsonHandler):
    """POST /generate scoring input_ids with `model` (fp32), as SGLang answers a max_new_tokens 0 request."""

    model = None
    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        ids, start = body["input_ids"], body["logprob_start_len"]
        with torch.no_grad():
            logp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)
        computed = [logp[i, ids[i + 1]].item() for i in range(start, len(ids) - 1)]  # position i predicts i+1
        values = [None, *computed]  # SGLang: [None] + the logprobs computed from the start, minus the last
        entries = [[v, t, None] for v, t in zip(values, ids[start:])]
        self._answer({"text": "", "meta_info": {"input_token_logprobs": entries, "finish_reason": None}})


@pytest.fixture
def serve_teacher():
    servers = []

    def start(model_path: str) -> str:
        from transformers import AutoModelForCausalLM

        handler = type("Stub", (TeacherStub,), {"bodies": []})
        handler.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append((server, handler))
        return f"http://127.0.0.1:{server.server_address[1]}"

    start.handlers = lambda: [h for _, h in servers]
    yield start
    for server, _ in servers:
        server.shutdown()
        server.server_close()


def test_the_generator_stores_the_teachers_logprob_of_every_response_token(tmp_path_factory, serve_teacher):
    """With the policy's own model as the teacher (and sampling at temperature 1) the teacher's logprob of
    each sampled token is the engine's own: every sample of every group carries one per response token."""
    from stages.models import resolve_model
    from stages.rollout.build import build_engine
    from stages.rollout.generator import Generator
    from stages.rollout.run import RolloutRun
    from tests.test_rollout_generator import FakeSink, make_cfg, rollout_args

    cfg = make_cfg(tmp_path_factory)
    rollout, model, run = rollout_args(cfg)
    engine = build_engine(rollout, model, run)
    url = serve_teacher(str(resolve_model(model)))
    run = RolloutRun(seed=run.seed, max_staleness=run.max_staleness, teacher_url=url)
    sink = FakeSink()
    try:
        stats = asyncio.run(
            Generator(rollout, model, run, sink, engine, "g", batch_groups=0).run(max_groups=3)
        )
    finally:
        engine.close()
    assert stats["samples"] == 12 and stats["samples_failed"] == 0
    for samples in sink.groups.values():
        for s in samples:
            teacher = s.array("teacher_logprobs")
            assert len(teacher) == s.response_len > 0
            np.testing.assert_allclose(teacher, s.array("rollout_logprobs"), atol=2e-4)
    (handler,) = serve_teacher.handlers()
    assert len(handler.bodies) == 12  # one scoring request per sample, generating nothing
    assert all(b["sampling_params"]["max_new_tokens"] == 0 and b["return_logprob"] for b in handler.bodies)
    s = next(iter(sink.groups.values()))[0]
    ids = s.array("prompt_ids").tolist() + s.array("response_ids").tolist()
    (mine,) = [b for b in handler.bodies if b["input_ids"] == ids]
    assert mine["logprob_start_len"] == s.prompt_len - 1  # from the last prompt token on


def test_a_teacher_that_cannot_be_reached_fails_the_sample_naming_it():
    from buffer.net import free_port

    samples = make_samples(1, 2, seed=3)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    asyncio.run(TeacherClient(url, retries=1).annotate(samples))
    for s in samples:
        assert s.status == Status.FAILED and url in s.error and "unreachable after 2 tries" in s.error
        assert s.teacher_logprobs == b""


@pytest.mark.parametrize(
    "entries,match",
    [
        ([[None, 5, None], [-0.1, 6, None]], "2 input_token_logprobs for a response of 2 tokens"),
        ([[None, 5, None], [-0.1, 6, None], [-0.2, 8, None]], "other tokens than the response's"),
        ([[None, 5, None], [-0.1, 6, None], [float("nan"), 7, None]], "not finite"),
    ],
    ids=["one-short", "other-tokens", "nan"],
)
def test_an_answer_that_is_not_the_responses_logprobs_is_refused(entries, match):
    right = [
        [None, 5, None],
        [-0.1, 6, None],
        [-0.2, 7, None],
    ]  # the last prompt token's, then the response's
    assert response_logprobs({"meta_info": {"input_token_logprobs": right}}, [6, 7]).tolist() == [-0.1, -0.2]
    with pytest.raises(ValueError, match=match):
        response_logprobs({"meta_info": {"input_token_logprobs": entries}}, [6, 7])


def _trainer(tmp_path, student: str, distill: dict, name: str):
    from trainer_setup import make_trainer

    from pipeline.config import RunConfig

    cfg = RunConfig()
    raw = {"batch_groups": 2, "optimizer": "sgd", "lr": 0.3, "distill": distill}
    raw["loss"] = {"kl_type": "k3", "correction": "none"}
    cfg.trainer = msgspec.convert(raw, TrainerConfig)  # as a loaded config: distill applied
    return cfg, lambda batch: make_trainer(cfg, ListSource([batch]), student, str(tmp_path / name))


def test_a_trainer_with_a_served_teacher_trains_as_one_that_holds_the_teacher(tmp_path, serve_teacher):
    """The same step, the teacher's logprobs from the samples (scored by the server) or from the trainer's
    own forward of the teacher: the same loss, KL and weights after it."""
    student = make_tiny_hf(str(tmp_path / "student"), "qwen2", seed=1)
    teacher = make_tiny_hf(str(tmp_path / "teacher"), "qwen2", seed=2)
    samples = make_samples(2, 4, seed=7)
    for s in samples:
        s.reward = 1.0  # no task signal: the KL to the teacher is the whole loss
    held_cfg, held = _trainer(tmp_path, student, {"teacher": teacher, "coef": 1.0}, "held")
    served_cfg, served = _trainer(tmp_path, student, {"server": "http://x:1", "coef": 1.0}, "served")
    assert served_cfg.trainer.ref_load == "" and held_cfg.trainer.ref_load == teacher
    url = serve_teacher(teacher)
    asyncio.run(TeacherClient(url).annotate(samples))
    assert all(len(s.array("teacher_logprobs")) == s.response_len for s in samples)
    a = held(samples_to_batch(samples))
    m_held = a.step()
    w_held = {n: p.detach().clone() for n, p in a.policy.model.named_parameters()}
    a.close()
    b = served(samples_to_batch(samples))
    assert not b.backend.has_reference  # no teacher (nor initial policy) copy in the trainer
    m_served = b.step()
    assert m_served["kl/value"] == pytest.approx(m_held["kl/value"], rel=1e-5)
    assert m_served["loss"] == pytest.approx(m_held["loss"], rel=1e-5)
    for n, p in b.policy.model.named_parameters():
        assert torch.allclose(p, w_held[n], atol=1e-5), n
    b.close()


def test_a_batch_without_the_teachers_logprobs_is_refused_naming_the_key(tmp_path):
    student = make_tiny_hf(str(tmp_path / "student"), "qwen2", seed=1)
    _, served = _trainer(tmp_path, student, {"server": "http://x:1", "coef": 1.0}, "served")
    tr = served(samples_to_batch(make_samples(2, 4, seed=7)))
    with pytest.raises(
        ValueError, match="trainer.distill.server is set, but sample 0 .* no teacher_logprobs"
    ):
        tr.step()
    tr.close()


def test_the_buffer_refuses_teacher_logprobs_that_are_not_one_finite_logprob_per_response_token():
    from buffer.validate import check_batch
    from buffer.wire import ProtocolError

    short, nan, good = make_samples(1, 3, seed=5)
    short.teacher_logprobs = pack(np.full(short.response_len - 1, -0.5), F32)
    nan.teacher_logprobs = pack(np.full(nan.response_len, np.nan), F32)
    good.teacher_logprobs = pack(np.full(good.response_len, -0.5), F32)
    good.validate()
    check_batch(samples_to_batch([good]))
    with pytest.raises(ValueError, match="teacher_logprobs has"):
        short.validate()
    with pytest.raises(ProtocolError, match="teacher_logprobs is not aligned"):
        check_batch(samples_to_batch([good, short]))
    with pytest.raises(ValueError, match="teacher_logprobs holds nan"):
        nan.validate()
    with pytest.raises(ProtocolError, match="teacher_logprobs holds nan"):
        check_batch(samples_to_batch([nan]))


def test_a_segment_written_before_served_teachers_reads_back_without_teacher_logprobs():
    batch = samples_to_batch(make_samples(1, 2, seed=4))
    old = LEGACY_SCHEMAS[-1]
    assert "teacher_logprobs" not in old.names and "routed_experts" in old.names
    legacy = pa.RecordBatch.from_arrays([batch.column(f.name) for f in old], schema=old)
    up = upgrade_batch(legacy)
    assert up.schema.equals(ARROW_SCHEMA) and up.column("teacher_logprobs").to_pylist() == [[], []]
    assert up.equals(batch)


def test_the_config_takes_a_served_teacher_at_temperature_one_only():
    from pipeline.config import ConfigError, load_config, rollout_run

    args = [
        "trainer.distill.server=http://10.0.0.5:30010",
        "trainer.distill.coef=0.5",
        "trainer.loss.kl_coef=0",
    ]
    cfg = load_config(None, args)
    assert rollout_run(cfg).teacher_url == "http://10.0.0.5:30010"
    assert cfg.trainer.ref_load == "" and cfg.trainer.loss.kl_coef == 0.5
    with pytest.raises(ConfigError, match="temperature"):
        load_config(None, [*args, "rollout.sampling.temperature=0.7"])
    with pytest.raises((ConfigError, ValueError), match="an SGLang server's URL"):
        load_config(None, ["trainer.distill.server=10.0.0.5:30010", *args[1:]])
    with pytest.raises((ConfigError, ValueError), match="drop trainer.ref_load"):
        load_config(None, [*args, "trainer.ref_load=/ref"])


def test_the_standalone_rollout_stage_asks_the_served_teacher_too():
    from stages.rollout.config_file import ConfigError, load

    args = ["trainer.distill.server=http://10.0.0.5:30010", "trainer.distill.coef=0.5"]
    assert load(None, args).run.teacher_url == "http://10.0.0.5:30010"
    with pytest.raises(ConfigError, match="temperature"):
        load(None, [*args, "rollout.sampling.temperature=0.7"])


@pytest.mark.parametrize(
    "answer",
    [[1, 2], None, {"meta_info": [3]}, {"meta_info": {"input_token_logprobs": [[1]]}}],
    ids=["list", "null", "meta-list", "short-entry"],
)
def test_an_answer_of_another_shape_fails_the_sample_not_the_generator(answer):
    class Odd(TeacherClient):
        async def _post(self, session, body):
            return answer

    samples = make_samples(1, 2, seed=3)
    asyncio.run(Odd("http://teacher:1").annotate(samples))
    assert all(s.status == Status.FAILED and s.error.startswith("teacher http://teacher:1:") for s in samples)


def test_a_batch_whose_samples_all_failed_trains_nothing_without_teacher_logprobs(tmp_path):
    """Every sample failed (the teacher down for a whole batch): nothing is trained, nothing is asked of
    the teacher's logprobs, and the step goes through."""
    student = make_tiny_hf(str(tmp_path / "student"), "qwen2", seed=1)
    _, served = _trainer(tmp_path, student, {"server": "http://x:1", "coef": 1.0}, "served")
    samples = make_samples(2, 4, seed=7)
    for s in samples:
        s.status, s.error = Status.FAILED, "teacher http://x:1: unreachable"
    tr = served(samples_to_batch(samples))
    assert tr.step()["kl/value"] == 0.0
    tr.close()


def test_the_standalone_rollout_stage_refuses_a_teacher_that_is_not_a_url():
    from stages.rollout.config_file import ConfigError, load

    with pytest.raises(ConfigError, match="an SGLang server's URL"):
        load(None, ["trainer.distill.server=10.0.0.5:30010", "trainer.distill.coef=0.5"])
