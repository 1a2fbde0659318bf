"""A stand-in for `python -m sglang.launch_server` in its own process, on a real port, for the tests of
SGLangEngine's process handling (tests/test_sglang_freeze_gc.py, tests/test_engine_health.py):

    python tests/sglang_standin.py PORT CALLS_FILE HAS_FREEZE PAUSED_FLAG

- every POST's path is appended to CALLS_FILE;
- /freeze_gc answers as SGLang 0.5.17 does (plain text) when HAS_FREEZE is 1, else 404 as an older one;
- /health answers 200, except while the file PAUSED_FLAG exists: SGLang answers /health by generating
  a token, which a server paused for a weight push cannot do, so the answer waits;
- any other GET (/model_info, asked by the engine's version thread) reports weight_version 0."""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    calls_file, has_freeze, paused_flag = "", False, ""

    def log_message(self, *args):
        pass

    def _answer(self, code: int, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/health":
            while os.path.exists(self.paused_flag):
                time.sleep(0.05)
            self._answer(200, "")
        else:
            self._answer(200, json.dumps({"weight_version": "0"}))

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with open(self.calls_file, "a") as f:
            f.write(self.path + "\n")
        if self.path == "/freeze_gc" and self.has_freeze:
            self._answer(200, "Garbage collection frozen.\n")
        elif self.path == "/freeze_gc":
            self._answer(404, json.dumps({"detail": "Not Found"}))
        else:
            self._answer(200, json.dumps({"success": True}))


def command(port: int, calls_file, *, has_freeze: bool = True, paused_flag="") -> list[str]:
    """The command line that starts it (what SGLangEngine._command returns for a real server)."""
    return [
        sys.executable,
        __file__,
        str(port),
        str(calls_file),
        "1" if has_freeze else "0",
        str(paused_flag),
    ]


if __name__ == "__main__":
    port, Handler.calls_file, freeze, Handler.paused_flag = sys.argv[1:5]
    Handler.has_freeze = freeze == "1"
    ThreadingHTTPServer(("127.0.0.1", int(port)), Handler).serve_forever()
