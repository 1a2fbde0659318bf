"""Built-in reward functions (verifiers). Each takes (sample, response_text, **kwargs) -> float.

`response_text` is the decoded response without its final stop token; special tokens inside it are
kept, so a model cannot pass a verifier by hiding characters behind them.
"""

from __future__ import annotations

import re
from fractions import Fraction

from buffer.record import Sample


def exact_match(sample: Sample, response: str, *, ignore_case: bool = False) -> float:
    """1.0 if the stripped response equals the stripped label."""
    a, b = response.strip(), sample.label.strip()
    if ignore_case:
        a, b = a.lower(), b.lower()
    return float(a == b)


def digit_repeat(sample: Sample, response: str) -> float:
    """1.0 for an exact repeat of the label's digits, else partial credit (below 0.9) from three parts:
    0.5 x (positions that match the label) + 0.2 x (answer characters that are digits), both out of
    the label's length, + 0.2 x (how close the answer's length is to the label's).

    The partial credit is what gives a random tiny model a learning signal from the first step: it
    learns to answer in digits, to stop after as many as it was given, then to copy the right ones."""
    target, got = sample.label, response.strip()
    if got == target:
        return 1.0
    if not target or not got:
        return 0.0
    n = len(target)
    hits = sum(a == b for a, b in zip(got, target))
    digits = sum(c.isdigit() for c in got[:n])
    length = 1.0 - abs(len(got) - n) / max(len(got), n)
    return (0.5 * hits + 0.2 * digits) / n + 0.2 * length


# -- math ---------------------------------------------------------------------------------------------
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces may nest), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_math_answer(text: str) -> str | None:
    """\\boxed{} content if any, else the text after '####' (GSM8K), else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def normalize_math(ans: str) -> str | Fraction:
    """Strip TeX/units noise; numbers (incl. 1,000 / 0.50 / \\frac{1}{2} / 3/4) become Fractions."""
    s = ans.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\[dt]?frac\{([^}]*)\}\{([^}]*)\}", r"(\1)/(\2)", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\left", "").replace("\\right", "")
    s = s.rstrip(".").replace(" ", "")
    plain = s.replace(",", "").replace("(", "").replace(")", "").rstrip("%")
    try:
        return Fraction(plain)
    except (ValueError, ZeroDivisionError):
        return s.lower()


def math_answer(sample: Sample, response: str) -> float:
    """1.0 if the extracted answer equals the label after normalisation (numbers compared exactly)."""
    got = extract_math_answer(response)
    want = extract_math_answer(sample.label) if "####" in sample.label else sample.label
    if got is None or want is None:
        return 0.0
    return float(normalize_math(got) == normalize_math(want))


# -- reasoning-gym --------------------------------------------------------------------------------------
def reasoning_gym_score(sample: Sample, response: str, *, dataset: str = "") -> float:
    """reasoning-gym's own score_answer for the sample's dataset, on the <answer>...</answer> content."""
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    name = dataset or sample.metadata.get("rg_dataset") or sample.metadata.get("source_dataset")
    if not name:
        raise ValueError(
            "reasoning_gym reward: the sample's metadata names no dataset (rg_dataset); "
            "pass reward.kwargs.dataset=<name>"
        )
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    entry = {"question": sample.prompt, "answer": sample.label, "metadata": sample.metadata}
    return float(reasoning_gym.get_score_answer_fn(name)(answer=answer, entry=entry))
