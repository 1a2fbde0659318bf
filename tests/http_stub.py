"""A JSON-answering request handler for the tests' stub SGLang servers (in-process and in child
processes: this module needs nothing but the standard library)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JsonHandler(BaseHTTPRequestHandler):
    """Subclasses write do_GET / do_POST and answer with `_answer(obj)`; requests are not logged."""

    def _answer(self, obj: dict) -> None:
        out = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass
