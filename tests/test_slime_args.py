"""A slime command line converts to slipstream's keys (pipeline/slime_args.py, docs/slime.md): the CPU
default written as slime arguments gives the default config and runs; what has no equivalent is named."""

from __future__ import annotations

import msgspec
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.slime_args import SlimeArgsError, to_overrides

# configs/default.yaml as a slime script would say it (with the model-architecture arguments of slime's
# scripts/models/*.sh, which the HF config makes unnecessary)
DEFAULT_AS_SLIME = (
    "--hf-checkpoint tiny-qwen2 --num-layers 2 --hidden-size 64 --swiglu --group-query-attention "
    "--num-query-groups 2 --n-samples-per-prompt 8 --rollout-batch-size 16 --global-batch-size 128 "
    "--rollout-max-response-len 4 --rollout-temperature 1.0 --advantage-estimator grpo --use-kl-loss "
    "--kl-loss-coef 0.2 --kl-loss-type low_var_kl --lr 2e-3 --min-lr 0 --lr-decay-style cosine "
    "--num-rollout 1000 --use-tis --tis-clip 2.0 --eps-clip 0.2 --eps-clip-high 0.28"
).split()


def test_the_default_written_as_slime_arguments_is_the_default_config():
    converted = load_config(None, to_overrides(DEFAULT_AS_SLIME))
    assert msgspec.to_builtins(converted) == msgspec.to_builtins(load_config(None, []))


def test_slime_arguments_reach_their_keys():
    over = to_overrides(
        "--advantage-estimator reinforce_plus_plus --recompute-granularity selective --bf16 --finetune "
        "--load /ckpt --rollout-stop-token-ids 2 7 --sglang-context-length 4096 --n-samples-per-prompt 4 "
        "--rollout-batch-size 8 --global-batch-size 16 --rollout-top-k 20 --rollout-stop </answer> END".split()
    )
    assert set(over) == {
        "trainer.loss.advantage=reinforce_pp",
        "trainer.recompute=true",
        "trainer.recompute_granularity=selective",
        "trainer.precision=bf16",
        "trainer.finetune=true",
        "trainer.load=/ckpt",
        "rollout.sampling.stop_token_ids=[2, 7]",
        "rollout.sampling.top_k=20",
        'rollout.sampling.stop=["</answer>", "END"]',
        'rollout.sglang.extra_args=["--context-length", "4096"]',
        "rollout.group_size=4",
        "trainer.batch_groups=8",
        "trainer.mini_batches=2",  # 8 prompts x 4 samples, 16 per update
    }


@pytest.mark.parametrize(
    "argv,match",
    [
        ("--some-new-flag 3", "no slipstream equivalent known for --some-new-flag"),
        ("--lr", "--lr needs a value"),
        ("--rollout-stop", "--rollout-stop needs a value"),
        ("--rollout-stop-token-ids 2 x", "token ids are integers"),
        ("--rollout-top-k 1.5", "not a int"),
        ("--n-samples-per-prompt 3 --rollout-batch-size 2 --global-batch-size 4", "does not divide"),
    ],
)
def test_what_cannot_be_converted_is_named(argv, match):
    with pytest.raises(SlimeArgsError, match=match):
        to_overrides(argv.split())


@pytest.mark.slow  # 10 s: a whole run; the conversion itself is checked above, the default's run by test_learning
def test_the_converted_default_runs(tmp_path):
    from pipeline.orchestration.launcher import run_pipeline

    cfg = load_config(
        None,
        [*to_overrides(DEFAULT_AS_SLIME), "run.steps=3", f"run.dir={tmp_path}", "metrics.progress=false"],
    )
    res = run_pipeline(cfg)
    assert res.status == "completed", res.error


def test_converted_sampling_knobs_load_and_a_misspelt_sglang_flag_is_named():
    # a stop string with real newlines (a shell's $'\n\n') reaches the config as it was
    cfg = load_config(None, to_overrides(["--rollout-top-k", "20", "--rollout-stop", "</answer>", "\n\n"]))
    assert cfg.rollout.sampling.top_k == 20 and cfg.rollout.sampling.stop == ["</answer>", "\n\n"]
    spec = "--sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 3 --sglang-speculative-eagle-topk 1"
    cfg = load_config(None, to_overrides(spec.split()))
    assert cfg.rollout.sglang.extra_args[:2] == ["--speculative-algorithm", "EAGLE"]
    with pytest.raises(ConfigError, match="did you mean --speculative-num-steps"):
        load_config(None, to_overrides(["--sglang-speculative-num-step", "3"]))
