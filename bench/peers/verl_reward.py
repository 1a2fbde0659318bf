"""slipstream's `math` reward (stages/reward/builtin.py: math_answer) as a verl custom reward function:
    reward.custom_reward_function.path=bench/peers/verl_reward.py reward.custom_reward_function.name=compute_score

verl 0.9.1's reward loop calls compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=...) with the response decoded with skip_special_tokens=True; slipstream keeps special tokens
inside a response (drops only the final stop token). The math reward reads the \\boxed{} content, else
the text after '####', else the last number, so the two decodings score alike unless a special token
holds digits (none of SmolLM2's or Qwen2.5's do).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

# verl loads this file by path inside its reward workers (Ray actors), whose sys.path need not hold
# the repository; appended, not prepended, so nothing of verl's is shadowed
_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:
    sys.path.append(_REPO)

from stages.reward.builtin import math_answer  # noqa: E402


def compute_score(data_source=None, solution_str="", ground_truth="", extra_info=None, **kwargs) -> float:
    """1.0 when the response's answer equals the ground truth (numbers compared exactly), else 0.0."""
    # math_answer reads only the sample's label
    return math_answer(SimpleNamespace(label=str(ground_truth)), solution_str or "")
