"""MoE routing replay (issue #19): the torch engine records the experts it routed every position to, the
rows survive Sample / Arrow / the buffer's segments (older segments without the column included), and the
trainer's replayed forward computes logprobs under exactly the recorded experts: the engine's own
recording gives the engine's logprobs back; an altered one gives what transformers computes with its
routers forced to those experts (and not the unreplayed logprobs)."""

from __future__ import annotations

import asyncio
import base64
import json

import msgspec
import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F

from buffer.record import (
    ARROW_SCHEMA,
    LEGACY_SCHEMAS,
    Sample,
    batch_to_samples,
    samples_to_batch,
)
from stages.trainer.tiny_families import make_tiny

E, K = 4, 2  # the tiny Qwen3-MoE: 4 experts, top-2, 2 layers


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return make_tiny(str(tmp_path_factory.mktemp("moe") / "qwen3_moe"), "qwen3_moe")


# -- helpers ----------------------------------------------------------------------------------------
def _gates(hf) -> list:
    """The transformers model's routers, MoE layers in order (dense layers have none)."""
    return [m for m in hf.modules() if type(m).__name__.endswith("TopKRouter")]


def _load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_routing(hf, tokens: list[int]) -> torch.Tensor:
    """[positions, moe_layers, k] experts transformers' own routers pick in one unpadded forward."""
    picked = []
    handles = [g.register_forward_hook(lambda _m, _a, out: picked.append(out[2])) for g in _gates(hf)]
    try:
        with torch.no_grad():
            hf(torch.tensor([tokens]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(picked, dim=1)


def _force_routing(hf) -> dict:
    """Replace every router's forward by one that routes to `forced[layer]` ([positions, k]; a layer
    missing from the dict routes itself), with weights as Qwen3-MoE makes them: softmax over all experts
    at the chosen ones, renormalised over them with norm_topk_prob. Returns the dict to fill."""
    forced: dict[int, torch.Tensor] = {}

    def forward_of(gate, layer):
        def forward(hidden):
            logits = F.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            idx = forced.get(layer)
            if idx is None:
                idx = torch.topk(probs, gate.top_k, dim=-1).indices
            weights = probs.gather(-1, idx)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), idx

        return forward

    for layer, gate in enumerate(_gates(hf)):
        gate.forward = forward_of(gate, layer)
    return forced


def _hf_logprobs(hf, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response[:-1]])).logits[0, len(prompt) - 1 :].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _trainer(path, run_dir, **trainer):
    from trainer_setup import make_trainer

    from pipeline.config import RunConfig
    from stages.trainer.testing import ListSource

    cfg = RunConfig()
    cfg.rollout.sampling.temperature = 1.0
    cfg.trainer.batch_groups, cfg.trainer.micro_batch_tokens = 3, 64  # several rows per micro-batch
    cfg.trainer.routing_replay = True
    cfg.trainer.old_logprobs = "separate_pass"  # logp_old from its own (replayed) forward
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    return make_trainer(cfg, ListSource([]), path, str(run_dir))


def _generate(path, requests, **engine_kw):
    from stages.rollout.torch_engine import TorchEngine

    engine = TorchEngine(path, record_routing=True, **engine_kw)
    try:
        return asyncio.run(engine.generate(requests)), engine.stats()
    finally:
        engine.close()


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in lengths]


# -- 1. the engine records what a plain forward routes to ------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm_topk_prob": False, "mlp_only_layers": [0]}],
    ids=["norm-topk", "dense-first-layer"],
)
def test_engine_records_the_experts_of_a_plain_forward(moe_path, tmp_path, monkeypatch, overrides):
    """Prompts of different lengths (left padding), two identical ones (prefilled once), more requests
    than batch rows and different response lengths (later requests merge into a running batch): every
    result's rows are the top-k sets transformers' routers pick in one unpadded forward of prompt +
    response[:-1], position by position and MoE layer by MoE layer (dense layers have no row)."""
    from stages.rollout import torch_engine
    from stages.rollout.engine import GenRequest, SamplingParams

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe", **overrides) if overrides else moe_path
    layers = 1 if overrides else 2
    merges = []
    real_merge = torch_engine._merge
    monkeypatch.setattr(torch_engine, "_merge", lambda a, b: merges.append(1) or real_merge(a, b))
    prompts = _prompts((7, 7, 3, 5, 11, 4))
    prompts[1] = prompts[0]
    new_tokens = (5, 3, 2, 9, 1, 6)
    requests = [
        GenRequest(prompt_ids=p, params=SamplingParams(max_new_tokens=n, ignore_eos=True), rid=str(i))
        for i, (p, n) in enumerate(zip(prompts, new_tokens))
    ]
    results, stats = _generate(path, requests, chunk_tokens=2, max_batch_size=3, seed=3)
    assert merges, "no request joined a running batch: continuous batching was not exercised"
    assert stats["prefill_tokens"] < sum(map(len, prompts))  # the identical prompts were prefilled once
    hf = _load_hf(path)
    for p, n, res in zip(prompts, new_tokens, results):
        assert len(res.response_ids) == n
        rows = len(p) + n - 1
        got = res.routed_experts
        assert got.dtype == np.int16 and got.shape == (rows, layers * K), (got.shape, rows)
        want = _hf_routing(hf, p + res.response_ids[:-1]).sort(-1).values
        got = torch.from_numpy(got.astype(np.int64)).view(rows, layers, K).sort(-1).values
        bad = (got != want).any(-1).nonzero().tolist()
        assert not bad, f"prompt of {len(p)}: (position, layer) {bad[:5]} routed elsewhere than in HF"


def test_engine_without_recording_returns_none_and_fill_response_keeps_covering_rows(moe_path):
    from stages.rollout.engine import GenRequest, SamplingParams
    from stages.rollout.hooks import fill_response
    from stages.rollout.torch_engine import TorchEngine

    engine = TorchEngine(moe_path)
    try:
        (plain,) = asyncio.run(
            engine.generate([GenRequest(prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=2))])
        )
    finally:
        engine.close()
    assert plain.routed_experts is None

    (res,), _ = _generate(
        moe_path, [GenRequest(prompt_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=4, ignore_eos=True))]
    )
    blank = Sample.build(
        uid="u", group_id="g", prompt_ids=[5, 6, 7], response_ids=[], rollout_logprobs=[], versions=[]
    )
    kw = dict(response_ids=res.response_ids, rollout_logprobs=res.logprobs, versions=res.versions)
    s = fill_response(msgspec.structs.replace(blank), **kw, routed_experts=res.routed_experts)
    s.validate()
    assert np.array_equal(s.array("routed_experts"), res.routed_experts.reshape(-1))
    # rows that do not cover prompt + response - 1 positions (a truncated response) are dropped, not kept
    cut = fill_response(msgspec.structs.replace(blank), **kw, routed_experts=res.routed_experts[:-1])
    assert cut.routed_experts == b""


# -- 2. Sample, Arrow, buffer validation, segments --------------------------------------------------
def _routed_sample(uid, plen, rlen, width=2 * K, seed=0, rows=None, **kw):
    rng = np.random.default_rng(seed)
    n = plen + rlen - 1 if rows is None else rows
    return Sample.build(
        uid=uid,
        group_id=kw.pop("group_id", "g"),
        prompt_ids=rng.integers(0, 512, plen),
        response_ids=rng.integers(0, 512, rlen),
        rollout_logprobs=-rng.uniform(0.1, 3.0, rlen),
        versions=np.zeros(rlen, np.int32),
        routed_experts=rng.integers(0, E, (n, width)).astype(np.int16),
        created_at=1.0,
        **kw,
    )


def test_routed_experts_round_trip_and_wrong_rows_are_refused():
    from buffer.validate import check_batch
    from buffer.wire import ProtocolError

    a = _routed_sample("a", 5, 4, group_size=2, group_index=0)
    b = msgspec.structs.replace(_routed_sample("b", 5, 3, group_size=2, group_index=1), routed_experts=b"")
    c = _routed_sample("c", 3, 6, group_id="h", seed=2)
    for s in (a, b, c):
        s.validate()
    batch = samples_to_batch([a, b, c])
    check_batch(batch)
    assert batch.column("routed_experts").type == pa.list_(pa.int16())
    assert [len(x) for x in batch.column("routed_experts").to_pylist()] == [8 * 4, 0, 8 * 4]
    assert batch_to_samples(batch) == [a, b, c]
    assert batch_to_samples(batch.slice(1, 2)) == [b, c]  # sliced columns keep their rows

    # 9 rows of 4 for 10 positions (prompt 6 + response 5 - 1): not whole rows
    short = _routed_sample("short", 6, 5, rows=9)
    with pytest.raises(ValueError, match="short: routed_experts has 36 entries"):
        short.validate()
    with pytest.raises(ProtocolError, match="short: routed_experts has 36 entries") as e:
        check_batch(samples_to_batch([a, short]))
    assert e.value.category == "invalid_sample"
    # a recording for a sample with no position to forward (one prompt token, no response)
    empty = msgspec.structs.replace(
        _routed_sample("empty", 1, 0, rows=1),
        response_ids=b"",
        rollout_logprobs=b"",
        versions=b"",
        loss_mask=b"",
    )
    with pytest.raises(ProtocolError, match="empty: routed_experts"):
        check_batch(samples_to_batch([empty]))
    # an odd number of bytes is not int16 values
    odd = msgspec.structs.replace(a, uid="odd", routed_experts=a.routed_experts[:-1])
    with pytest.raises(ValueError, match="odd: routed_experts has 63 bytes"):
        samples_to_batch([odd])
    negative = _routed_sample("neg", 4, 2)
    negative = msgspec.structs.replace(negative, routed_experts=(-negative.array("routed_experts")).tobytes())
    with pytest.raises(ProtocolError, match="neg: routed_experts holds -"):
        check_batch(samples_to_batch([a, negative]))


def _legacy(batch: pa.RecordBatch) -> pa.RecordBatch:
    schema = LEGACY_SCHEMAS[0]
    return pa.RecordBatch.from_arrays([batch.column(f.name) for f in schema], schema=schema)


def _write_segment(path, batches, schema):
    from buffer.segments import batch_crc

    with pa.OSFile(str(path), "wb") as sink:
        writer = pa.ipc.new_stream(sink, schema)
        for b in batches:
            writer.write_batch(b, custom_metadata={"crc32": str(batch_crc(b))})


def test_a_segment_without_the_column_reads_back_whole(tmp_path):
    """A segment written before routing replay (no routed_experts column, its own checksums) is read as
    ARROW_SCHEMA with every value kept and no recordings; a buffer restarted over it serves those samples
    next to new ones that carry recordings."""
    from buffer.config import BufferConfig
    from buffer.segments import read_segment
    from buffer.storage import Buffer
    from buffer.validate import check_batch
    from stages.trainer.testing import make_samples

    assert "routed_experts" not in LEGACY_SCHEMAS[0].names
    old = [make_samples(2, 2, seed=1, prefix="a"), make_samples(1, 2, seed=2, prefix="b")]
    _write_segment(
        tmp_path / "seg-000001.arrow", [_legacy(samples_to_batch(s)) for s in old], LEGACY_SCHEMAS[0]
    )
    got, rep = read_segment(tmp_path / "seg-000001.arrow")
    assert rep.problem == "" and rep.batches == 2 and rep.rows == 6 and rep.torn_bytes == 0
    for batch, samples in zip(got, old):
        assert batch.schema.equals(ARROW_SCHEMA)
        check_batch(batch)
        assert batch.column("routed_experts").to_pylist() == [[]] * len(samples)
        assert batch_to_samples(batch) == samples
        assert batch.equals(samples_to_batch(samples))

    buf = Buffer(msgspec.convert({}, BufferConfig), tmp_path)
    new = [
        _routed_sample(f"n{i}", 4, 3, group_id="new", group_size=2, group_index=i, seed=i) for i in range(2)
    ]
    assert buf.insert(new).n_new == 2
    out = buf.fetch(4, version=0, max_staleness=0).batch
    assert {s.uid: s for s in batch_to_samples(out)} == {s.uid: s for s in old[0] + old[1] + new}
    buf.close()


def test_replay_source_reads_a_directory_of_old_and_new_segments(tmp_path):
    from buffer.record import samples_to_batch
    from stages.trainer.replay import ReplaySource
    from stages.trainer.testing import make_samples

    old = samples_to_batch(make_samples(1, 2, seed=1, prefix="a"))
    _write_segment(tmp_path / "seg-000001.arrow", [_legacy(old)], LEGACY_SCHEMAS[0])
    new = samples_to_batch(
        [_routed_sample(f"n{i}", 4, 3, group_id="new", group_size=2, group_index=i) for i in range(2)]
    )
    _write_segment(tmp_path / "seg-000002.arrow", [new], ARROW_SCHEMA)
    assert ReplaySource(str(tmp_path)).stats()["groups"] == 2


# -- packing: the rows land at their positions -------------------------------------------------------
@pytest.mark.parametrize("packed_row", [False, True], ids=["rows", "packed-row"])
def test_pack_lays_routed_rows_at_their_positions(packed_row):
    """Each recorded row lands at the position _build puts its token (row r of sample i: the input
    position of token r of prompt + response); padding and a sample without a recording get -1. A
    recording of another model's width is refused naming routed_experts."""
    from stages.trainer.packing import pack, to_token_batch

    rng = np.random.default_rng(0)
    samples = []
    for i, (plen, rlen) in enumerate([(3, 5), (6, 2), (4, 9), (2, 3), (5, 5)]):
        n = plen + rlen - 1
        ids = (1000 * i + np.arange(n)).repeat(2 * K).reshape(n, 2 * K)  # sample and row, readable back
        samples.append(
            Sample.build(
                uid=f"s{i}",
                group_id="g",
                group_index=i,
                group_size=5,
                prompt_ids=rng.integers(0, 512, plen),
                response_ids=rng.integers(0, 512, rlen),
                rollout_logprobs=np.full(rlen, -1.0),
                versions=np.zeros(rlen),
                routed_experts=None if i == 3 else ids,
            )
        )
    tb = to_token_batch(samples_to_batch(samples))
    budget = 24 if packed_row else 40  # 2 micro-batches; the rows layout puts 2 rows in one
    mbs = pack(tb, list(range(5)), budget, packed_row=packed_row, routed_shape=(2, K))
    assert len(mbs) == 2 and (packed_row or any(mb.tokens.shape[0] > 1 for mb in mbs))
    seen, unrecorded = set(), 0
    for mb in mbs:
        assert mb.routed.shape == (*mb.tokens.shape, 2, K) and mb.routed.dtype == torch.int16
        flat = mb.routed.reshape(-1, 2 * K).long()
        assert (flat == flat[:, :1]).all()
        code = flat[:, 0]
        pad = mb.segments.reshape(-1) < 0
        assert (code[pad] == -1).all()
        for pos, tok in zip(mb.resp_pos.tolist(), mb.tok_index.tolist()):
            i = int(tb.seq[tok])
            j = tok - int(tb.response_off[i])
            plen = int(tb.prompt_off[i + 1] - tb.prompt_off[i])
            assert code[pos] == (-1 if i == 3 else 1000 * i + plen - 1 + j), (i, j)
            seen.add(i)
        # every real position holds a row of the sample whose token is there
        tokens = mb.tokens.reshape(-1)
        for pos in (~pad).nonzero()[:, 0].tolist():
            if code[pos] >= 0:
                i, r = divmod(int(code[pos]), 1000)
                full = np.concatenate([samples[i].array("prompt_ids"), samples[i].array("response_ids")])
                assert tokens[pos] == full[r]
            unrecorded += int(code[pos] < 0)
    assert seen == set(range(5)) and unrecorded == 2 + 3 - 1  # sample 3's positions only
    with pytest.raises(
        ValueError, match=r"routed_experts holds \d+ expert ids for \d+ positions.*needs 8 per"
    ):
        pack(tb, list(range(5)), budget, packed_row=packed_row, routed_shape=(2, 4))


# -- the replay hook itself, on megatron's routing function -------------------------------------------
@pytest.mark.parametrize("pre_softmax", [False, True], ids=["softmax-topk", "pre-softmax"])
def test_replay_target_routes_recorded_rows_and_counts_agreement(pre_softmax):
    """megatron's topk routing with a ReplayTarget: recorded rows go to the recorded experts with the
    score function's weights at them (softmax over the k gathered logits, or the full softmax's values),
    -1 rows route themselves; recorded/agreed count the rows and those where the own choice was the same."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from stages.trainer.routing_replay import ReplayTarget

    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(0))
    own = logits.topk(K, -1).indices
    target = ReplayTarget()
    target.target = torch.tensor([[1, 0], [3, 2], [-1, -1], [0, 3], [-1, -1], [2, 1]], dtype=torch.int16)
    target.target[0] = own[0].flip(0)  # the same set in another order agrees
    probs, routing_map = topk_routing_with_score_function(
        logits, K, use_pre_softmax=pre_softmax, router_replay=target
    )
    for t in range(6):
        want = own[t] if target.target[t, 0] < 0 else target.target[t].long()
        assert set(routing_map[t].nonzero()[:, 0].tolist()) == set(want.tolist())
        gathered = logits[t, want]
        w = torch.softmax(logits[t], -1)[want] if pre_softmax else torch.softmax(gathered, -1)
        assert torch.allclose(probs[t, want], w, atol=1e-6)
    agreed = sum(
        set(target.target[t].tolist()) == set(own[t].tolist()) for t in range(6) if target.target[t, 0] >= 0
    )
    assert (int(target.recorded), int(target.agreed)) == (4, agreed) and agreed >= 1
    target.target = None  # nothing set: megatron's own top-k, untouched
    probs2, map2 = topk_routing_with_score_function(
        logits, K, use_pre_softmax=pre_softmax, router_replay=target
    )
    assert set(map(tuple, map2.nonzero().tolist())) == {(t, e) for t in range(6) for e in own[t].tolist()}


# -- 3. the trainer's replayed forward ------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_batch(moe_path):
    """3 groups of 2 from the recording torch engine (prompts of 3, 9 and 5 tokens)."""
    from stages.rollout.engine import GenRequest, SamplingParams
    from stages.rollout.hooks import fill_response

    prompts = [p for p in _prompts((3, 9, 5), seed=4) for _ in range(2)]
    requests = [
        GenRequest(prompt_ids=p, params=SamplingParams(max_new_tokens=3 + 2 * i, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    results, _ = _generate(moe_path, requests, chunk_tokens=3, max_batch_size=4, seed=7)
    samples = []
    for i, (p, res) in enumerate(zip(prompts, results)):
        s = Sample.build(
            uid=f"e{i}",
            group_id=f"g{i // 2}",
            group_index=i % 2,
            group_size=2,
            reward=float(i % 2),
            prompt_ids=p,
            response_ids=[],
            rollout_logprobs=[],
            versions=[],
        )
        kw = dict(rollout_logprobs=res.logprobs, versions=res.versions, routed_experts=res.routed_experts)
        samples.append(fill_response(s, response_ids=res.response_ids, **kw))
        assert s.routed_experts
    return samples


def test_replaying_the_engines_routing_gives_its_logprobs(moe_path, engine_batch, tmp_path):
    from stages.trainer.packing import to_token_batch

    batch = samples_to_batch(engine_batch)
    tr = _trainer(moe_path, tmp_path / "run")
    tb = to_token_batch(batch)
    positions = sum(s.prompt_len + s.response_len - 1 for s in engine_batch)
    lp = tr.backend.logprobs(tb, tr.backend.pack(tb, list(range(tb.n))))
    assert (lp - tb.rollout_logprobs).abs().max().item() <= 2e-5
    assert tr.backend.replay.metrics() == {"routing/replayed": 2.0 * positions, "routing/agreement": 1.0}
    assert all(t.target is None for _, t in tr.backend.replay.routers)  # no stale targets after the schedule

    m = tr.train_on_batch(batch)  # separate logp_old pass + the training forward, both replayed
    assert m["routing/replayed"] == 2 * 2.0 * positions and m["routing/agreement"] == 1.0
    assert m["logp/same_version_tokens"] == len(tb.rollout_logprobs)
    assert m["logp/abs_diff_same_version"] <= 1e-5


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm-topk", "softmax-topk"])
def test_replaying_altered_routing_matches_forced_hf_forward(tmp_path, norm_topk_prob):
    """Recordings of other experts than the router's own (each id + 1 mod E, for 5 of 6 samples): the
    trainer's logprobs are transformers' with its routers forced to those experts (and weighted as
    Qwen3-MoE weights them), far from the unreplayed ones; the sample without a recording routes itself.
    Layer 0 sees the same hidden states as the recording: its own choice never agrees with a shifted one."""
    from stages.trainer.packing import to_token_batch
    from stages.trainer.testing import make_samples

    path = make_tiny(str(tmp_path / "moe"), "qwen3_moe", norm_topk_prob=norm_topk_prob)
    hf = _load_hf(path)
    samples = make_samples(3, 2, seed=5, prompt_len=(3, 9), response_len=(2, 10))
    altered = []
    for i, s in enumerate(samples):
        p, r = s.array("prompt_ids").tolist(), s.array("response_ids").tolist()
        own = _hf_routing(hf, p + r[:-1])
        rows = None if i == 2 else ((own + 1) % E).reshape(len(own), -1).to(torch.int16).numpy()
        altered.append(msgspec.structs.replace(s, routed_experts=b"" if rows is None else rows.tobytes()))
    unreplayed = [
        _hf_logprobs(hf, s.array("prompt_ids").tolist(), s.array("response_ids").tolist()) for s in samples
    ]
    forced = _force_routing(hf)
    reference = []
    for s in altered:
        p, r = s.array("prompt_ids").tolist(), s.array("response_ids").tolist()
        forced.clear()
        if s.routed_experts:
            rows = torch.from_numpy(s.array("routed_experts").astype(np.int64)).view(
                len(p) + len(r) - 1, 2, K
            )
            forced.update({layer: rows[:, layer] for layer in range(2)})
        reference.append(_hf_logprobs(hf, p, r))

    tr = _trainer(path, tmp_path / "run")
    tb = to_token_batch(samples_to_batch(altered))
    lp = tr.backend.logprobs(tb, tr.backend.pack(tb, list(range(tb.n)))).double()
    per_sample = list(lp.split(np.diff(tb.response_off).tolist()))
    for i, (got, ref, own) in enumerate(zip(per_sample, reference, unreplayed)):
        assert (got - ref).abs().max().item() <= 5e-5, i
        if i == 2:  # no recording: the router's own choice, the plain forward's logprobs
            assert (got - own).abs().max().item() <= 5e-5
    moved = torch.cat(
        [(got - own).abs() for i, (got, own) in enumerate(zip(per_sample, unreplayed)) if i != 2]
    )
    assert moved.max().item() > 0.1, "replaying other experts left the logprobs as they were"
    (l0, t0), (l1, t1) = sorted(tr.backend.replay.routers, key=lambda x: x[0])
    recorded = sum(s.prompt_len + s.response_len - 1 for i, s in enumerate(altered) if i != 2)
    assert int(t0.recorded) == int(t1.recorded) == recorded
    assert int(t0.agreed) == 0
    m = tr.backend.replay.metrics()
    assert m["routing/replayed"] == 2.0 * recorded and m["routing/agreement"] < 1.0


def test_expert_ids_past_the_model_are_refused(moe_path, engine_batch, tmp_path):
    from stages.trainer.packing import to_token_batch

    bad = [
        msgspec.structs.replace(s, routed_experts=(s.array("routed_experts") + E).astype(np.int16).tobytes())
        for s in engine_batch
    ]
    tr = _trainer(moe_path, tmp_path / "run")
    with pytest.raises(ValueError, match="routed_experts names expert [4-7], but this model has 4 experts"):
        tr.train_on_batch(samples_to_batch(bad))
    short = [msgspec.structs.replace(s, routed_experts=s.routed_experts[: -2 * 4]) for s in engine_batch]
    with pytest.raises(ValueError, match="routed_experts holds .* expert ids for .* positions"):
        tr.backend.replay.check_batch(to_token_batch(samples_to_batch(short)))


# -- 4. dense models ---------------------------------------------------------------------------------
def test_routing_replay_on_a_dense_model_fails_naming_it(tmp_path):
    from stages.rollout.routing import RoutingRows
    from stages.rollout.torch_engine import TorchEngine
    from stages.trainer.testing import make_tiny_hf

    dense = make_tiny_hf(str(tmp_path / "dense"), "qwen2")
    with pytest.raises(ValueError, match="routing_replay.*dense model"):
        _trainer(dense, tmp_path / "run")
    with pytest.raises(ValueError, match="routing_replay"):
        TorchEngine(dense, record_routing=True)
    with pytest.raises(ValueError, match="routing_replay"):
        RoutingRows.of_model(dense)


# -- SGLang's rows --------------------------------------------------------------------------------------
def test_sglang_rows_keep_the_moe_layers(tmp_path):
    """SGLang returns base64 int32 [positions, num_hidden_layers, k] (dense layers included): decode keeps
    the MoE layers' ids, layer-major, as int16; a payload of another shape is refused."""
    from stages.rollout.routing import RoutingRows

    (tmp_path / "config.json").write_text(
        json.dumps(
            dict(
                model_type="qwen3_moe",
                num_hidden_layers=3,
                mlp_only_layers=[1],
                num_experts=8,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
            )
        )
    )
    rows = RoutingRows.of_model(tmp_path)
    assert rows == RoutingRows(layers=3, moe_layers=(0, 2), top_k=2)
    ids = np.arange(5 * 3 * 2, dtype="<i4").reshape(5, 3, 2) % 8
    ids[:, 1] = -1  # SGLang's filler for a dense layer
    got = rows.decode(base64.b64encode(ids.tobytes()).decode())
    assert got.dtype == np.int16 and np.array_equal(got, ids[:, [0, 2]].reshape(5, 4))
    with pytest.raises(ValueError, match="not whole rows of 3 layers x top-2"):
        rows.decode(base64.b64encode(ids.tobytes()[:-4]).decode())


def test_perf_counts_the_active_parameters_of_an_moe_model(moe_path, tmp_path):
    """perf/tflops of an MoE model uses the parameters a token runs through: everything but the experts,
    plus top_k / num_experts of the experts (the dense count would overstate it E/k-fold there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hc = AutoConfig.from_pretrained(moe_path)
    hf = AutoModelForCausalLM.from_pretrained(moe_path)
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in hf.named_parameters() if ".experts." not in n)
    want = dense + experts * hc.num_experts_per_tok // hc.num_experts
    got = _trainer(moe_path, tmp_path / "run", routing_replay=False).backend.active_params()
    assert got == pytest.approx(want, rel=0.01)  # megatron pads the vocabulary a little
    assert got < dense + experts
