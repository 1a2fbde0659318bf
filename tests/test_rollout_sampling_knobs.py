"""slime's rollout-side sampling knobs: top-k (rollout.sampling.top_k), string stop sequences
(rollout.sampling.stop), and the checked SGLang passthrough (rollout.sglang.extra_args), on both engines:
the torch engine for real, SGLang through a stub server that streams as SGLang 0.5.17 does."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from pipeline.config import ConfigError, from_dict, load_config
from stages.models import load_tokenizer, resolve_model
from stages.rollout.config import SamplingConfig, SGLangConfig
from stages.rollout.engine import GenRequest, SamplingParams, stop_token_of
from stages.rollout.sampling import sampling_logprobs
from stages.rollout.sglang_args import SERVER_ARGS, check_extra_args, flags_of_server_args
from stages.rollout.stop_strings import StopStrings
from stages.rollout.torch_engine import TorchEngine

torch.set_num_threads(1)
PROMPT = [257, 49, 50, 51, 258, 257]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return resolve_model(
        SimpleNamespace(name="tiny-qwen2", cache_dir=str(tmp_path_factory.getbasetemp() / "models"))
    )


@pytest.fixture(scope="module")
def tok(tiny_path):
    return load_tokenizer(tiny_path)


# -- top-k -------------------------------------------------------------------------------------------
def test_top_k_and_top_p_filter_jointly_as_sglang_does():
    """probs .4 .3 .2 .1, top_k=2, top_p=.5: the second token is kept because the mass above it (.4)
    is below .5 of the whole distribution (SGLang's joint filter); measured within the renormalised
    top 2 (.57 above it) it would be dropped. The kept tokens are renormalised."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 5))
    temp = torch.ones(5)
    top_p = torch.tensor([0.5, 1.0, 1.0, 0.5, 0.5])
    top_k = torch.tensor([2, 3, -1, 0, 3])
    got = sampling_logprobs(logits, temp, top_p, top_k).exp()
    want = torch.tensor(
        [
            [0.4 / 0.7, 0.3 / 0.7, 0, 0],  # top-2 and nucleus .5 (joint)
            [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0],  # top-3 alone
            [0.4, 0.3, 0.2, 0.1],  # off (-1)
            [0.4 / 0.7, 0.3 / 0.7, 0, 0],  # off (0): the nucleus alone keeps the same two here
            [0.4 / 0.7, 0.3 / 0.7, 0, 0],  # top-3 and nucleus .5: the nucleus is the tighter
        ]
    )
    assert torch.allclose(got, want, atol=1e-6), got


def test_the_generator_and_eval_sample_with_the_configured_top_k_and_stop(tmp_path_factory):
    from test_multiturn import ScriptedEngine
    from test_rollout_generator import FakeSink, make_cfg, rollout_args

    from pipeline.orchestration.evaluation import Evaluator
    from stages.rollout.generator import Generator
    from stages.tiny_models import build_byte_tokenizer

    sampling = {"max_new_tokens": 6, "top_k": 5, "stop": ["</answer>", "\n\n"], "stop_token_ids": [7]}
    cfg = make_cfg(tmp_path_factory, sampling=sampling)
    engine = ScriptedEngine([])
    gen = Generator(*rollout_args(cfg), FakeSink(), engine, "knobs", batch_groups=0)
    assert (gen.params.top_k, gen.params.stop, gen.params.stop_token_ids) == (5, ("</answer>", "\n\n"), (7,))
    tok = build_byte_tokenizer(tmp_path_factory.mktemp("tok"))
    eval_cfg = from_dict({"rollout": {"sampling": sampling}, "eval": {"every_steps": 1, "datasets": [{}]}})
    (evset,) = Evaluator(eval_cfg, engine, tok).sets
    assert (evset.params.top_k, evset.params.stop) == (5, ("</answer>", "\n\n"))


# -- stop strings --------------------------------------------------------------------------------------
class PieceTokenizer:
    """Token i decodes to PIECES[i]: multi-character tokens, as BPE vocabularies have."""

    PIECES = ["Hel", "lo", "\n\nThe", " end", "</ans", "wer>", "x"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.PIECES[i] for i in ids)


def test_a_stop_string_is_found_at_the_token_that_completes_it_even_inside_a_token():
    m = StopStrings(["\n\n", "</answer>"], PieceTokenizer())
    assert m.match([0]) is None and m.match([0, 1]) is None
    assert m.match([0, 1, 2]) == "\n\n"  # "\n\nThe": the string ends inside the token
    assert m.first_match([6] * 40 + [4, 5, 3]) == (42, "</answer>")  # "</ans" + "wer>", after 40 tokens
    assert m.first_match([4, 5, 2], start=2) == (3, "\n\n")  # prefixes up to start were checked before
    assert m.first_match([0, 1, 3]) is None


def test_a_stop_string_split_over_utf8_bytes_stops_at_its_last_byte(tok):
    m = StopStrings(["é"], tok)  # one character, two byte tokens (0xC3 0xA9)
    ids = list(b"caf") + list("é".encode())
    assert m.first_match(ids) == (len(ids), "é")


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings([""], PieceTokenizer())
    with pytest.raises(ValueError, match=r"rollout.sampling.stop=\['a', ''\]: an empty string"):
        SamplingConfig(stop=["a", ""])


def test_a_turn_ended_by_a_stop_string_keeps_its_text_and_the_template_glue(tmp_path):
    """Multi-turn reads a turn without its stop token and does not write that token's text again after
    it; a stop string's last token is text: it stays in the turn's text, and the chat template's
    end-of-turn is appended after it in full."""
    from test_multiturn import EOS, ScriptedEngine

    from stages.rollout.hooks import EngineHandle
    from stages.rollout.multiturn import Conversation, TurnTemplate
    from stages.tiny_models import build_byte_tokenizer

    class StringStops(ScriptedEngine):  # as both engines report a stop string
        async def generate(self, requests):
            out = await super().generate(requests)
            for req, res in zip(requests, out):
                if req.params.stop:
                    res.meta["stop_string"] = req.params.stop[0]
            return out

    tok = build_byte_tokenizer(tmp_path)
    tool = [{"role": "tool", "content": "7"}]
    glue = {}
    for how, turn, over in (("string", [*b"call<"], {"stop": ("<",)}), ("token", [*b"hi", EOS], {})):
        engine = StringStops([(turn, "stop", None)])
        conv = Conversation([1], EngineHandle(engine, "t"), SamplingParams(), template=TurnTemplate(tok))
        res = asyncio.run(conv.generate(**over))
        assert stop_token_of(res) == (None if how == "string" else EOS)
        assert conv.turn_text(res) == ("call<" if how == "string" else "hi")
        conv.append_messages(tool)
        glue[how] = tok.decode(conv.response_ids[len(turn) :], skip_special_tokens=False)
    # the end-of-turn the model did not write, whole: its first character is not the turn's last "<"
    assert glue["string"] == "<|im_end|>" + glue["token"], glue


def _one(engine, params):
    (r,) = asyncio.run(engine.generate([GenRequest(prompt_ids=PROMPT, params=params, rid="r")]))
    return r


def test_the_torch_engine_stops_at_the_token_that_completes_a_stop_string(tiny_path, tok):
    """A seeded run without stop strings, then the same run with a stop string taken from its text: the
    response is the first run's up to the first token after which the text contains the string."""
    plain = SamplingParams(temperature=1.0, max_new_tokens=48, stop_token_ids=(300,))  # no id 300: no stop
    eng = TorchEngine(tiny_path, seed=5)
    try:
        ref = _one(eng, plain)
    finally:
        eng.close()
    assert ref.finish_reason == "length"
    text = tok.decode(ref.response_ids)
    start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    cut = next(n for n in range(1, 49) if stop in tok.decode(ref.response_ids[:n]))
    assert cut < 48
    eng = TorchEngine(tiny_path, seed=5)
    try:
        got = _one(
            eng, SamplingParams(temperature=1.0, max_new_tokens=48, stop_token_ids=(300,), stop=(stop,))
        )
        # ignore_eos (benchmarks) ignores stop strings too, as it does stop tokens
        eng_free = _one(eng, SamplingParams(max_new_tokens=12, stop=(stop[0],), ignore_eos=True))
    finally:
        eng.close()
    assert got.finish_reason == "stop" and got.meta == {"stop_string": stop}
    assert got.response_ids == ref.response_ids[:cut]
    assert got.logprobs == ref.logprobs[:cut]
    assert eng_free.finish_reason == "length" and len(eng_free.response_ids) == 12


def test_stop_token_ids_still_stop_beside_stop_strings(tiny_path, tok):
    eng = TorchEngine(tiny_path, seed=5)
    try:
        ref = _one(eng, SamplingParams(max_new_tokens=24, ignore_eos=True))
        token = ref.response_ids[3]
        first = ref.response_ids.index(token)
        eng2 = TorchEngine(tiny_path, seed=5)
        try:  # a stop string that never occurs (not a byte sequence of the vocabulary's text)
            got = _one(
                eng2, SamplingParams(max_new_tokens=24, stop_token_ids=(token,), stop=("\x00\x01\x02",))
            )
        finally:
            eng2.close()
    finally:
        eng.close()
    assert got.finish_reason == "stop" and got.response_ids == ref.response_ids[: first + 1]
    assert stop_token_of(got) == token  # a stop token, not a stop string: multi-turn drops it from the text


# -- SGLang: top_k in the request, stop strings matched on the stream ----------------------------------
class _StreamingStub(BaseHTTPRequestHandler):
    """POST /generate streams `tokens` in chunks of two as SGLang's incremental output does; records the
    request and whether the client went away before the last chunk."""

    tokens: list[int] = []
    bodies: list[dict] = []
    extra_meta: dict = {}  # more meta_info in every chunk (e.g. SGLang's prompt_tokens, cached_tokens)
    disconnected = threading.Event()

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802 - http.server's name
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [self.tokens[i : i + 2] for i in range(0, len(self.tokens), 2)]
        try:
            for n, chunk in enumerate(chunks):
                last = n == len(chunks) - 1
                meta = {
                    "weight_version": "0",
                    "output_token_logprobs": [[-0.5, t, None] for t in chunk],
                    "finish_reason": {"type": "length"} if last else None,
                    **self.extra_meta,
                }
                self.wfile.write(f"data: {json.dumps({'meta_info': meta})}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.02)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.disconnected.set()


@pytest.fixture
def stub_engine(tmp_path):
    pytest.importorskip("aiohttp")
    from stages.rollout.sglang_engine import SGLangEngine
    from stages.tiny_models import build_byte_tokenizer

    build_byte_tokenizer(tmp_path)  # the engine decodes with the model folder's tokenizer
    _StreamingStub.bodies, _StreamingStub.disconnected, _StreamingStub.extra_meta = [], threading.Event(), {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StreamingStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    eng = SGLangEngine(str(tmp_path), start=False, port=server.server_address[1])
    yield eng
    server.shutdown()
    server.server_close()


def test_sglang_gets_top_k_and_its_stop_strings_end_the_stream_at_the_completing_token(stub_engine):
    # chunks of two: "...>t", so the completing token is mid-chunk and the chunk's rest must go
    _StreamingStub.tokens = list(b"abcd</answer>tail") + list(b"x" * 60)
    params = SamplingParams(top_k=20, max_new_tokens=80, stop=("</answer>",), stop_token_ids=(258,))
    (r,) = asyncio.run(stub_engine.generate([GenRequest(prompt_ids=[1, 2], params=params, rid="q")]))
    assert bytes(r.response_ids) == b"abcd</answer>" and r.finish_reason == "stop"
    assert r.meta["stop_string"] == "</answer>" and stop_token_of(r) is None
    assert len(r.logprobs) == len(r.versions) == len(r.response_ids)
    sp = _StreamingStub.bodies[-1]["sampling_params"]
    # SGLang's own string stop needs the tokenizer its servers run without (--skip-tokenizer-init)
    assert sp["top_k"] == 20 and "stop" not in sp and sp["stop_token_ids"] == [258]
    assert _StreamingStub.disconnected.wait(5), "the stream went on after the stop string"


def test_sglang_without_top_k_or_stop_streams_to_the_end(stub_engine):
    _StreamingStub.tokens = list(b"abc</answer>tail")
    for top_k in (-1, 0):
        (r,) = asyncio.run(
            stub_engine.generate([GenRequest(prompt_ids=[1], params=SamplingParams(top_k=top_k), rid="q")])
        )
        assert bytes(r.response_ids) == b"abc</answer>tail" and r.finish_reason == "length"
        assert "top_k" not in _StreamingStub.bodies[-1]["sampling_params"]  # SGLang refuses 0
    assert not _StreamingStub.disconnected.is_set()


def test_stop_strings_with_routing_replay_on_sglang_are_refused_at_build(tmp_path_factory):
    from test_rollout_generator import make_cfg, rollout_args

    from stages.rollout.build import build_engine

    cfg = make_cfg(tmp_path_factory, engine="sglang", sampling={"stop": ["\n\n"]})
    rollout, model, run = rollout_args(cfg)
    run = SimpleNamespace(**{**vars(run), "routing_replay": True})
    with pytest.raises(ValueError, match="rollout.sampling.stop with trainer.routing_replay on SGLang"):
        build_engine(rollout, model, run)


# -- config: keys, values, SGLang passthrough ----------------------------------------------------------
def test_top_k_values_are_checked():
    assert SamplingConfig(top_k=-1).top_k == -1 and SamplingConfig(top_k=0).top_k == 0
    with pytest.raises(ValueError, match=r"rollout.sampling.top_k=-3: must be >= 1, or -1 / 0"):
        SamplingConfig(top_k=-3)
    cfg = load_config(None, ["rollout.sampling.top_k=40", 'rollout.sampling.stop=["</answer>"]'])
    assert cfg.rollout.sampling.top_k == 40 and cfg.rollout.sampling.stop == ["</answer>"]


@pytest.mark.parametrize(
    "extra,match",
    [
        (
            ["--speculative-algoritm", "EAGLE"],
            r"--speculative-algoritm is not an SGLang .*did you mean --speculative-algorithm\?",
        ),
        (["--context-lenght=8192"], r"did you mean --context-length\?"),
        (
            ["--frobnicate"],
            r"--frobnicate is not an SGLang .*newer SGLang, add it to stages/rollout/sglang_args.py",
        ),
        (["--tp-size", 2], r"--tp-size is set by slipstream: use rollout.sglang.tp_size"),
        (["--port", 3000], r"--port is set by slipstream: use rollout.sglang.port"),
        ([8192, "--context-length"], r"8192 comes before any flag"),
    ],
)
def test_a_bad_sglang_passthrough_flag_is_named_at_config_load(extra, match):
    with pytest.raises(ValueError, match=match):
        SGLangConfig(extra_args=extra)
    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"rollout.sglang.extra_args={json.dumps(extra)}"])


def test_speculative_decoding_and_other_real_flags_pass():
    extra = [
        "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/m/draft",
        "--speculative-num-steps", 3, "--speculative-eagle-topk", 1, "--speculative-num-draft-tokens", 4,
        "--context-length", 8192, "--enable-dp-attention", "--dp-size", 2, "--ep-size", 2,
        "--gc-warning-threshold-secs", 0.05, "--enable-metrics", "--chunked-prefill-size=4096",
        "--random-seed", "-1",
    ]  # fmt: skip
    assert SGLangConfig(extra_args=extra).extra_args == extra


def test_every_flag_the_engine_launches_with_is_a_listed_sglang_argument(tmp_path):
    """The list and the launch command must agree: a list refreshed from an SGLang that renamed one of
    slipstream's own flags fails here, not at a GPU server's start."""
    from stages.rollout.sglang_args import OWNED
    from stages.rollout.sglang_engine import SGLangEngine

    eng = SGLangEngine(
        str(tmp_path), SGLangConfig(disable_cuda_graph=True), start=False, port=1, fp32_lm_head=True
    )
    launched = {a for a in eng._command(str(tmp_path), 0) if a.startswith("--")}
    assert launched <= SERVER_ARGS, launched - SERVER_ARGS
    assert "--enable-return-routed-experts" in SERVER_ARGS and set(OWNED) <= SERVER_ARGS
    assert launched - {"--disable-radix-cache"} <= set(OWNED)  # each one names its key when passed again


def test_the_flag_list_is_read_from_sglang_server_args_source():
    source = """
import argparse
class ServerArgs:
    model_path: A[str, Arg(help="weights", aliases=["--model"])]
    tp_size: A[int, "Tensor parallel size.", NS("parallel")] = 1
    ep_join_mode: A[str, Arg(help="join", cli_name="--elastic-ep-join-mode")] = None
    custom_handler: A[Optional[Callable], Arg(help="python only", no_cli=True)] = None
    stat_loggers: A[dict, NS("observability")] = None
    plain: int = 0

    @staticmethod
    def add_cli_args(parser):
        add_cli_args_from_dataclass(parser, ServerArgs)
        parser.add_argument("--reasoning-parser", type=str)
        parser.add_argument("--config", help="a file")
"""
    assert flags_of_server_args(source) == {
        "--model-path", "--model", "--tp-size", "--elastic-ep-join-mode", "--reasoning-parser", "--config",
    }  # fmt: skip


def test_the_shipped_list_is_sglang_0_5_17s():
    assert len(SERVER_ARGS) > 400  # the whole parser, not a hand-picked few
    for flag in ("--speculative-draft-model-path", "--attention-backend", "--chunked-prefill-size"):
        assert flag in SERVER_ARGS
    check_extra_args([])  # nothing to check
