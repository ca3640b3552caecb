"""A stand-in OpenAI server that replays a real SGLang 0.5.23 stream, for the tests that need no engine."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar


class StandIn:
    """A stand-in OpenAI server for the tests that need no engine: it replays a real SGLang 0.5.23 stream (from
    tests/data/sglang-0.5.23-cpu) for every POST /v1/completions, a line every `line_delay_s`, and answers the GETs the
    SGLang reader makes with the recorded bodies. With `key` set, every path wants `Authorization: Bearer key`."""

    GETS: ClassVar[dict[str, str]] = {"/v1/models": "v1_models.json", "/get_server_info": "get_server_info.raw.json",
            "/metrics": "metrics_after.txt"}

    def __init__(self, recordings: Path, line_delay_s: float = 0.05, key: str | None = None) -> None:
        self.stream_lines = (recordings / "v1_completions_stream.sse.txt").read_bytes().splitlines(keepends=True)
        self.bodies = {path: (recordings / name).read_bytes() for path, name in self.GETS.items()}
        self.line_delay_s = line_delay_s
        self.key = key
        self.authorizations: list[str | None] = []  # the header of every request, as received
        self.streams_completed = 0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _authorised(self) -> bool:
                header = self.headers.get("Authorization")
                with stand_in._lock:
                    stand_in.authorizations.append(header)
                if stand_in.key is None or header == f"Bearer {stand_in.key}":
                    return True
                self._send(401, b'{"error": {"message": "needs an API key", "code": 401}}')
                return False

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self._authorised():
                    body = stand_in.bodies.get(self.path)
                    self._send(200 if body is not None else 404, body or b"{}")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                if not self._authorised():
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                try:
                    for line in stand_in.stream_lines:
                        time.sleep(stand_in.line_delay_s if line.strip() else 0)
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    return  # the client went away
                with stand_in._lock:
                    stand_in.streams_completed += 1

        return Handler

