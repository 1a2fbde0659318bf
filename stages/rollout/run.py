"""`RolloutRun`: what the rollout stage takes from the run beyond its own section (`rollout:`, a
RolloutConfig) and the model's (`model:`, stages/models.py's ModelConfig). Whoever starts the stage (the
launcher, `python -m stages.rollout`, a test) fills it in from its own config."""

from __future__ import annotations

from dataclasses import dataclass

from stages.rollout.sglang_lora import LoraServing


@dataclass(frozen=True)
class RolloutRun:
    seed: int = 0  # run.seed: engine sampling seeds and each generator's own random numbers
    # run.max_staleness as the stages run with it (sync mode runs with 0): the most versions a trained
    # token may lag the trainer, which bounds what a generator starts (see generator.py)
    max_staleness: int = 2
    routing_replay: bool = False  # trainer.routing_replay: the engines record each token's experts
    # trainer.lora.push=adapter on SGLang: the servers serve the trainer's adapters (sglang_lora.py)
    lora_serving: LoraServing | None = None
    # trainer.distill.server: the SGLang server of a distillation teacher that scores each sample
    teacher_url: str = ""

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ValueError(f"RolloutRun.max_staleness={self.max_staleness}: must be >= 0")


def lora_serving(
    rank: int, push: str, target_modules: list[str], engine: str, max_staleness: int
) -> LoraServing | None:
    """What SGLang servers need to serve trainer.lora's adapters (trainer.lora.push=adapter), or None.
    A batch may mix the adapters of every version a request still in flight was sent under."""
    if not (rank and push == "adapter" and engine == "sglang"):
        return None
    # a config that names none means trainer.lora's default: every linear
    targets = tuple(target_modules) or ("all",)
    return LoraServing(rank, targets, max_loras_per_batch=max_staleness + 2)


def check_served_teacher(server: str, temperature: float) -> None:
    """A served distillation teacher (trainer.distill.server) is an http(s) URL, and scores at temperature
    1: SGLang's prefill logprobs are not temperature-scaled, while the trainer's are at the sampling one."""
    if server and not server.startswith(("http://", "https://")):
        raise ValueError(
            f"trainer.distill.server={server!r}: an SGLang server's URL, e.g. http://10.0.0.5:30010"
        )
    if server and temperature != 1.0:
        raise ValueError(
            f"trainer.distill.server with rollout.sampling.temperature={temperature}: SGLang scores the "
            "teacher at temperature 1 (its prefill logprobs are not scaled), while the trainer's logprobs "
            "are at the sampling temperature; sample at 1.0, or hold the teacher in the trainer "
            "(distill.teacher without server)"
        )
