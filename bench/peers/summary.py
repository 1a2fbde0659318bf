"""Per-step records of a verl run and of a slipstream run turned into the same figures (issue #43):
samples/s and generated tokens/s per GPU at steady state, seconds per step, the first step at which the
reward's moving average reaches a threshold (and the time and samples it took), the final reward at an
equal number of samples; and the ratio row of slipstream's best mode over the peer's.

verl 0.9.1 logs each training step through its Tracking backends:
  - `file` (verl/utils/tracking.py FileLogger): one JSON line {"step": N, "data": {metric: value}} per
    step, at $VERL_FILE_LOGGER_PATH;
  - `console` (verl/utils/logger/aggregate_logger.py concat_dict_to_str): one line
    "step:N - key:value - key:value ..." with values through pprint.pformat (numpy scalars print as
    "np.float64(0.5)" under numpy 2), prefixed by Ray with "(TaskRunner pid=...) ".
The driver writes verl's console output with the wall-clock time (epoch seconds) in front of each line,
which is where a step's end time comes from; without it, step ends are the running sum of
`timing_s/step`. slipstream's metrics.jsonl has one row per step with its own "time".

Definitions (both frameworks):
  steady state   the steps after the first `skip` (start-up, first weight sync, compilation)
  samples/s      samples of steady steps 2.. over the time from the end of the first steady step to the end
                 of the last; per GPU: over all GPUs the run used (2)
  gen tokens/s   response tokens of the trained samples over the same window (verl: response_length/mean x
                 samples; slipstream: tokens/trained)
  time to reward from the end of step 1 to the end of the first step at which the trailing
                 `window`-step mean reward is >= the threshold (start-up and step 1 excluded: each
                 framework's start-up is reported apart, as startup_s, from the driver's launch time)
  final reward   mean reward of the last `window` steps within the first `equal_samples` samples
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from pathlib import Path

_STEP_LINE = re.compile(r"step:(\d+) - (.*)$")
_TIMESTAMP = re.compile(r"^(\d{9,}\.\d+) ")
_NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")


@dataclasses.dataclass
class Step:
    """One training step as both frameworks record it."""

    step: int
    samples: int
    gen_tokens: float  # response tokens of the step's trained samples
    reward: float | None  # mean reward of the step's samples
    t: float | None = None  # wall-clock end of the step (epoch seconds)
    duration: float | None = None  # the step's own seconds, where the framework logs them


def parse_value(text: str) -> float | None:
    """A console value as pformat wrote it: 3, 0.25, nan, np.float64(0.25), True; None if not a number."""
    s = text.strip()
    m = _NUMPY_SCALAR.match(s)
    if m:
        s = m.group(1)
    if s in ("True", "False"):
        return float(s == "True")
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def verl_console_records(text: str) -> list[tuple[int, dict, float | None]]:
    """(step, metrics, wall time or None) of each verl console step line, in order; lines of other
    kinds (Ray, SGLang, tqdm) are skipped."""
    out = []
    for line in text.splitlines():
        m = _STEP_LINE.search(line)
        if not m:
            continue
        ts = _TIMESTAMP.match(line)
        metrics = {}
        for part in m.group(2).split(" - "):
            key, sep, value = part.partition(":")
            v = parse_value(value) if sep else None
            if v is not None:
                metrics[key.strip()] = v
        out.append((int(m.group(1)), metrics, float(ts.group(1)) if ts else None))
    return out


def _json_objects(text: str):
    """The JSON objects of a JSON-lines text, one per line; torn or non-object lines are skipped (a log
    cut off mid-write ends with one)."""
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            yield row


def verl_file_records(text: str) -> list[tuple[int, dict]]:
    """(step, metrics) of each line of verl's file logger that carries a step (torn lines skipped)."""
    out = []
    for row in _json_objects(text):
        if isinstance(row.get("step"), int) and isinstance(row.get("data"), dict):
            data = {k: float(v) for k, v in row["data"].items() if _finite(v)}
            out.append((row["step"], data))
    return out


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def verl_steps(file_text: str, console_text: str, *, samples_per_step: int) -> list[Step]:
    """verl's training steps: metrics from the file logger (else the console), end times from the
    console's timestamps (else the running sum of timing_s/step after the first timestamped or, lacking
    any, zero). Validation-only lines (no score) are not steps."""
    console = verl_console_records(console_text)
    records = verl_file_records(file_text) or [(s, m) for s, m, _ in console]
    times = {s: t for s, m, t in console if t is not None and _score(m) is not None}
    steps: list[Step] = []
    for step, m in records:
        reward = _score(m)
        if reward is None:
            continue
        duration = m.get("timing_s/step", m.get("perf/time_per_step"))
        steps.append(
            Step(
                step=step,
                samples=samples_per_step,
                gen_tokens=m.get("response_length/mean", 0.0) * samples_per_step,
                reward=reward,
                t=times.get(step),
                duration=duration,
            )
        )
    steps.sort(key=lambda s: s.step)
    _fill_times(steps)
    return steps


def _score(m: dict) -> float | None:
    # critic/score/mean: the reward function's mean over the step's samples (critic/rewards/mean is
    # the same less any KL-in-reward, which is off here)
    return m.get("critic/score/mean", m.get("critic/rewards/mean"))


def _fill_times(steps: list[Step]) -> None:
    """Steps without a wall time get the previous step's end + their own duration."""
    prev = None
    for s in steps:
        if s.t is None:
            if s.duration is None:
                continue
            s.t = (prev if prev is not None else 0.0) + s.duration
        prev = s.t


def slipstream_steps(metrics_text: str) -> list[Step]:
    """slipstream's training steps from its run directory's metrics.jsonl."""
    steps = []
    for r in _json_objects(metrics_text):
        if "reward/mean" not in r or not isinstance(r.get("step"), int):
            continue
        steps.append(
            Step(
                step=r["step"],
                samples=int(r.get("samples", 0)),
                gen_tokens=float(r.get("tokens/trained", 0.0)),
                reward=float(r["reward/mean"]),
                t=float(r["time"]) if _finite(r.get("time")) else None,
                duration=r.get("time/step_s"),
            )
        )
    return sorted(steps, key=lambda s: s.step)


def trailing_mean(xs: list[float], window: int) -> list[float | None]:
    """Mean of the last `window` values at each point; None until `window` values exist (a mean of
    fewer is too noisy to call a crossing)."""
    out: list[float | None] = []
    for i in range(len(xs)):
        out.append(statistics.fmean(xs[i + 1 - window : i + 1]) if i + 1 >= window else None)
    return out


def summarise(
    steps: list[Step],
    *,
    gpus: int,
    threshold: float,
    window: int,
    equal_samples: int,
    launch_t: float | None = None,
    skip: int = 2,
) -> dict:
    """The figures of one run (see the module docstring); raises ValueError when too few steps."""
    timed = [s for s in steps if s.t is not None]
    steady = timed[skip:]
    if len(steady) < 2:
        raise ValueError(
            f"{len(steps)} steps ({len(timed)} timed): need {skip + 2} to measure a steady state"
        )
    span = steady[-1].t - steady[0].t
    samples = sum(s.samples for s in steady[1:])
    tokens = sum(s.gen_tokens for s in steady[1:])
    gaps = [b.t - a.t for a, b in zip(steady, steady[1:])]
    # times summed from step durations start at 0, not at the epoch: no start-up to report then
    launch_t = launch_t if launch_t and timed[0].t > 1e9 else None
    out = {
        "steps": len(steps),
        "samples": sum(s.samples for s in steps),
        "samples_per_s": _r(samples / span) if span > 0 else None,
        "samples_per_s_per_gpu": _r(samples / span / gpus) if span > 0 else None,
        "gen_tokens_per_s_per_gpu": _r(tokens / span / gpus, 1) if span > 0 else None,
        "s_per_step": _r(statistics.median(gaps)),
        "startup_s": _r(timed[0].t - (timed[0].duration or 0.0) - launch_t, 1) if launch_t else None,
        "wall_s": _r(timed[-1].t - launch_t, 1) if launch_t else None,
    }
    return out | reward_figures(
        steps, threshold=threshold, window=window, equal_samples=equal_samples, launch_t=launch_t
    )


def reward_figures(
    steps: list[Step], *, threshold: float, window: int, equal_samples: int, launch_t: float | None
) -> dict:
    """Time, step and samples to the reward threshold; the final reward at `equal_samples` samples."""
    rewarded = [s for s in steps if s.reward is not None]
    ma = trailing_mean([s.reward for s in rewarded], window)
    cross = next((i for i, v in enumerate(ma) if v is not None and v >= threshold), None)
    reached = [v for v in ma if v is not None]
    cum, upto = 0, []
    for s in rewarded:
        cum += s.samples
        if cum > equal_samples:
            break
        upto.append(s)
    out = {
        "reward_threshold": threshold,
        "reward_window": window,
        "reward_first": _r(statistics.fmean(s.reward for s in rewarded[:window])) if rewarded else None,
        "reward_ma_max": _r(max(reached)) if reached else None,
        "equal_samples": equal_samples,
        # a run that stopped short of equal_samples has no final reward to compare
        "final_reward": _r(statistics.fmean(s.reward for s in upto[-window:]))
        if upto and sum(s.samples for s in upto) == equal_samples
        else None,
        "step_to_reward": None,
        "samples_to_reward": None,
        "time_to_reward_s": None,
        "time_to_reward_from_launch_s": None,
    }
    if cross is not None:
        hit, first = rewarded[cross], rewarded[0]
        out["step_to_reward"] = hit.step
        out["samples_to_reward"] = sum(s.samples for s in rewarded[: cross + 1])
        if hit.t is not None and first.t is not None:
            out["time_to_reward_s"] = _r(hit.t - first.t, 1)
            if launch_t:
                out["time_to_reward_from_launch_s"] = _r(hit.t - launch_t, 1)
    return out


def ratio_row(rows: list[dict], *, peer: str) -> dict:
    """slipstream's best mode over the peer's best: samples/s (higher is better) and time to reward
    (lower is better; None unless both reached the threshold)."""

    def best(framework: str, key: str, lower: bool) -> dict | None:
        cands = [r for r in rows if r.get("framework") == framework and r.get(key) is not None]
        return (min if lower else max)(cands, key=lambda r: r[key], default=None)

    out: dict = {"bench": "peers", "peer": peer}
    s, p = best("slipstream", "samples_per_s", False), best(peer, "samples_per_s", False)
    out["samples_per_s_ratio"] = _r(s["samples_per_s"] / p["samples_per_s"], 3) if s and p else None
    out["samples_per_s_modes"] = [s and s["mode"], p and p["mode"]]
    s, p = best("slipstream", "time_to_reward_s", True), best(peer, "time_to_reward_s", True)
    ok = s and p and p["time_to_reward_s"] > 0
    out["time_to_reward_ratio"] = _r(s["time_to_reward_s"] / p["time_to_reward_s"], 3) if ok else None
    out["time_to_reward_modes"] = [s and s["mode"], p and p["mode"]]
    return out


def _r(x: float, nd: int = 4) -> float:
    return round(x, nd)


def read_text(path: str | Path) -> str:
    p = Path(path)
    return p.read_text(errors="replace") if p.exists() else ""
