"""SFT rows in the RL step (issue #41: slime's SFT loss and step_loss_mask, trainer.loss.sft_coef with
trainer.sft): which tokens of a conversation are trained, which rows each step takes, the loss term, and a
trainer whose steps lower the NLL of its SFT conversations while its RL metrics stay the RL samples'."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from stages.trainer.config import LossConfig
from stages.trainer.losses import policy_loss
from stages.trainer.sft import SftData, SftDataError, tokenize_conversation
from stages.trainer.sft_config import SftConfig

CONVERSATION = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "12+3"},
    {"role": "assistant", "content": "15"},
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": "ab", "step_loss_mask": 0},
    {"role": "user", "content": "y"},
    {"role": "assistant", "content": "cd"},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The random tiny-qwen2 (byte tokenizer with a chat template) and its tokenizer."""
    from stages.models import load_tokenizer, resolve_model

    cache = tmp_path_factory.mktemp("models")
    path = resolve_model(SimpleNamespace(name="tiny-qwen2-random", cache_dir=str(cache)))
    return str(path), load_tokenizer(path)


def _write(path, conversations):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return str(path)


def test_a_conversation_trains_its_assistant_turns_and_their_end_of_turn_but_no_other_text(tiny):
    _, tok = tiny
    prompt, response, mask = tokenize_conversation(tok, CONVERSATION, "test")
    assert tok.decode(prompt) == "<|im_start|>system\ns<|im_end|><|im_start|>12+3<|im_end|><|im_start|>"
    trained = "".join(tok.decode([t]) if m else " " for t, m in zip(response, mask))
    # "15" and "cd" with their end of turn; "ab" (step_loss_mask 0) and the user turns are context only
    assert trained.split() == ["15<|im_end|>", "cd<|im_end|>"]
    assert tok.decode(prompt + response) == tok.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in CONVERSATION], tokenize=False
    )


def test_each_pass_takes_every_conversation_once_and_every_rank_the_same_rows(tiny, tmp_path):
    _, tok = tiny
    convs = [
        [{"role": "user", "content": str(i)}, {"role": "assistant", "content": "a" * (i + 1)}]
        for i in range(5)
    ]
    cfg = SftConfig(source=_write(tmp_path / "sft.jsonl", convs), samples_per_step=2, seed=3)
    a, b = SftData(cfg, tok), SftData(cfg, tok)
    walk = [i for step in range(10) for i in a.indices(step)]  # 20 rows: four passes over five
    assert walk == [i for step in range(10) for i in b.indices(step)]
    passes = [walk[k : k + 5] for k in range(0, 20, 5)]
    assert all(sorted(p) == list(range(5)) for p in passes)
    assert len({tuple(p) for p in passes}) > 1  # each pass in its own order
    batch = a.batch(step=4, version=7)
    assert batch.num_rows == 2 and batch.column("uid").to_pylist()[0].startswith("sft-4-")


def test_the_sft_term_is_their_token_nll_in_one_mean_with_the_rl_tokens():
    torch.manual_seed(0)
    t = 10
    logp = (-torch.rand(t) * 3).requires_grad_()
    old, rollout, adv = logp.detach().clone(), logp.detach().clone(), torch.randn(t)
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    rl = torch.tensor([1.0] * 6 + [0.0] * 4)
    sft = torch.tensor([0.0] * 6 + [1.0, 1.0, 0.0, 1.0])  # sample 2 is an SFT row; one token context only
    cfg = LossConfig(sft_coef=0.5, aggregation="token")
    num_rl, den_rl, _ = policy_loss(logp, old, rollout, adv, rl, seq, 3, cfg)
    num, den, st = policy_loss(logp, old, rollout, adv, rl, seq, 3, cfg, sft_mask=sft)
    nll = -(logp * sft).sum()
    assert float(den) == float(den_rl) + 3
    assert float(num) == pytest.approx(float(num_rl) + 0.5 * float(nll))
    assert float(st["sum/sft_nll"]) == pytest.approx(float(nll)) and float(st["sum/sft_tokens"]) == 3
    assert float(st["sum/tokens"]) == 6  # the RL statistics stay the RL tokens'
    (num / den).backward()
    assert torch.allclose(
        logp.grad[6:], -0.5 * sft[6:] / float(den)
    )  # raising an SFT token's logp lowers the loss


def test_a_trainer_lowers_the_nll_of_its_sft_rows_and_reports_rl_metrics_of_the_rl_samples(tiny, tmp_path):
    from trainer_setup import make_trainer

    from buffer.record import samples_to_batch
    from pipeline.config import RunConfig
    from stages.trainer.packing import to_token_batch
    from stages.trainer.testing import ListSource, make_samples

    path, _ = tiny
    batches = []
    for step in range(4):  # equal rewards in every group: advantages of 0, no RL gradient at all
        samples = make_samples(2, 4, vocab=256, seed=step)
        for s in samples:
            s.reward = 1.0
        batches.append(samples_to_batch(samples))
    cfg = RunConfig()
    cfg.trainer.batch_groups, cfg.trainer.lr = 2, 3e-3
    cfg.trainer.loss.sft_coef = 1.0
    cfg.trainer.sft = SftConfig(source=_write(tmp_path / "sft.jsonl", [CONVERSATION]), samples_per_step=2)
    tr = make_trainer(cfg, ListSource(batches), path, str(tmp_path / "run"))
    metrics = [tr.step() for _ in range(4)]
    tr.close()
    nll = [m["sft/nll"] for m in metrics]
    assert nll[-1] < nll[0] - 0.1, nll
    tb = to_token_batch(batches[0])
    first = metrics[0]
    assert first["samples"] == 8 and first["sft/samples"] == 2 and first["sft/tokens"] == 2 * 6
    assert first["tokens/trained"] == float(tb.mask.sum())  # the SFT tokens are not RL tokens
    assert first["reward/mean"] == 1.0  # the RL rows' rewards only (an SFT row has none)


@pytest.mark.parametrize(
    "sft, coef, match",
    [
        ({"source": "x.jsonl", "samples_per_step": 2}, 0.0, "sft_coef > 0"),
        ({}, 0.5, "trainer.sft.source"),
        ({"source": "x.jsonl"}, 0.5, "samples_per_step >= 1"),
        ({}, -1.0, "sft_coef=-1.0: must be >= 0"),
    ],
)
def test_sft_keys_that_cannot_work_together_are_refused_by_name(sft, coef, match):
    import msgspec

    from pipeline.config import RunConfig

    raw = msgspec.to_builtins(RunConfig())
    raw["trainer"]["sft"], raw["trainer"]["loss"]["sft_coef"] = sft, coef
    with pytest.raises((ValueError, msgspec.ValidationError), match=match):
        msgspec.convert(raw, RunConfig)


def test_a_conversation_with_nothing_to_train_or_a_broken_line_is_named(tiny, tmp_path):
    _, tok = tiny
    bad = _write(
        tmp_path / "none.jsonl",
        [[{"role": "user", "content": "1"}, {"role": "assistant", "content": "2", "step_loss_mask": 0}]],
    )
    with pytest.raises(SftDataError, match="row 0: no assistant turn to train on"):
        SftData(SftConfig(source=bad, samples_per_step=1), tok)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"messages": []}\n{not json\n')
    with pytest.raises(SftDataError, match="broken.jsonl:2: not JSON"):
        SftData(SftConfig(source=str(broken), samples_per_step=1), tok)


def test_each_update_of_a_batch_trains_its_share_of_the_sft_rows():
    """trainer.mini_batches: the SFT rows (at the batch's end) are split over the updates like the RL
    samples, not all left to the last one; without SFT rows the parts are the consecutive slices."""
    from types import SimpleNamespace

    from stages.trainer.packing import mini_batch_parts

    shard = list(range(10))
    tb = SimpleNamespace(sft=torch.tensor([False] * 6 + [True] * 4))
    assert mini_batch_parts(tb, shard, 2) == [[0, 1, 2, 6, 7], [3, 4, 5, 8, 9]]
    assert mini_batch_parts(SimpleNamespace(sft=None), shard, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
