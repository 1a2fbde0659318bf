"""Synthetic samples and a small producer/consumer demo that drives a live buffer from the shell.

`synthetic_samples` is also what the tests and benchmarks feed the buffer.
"""

from __future__ import annotations

import time

import numpy as np

from buffer.record import Sample


def synthetic_samples(
    num_groups: int,
    group_size: int = 4,
    response_len: int = 64,
    prompt_len: int = 16,
    version: int = 0,
    prefix: str = "s",
    seed: int = 0,
) -> list[Sample]:
    """num_groups complete groups of random samples; uids are f"{prefix}-{group}-{index}"."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 32000, prompt_len, dtype=np.int32).tobytes()
    out = []
    for g in range(num_groups):
        for i in range(group_size):
            ids = rng.integers(0, 32000, response_len, dtype=np.int32)
            out.append(
                Sample(
                    uid=f"{prefix}-{g}-{i}",
                    group_id=f"{prefix}-{g}",
                    group_index=i,
                    group_size=group_size,
                    prompt_ids=prompt,
                    response_ids=ids.tobytes(),
                    rollout_logprobs=(-rng.random(response_len, dtype=np.float32)).tobytes(),
                    versions=np.full(response_len, version, dtype=np.int32).tobytes(),
                    loss_mask=np.ones(response_len, dtype=np.uint8).tobytes(),
                    reward=float(rng.random()),
                    reward_parts={"correct": float(i % 2)},
                    prompt=f"synthetic prompt {g}",
                    label=str(g),
                    generator_id=prefix,
                    created_at=time.time(),
                    finished_at=time.time(),
                )
            )
    return out


def run_demo(
    address: str, *, groups: int, group_size: int, tokens: int, fetch_groups: int, rounds: int
) -> dict:
    """Produce `rounds` x `groups` groups (version = round), fetching `fetch_groups` after each round."""
    from rich.console import Console

    from buffer.client import BufferClient

    con = Console()
    client = BufferClient(address, producer="demo", timeout_s=30)
    try:
        for r in range(rounds):
            samples = synthetic_samples(
                groups, group_size, tokens, version=r, prefix=f"demo{time.time_ns()}-{r}"
            )
            t = time.perf_counter()
            ack = client.put(samples)
            con.print(
                f"round {r}: put {len(samples)} samples -> accepted {ack.accepted}, duplicates {ack.duplicates} "
                f"({time.perf_counter() - t:.3f}s)"
            )
            client.set_version(r)
            batch = client.fetch(fetch_groups, version=r, max_staleness=1, timeout_s=5)
            got = "nothing (timeout)" if batch is None else f"{batch.num_rows} samples"
            con.print(f"round {r}: fetched {fetch_groups} groups at version {r}: {got}")
        stats = client.stats()
        con.print(stats)
        return stats
    finally:
        client.close()
