"""`harness.load`: the one reader of `hey`'s reports, on a real `hey` run against a server whose answers are known."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.load import parse_hey, start_hey

if shutil.which("hey") is None and not os.environ.get("CI"):
    pytest.skip("needs the hey load generator (apt-get install hey); bin/test installs it", allow_module_level=True)


class EveryThirdRefused(BaseHTTPRequestHandler):
    """200 to two requests in three, 503 to the third: a count the report must give back."""

    count = 0
    lock = threading.Lock()

    def do_GET(self) -> None:
        with self.lock:
            type(self).count += 1
            status = 503 if self.count % 3 == 0 else 200
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    EveryThirdRefused.count = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), EveryThirdRefused)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_a_reports_rate_statuses_and_percentiles_are_read(url: str) -> None:
    out, _ = start_hey(url, 1, 4).communicate()
    result = parse_hey(out, 4, None)
    answered = EveryThirdRefused.count
    assert sum(result.statuses.values()) == answered > 0, out  # every answer counted, by status
    assert result.statuses[503] == answered // 3 and result.ok == answered - answered // 3, out
    assert result.errors == result.statuses[503]  # no transport errors here: the refusals alone
    assert result.requests_per_s > 0 and 0 < result.p50_ms <= result.p90_ms <= result.p99_ms, out
