"""Calls from the driver to the stages' actors: each waits at most run.timeout_s, and a stage that fails
ends the run with an error that names it (StageFailed), its whole traceback kept in the run directory.

Every other orchestration module (supervisors, healing, the driver) waits on actors through `Calls`,
so that a stage that hangs or dies is reported the same way wherever the driver happened to wait on it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


class StageFailed(RuntimeError):
    """A stage raised; the message names the stage and carries its error."""


def root_error(e: BaseException) -> str:
    """The innermost error of a Ray task failure, without Ray's wrapping."""
    cause = getattr(e, "cause", None)
    if cause is not None and cause is not e:
        return f"{type(cause).__name__}: {cause}"
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


class Calls:
    """ray.get for the driver: the run's timeout on every wait, and StageFailed naming the stage."""

    def __init__(self, run_dir: Path, timeout_s: float):
        self.run_dir, self.timeout_s = run_dir, timeout_s

    def failed(self, what: str, e: BaseException) -> StageFailed:
        """The error that ends the run when a stage failed: its innermost error in the message, and the
        whole of Ray's report (the stage's own traceback: where it raised, which the message leaves
        out) in run_dir/errors/<what>.txt, named in the message."""
        path = self.run_dir / "errors" / f"{what.replace(' ', '-')}.txt"
        try:
            path.parent.mkdir(exist_ok=True)
            path.write_text(str(e) + "\n")
            where = f" (traceback: {path})"
        except OSError:  # a run directory that cannot be written: the message alone
            where = ""
        return StageFailed(f"{what} failed: {root_error(e)}{where}")

    def wait(
        self,
        ref: Any,
        what: str,
        hint: str = "",
        on_death: Callable[[], object] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """ray.get with the run's timeout (or `timeout_s`) and an error that names the stage. `on_death`:
        called instead when the actor's process died (the stage is healed), and the result is None."""
        import ray

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayActorError as e:
            if on_death is None:
                raise self.failed(what, e) from None
            on_death()
            return None
        except ray.exceptions.GetTimeoutError:
            raise StageFailed(
                f"{what} did not answer within "
                + (
                    f"run.timeout_s={timeout_s:.0f}s"
                    if timeout_s == self.timeout_s
                    else f"{timeout_s:.0f}s (run.timeout_s, or cluster.offload.timeout_s + 60 where longer)"
                )
                + (f": {hint}" if hint else "")
            ) from None
        except ray.exceptions.RayError as e:
            raise self.failed(what, e) from None
