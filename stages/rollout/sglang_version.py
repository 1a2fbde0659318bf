"""Which weights an SGLang server serves, as the engine tells its callers: `version` (the generator's
admission and the versions of the tokens it stamps) and the radix cache's namespace of new requests.

A push through the engine itself sets both as it goes (sglang_updates.py); a push the trainer sends to the
server directly (weights.transport nccl / cuda_ipc) is seen by a thread that polls the server's own
`weight_version`. Either way the version may go back: a trainer restarted from an older checkpoint pushes
its version numbers again, and a relaunched server runs an older version until it is caught up.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import stages.weights.sglang_protocol as proto
from stages.rollout.sglang_wire import as_version, cache_namespace

VERSION_POLL_S = 0.5


class SGLangVersion:
    """Mixed into SGLangEngine: expects its cfg (health_timeout_s), url, _proc, _state_lock, _version,
    restarts, versions_went_back and cache_namespace."""

    @property
    def version(self) -> int:
        """The server's weight version. A transport in another process (the trainer's NCCL / CUDA IPC
        sender) updates the server directly, so follow the server's own `weight_version` (a thread asks
        every VERSION_POLL_S; reading this never blocks)."""
        return self._version

    def _follow_version(self, proc: subprocess.Popen) -> None:
        """Thread: poll the server's weight_version while `proc` runs. Kept out of `version` itself,
        which the generator reads inside its event loop: a slow server must not stall every stream.
        A lower version is taken once two polls in a row report it: a restarted trainer resumes from an
        older checkpoint and pushes its versions again (admission re-bases on a version that went back),
        while one lower answer may be a poll that read the server just before this client's own push."""
        before = None  # what the previous poll read
        while self._proc is proc and proc.poll() is None:
            asked_at = self._version
            v = self._server_version()
            with self._state_lock:  # a relaunch may have begun since the server was asked
                if self._version != asked_at:
                    # this client's own push (sglang_updates.py) moved the version while the server was
                    # asked: the answer may predate the push's label, and taken with the previous poll's
                    # equal reading it would send the version straight back (set aside: not the
                    # next poll's `before` either)
                    v = None
                moved = v is not None and (v > self._version or (v < self._version and v == before))
                if moved and self._proc is proc:
                    # pushed by the trainer itself (weights.transport nccl / cuda_ipc): the key moves
                    # only now, so config.py keeps the radix cache to pushes through this client
                    self.cache_namespace = self._cache_key_for(v)
                    self._version = v
            before = v
            time.sleep(VERSION_POLL_S)

    def _cache_key_for(self, version: int) -> str:
        """The prefix-cache namespace of requests that weights `version` will serve, asked before
        `_version` moves to it. A version below the current one opens a new epoch: a trainer resumed from
        an older checkpoint pushes its version numbers again, with weights that differ from the first
        pass's once it trains on other batches, and must not meet KV cached under the same numbers."""
        if version < self._version:
            self.versions_went_back += 1
        return cache_namespace(version, self.cache_epoch)

    @property
    def cache_epoch(self) -> int:
        """The prefix cache's epoch: the server's relaunches plus the times its version went back."""
        return self.restarts + self.versions_went_back

    def _get_json(self, path: str, timeout: float) -> dict | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def _server_version(self) -> int | None:
        info = self._get_json(proto.MODEL_INFO, self.cfg.health_timeout_s)
        stamp = (info or {}).get("weight_version")
        return as_version(stamp, -1) if stamp is not None else None
