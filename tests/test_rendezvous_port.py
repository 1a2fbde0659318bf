"""The trainer group's rendezvous port is picked by rank 0 before its ranks bind it, and another process
may take it in between (CI hit it: `DistNetworkError: ... EADDRINUSE, message: address already in use`
failed a whole run). Such a start is retried on a new port; nothing else is."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from pipeline.orchestration.calls import StageFailed
from pipeline.orchestration.supervisors import RENDEZVOUS_ATTEMPTS, port_taken, retry_if_port_taken

# what the launcher raised in CI, word for word
CI_ERROR = (
    "trainer rank 0 failed: DistNetworkError: The server socket has failed to listen on any local network "
    "address. port: 38957, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
)


def test_the_error_torch_gives_for_a_taken_port_is_recognised():
    """From torch itself, not a copy: rank 0's store on a port another socket holds."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(Exception) as taken:  # noqa: PT011 - whatever torch raises is what gets checked
            dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    assert port_taken(StageFailed(f"trainer rank 0 failed: {taken.value}"))
    assert port_taken(StageFailed(CI_ERROR))
    assert not port_taken(StageFailed("trainer rank 0 failed: CUDA out of memory"))


def test_a_start_whose_port_was_taken_is_retried_and_the_attempt_ended():
    tries, ended = [], []

    def start():
        tries.append(1)
        if len(tries) < RENDEZVOUS_ATTEMPTS:
            raise StageFailed(CI_ERROR)
        return "rank 0"

    assert retry_if_port_taken(start, ended.append) == "rank 0"
    assert len(tries) == RENDEZVOUS_ATTEMPTS and len(ended) == RENDEZVOUS_ATTEMPTS - 1


def test_other_failures_and_the_last_taken_port_are_raised_as_they_came():
    def broken():
        raise StageFailed("trainer rank 0 failed: CUDA out of memory")

    ended = []
    with pytest.raises(StageFailed, match="out of memory"):
        retry_if_port_taken(broken, ended.append)
    assert ended == []  # not retried

    def always_taken():
        raise StageFailed(CI_ERROR)

    with pytest.raises(StageFailed, match="EADDRINUSE"):
        retry_if_port_taken(always_taken, ended.append)
    assert len(ended) == RENDEZVOUS_ATTEMPTS - 1
