"""promql_check.py's expositions: a page that is not one is named, not read as bad labels."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tools.observability.promql_check import main


class _Refusing(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"error": {"message": "invalid API key"}}'
        self.send_response(401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def _run(capsys: pytest.CaptureFixture[str], *expositions: str) -> str:
    argv = ["--prometheus", "http://127.0.0.1:1", "--fleet", "f", "--engines", "e0"]
    for url in expositions:
        argv += ["--exposition", url]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_a_protected_page_is_named_with_its_status(
    refusing: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _run(capsys, refusing)
    assert f"--exposition {refusing}: HTTP 401" in err and "--protect-metrics" in err
    assert "Traceback" not in err


def test_a_saved_page_that_is_not_there_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _run(capsys, f"file://{tmp_path / 'none.txt'}")
    assert f"--exposition file://{tmp_path / 'none.txt'}: No such file" in err
