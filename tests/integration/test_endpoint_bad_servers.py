"""The coherence endpoint backend against hostile or broken servers (real HTTP on loopback): every case ends
in one line and exit 2 within the deadline, never a hang, a traceback or a 77 MB report."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers import ROOT, run

PY = str(ROOT / ".venv/bin/python")
MODELS = json.dumps({"data": [{"id": "m"}]}).encode()


def make_handler(mode: str):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body: bytes, ctype="application/json", length=True):
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            if length:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(MODELS)

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                if mode == "silent":
                    time.sleep(30)
                elif mode == "drip":
                    self.send_response(200)
                    self.end_headers()
                    for _ in range(60):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.5)
                elif mode == "html":
                    self._send(b"<html><body>502 Bad Gateway</body></html>", "text/html")
                elif mode == "huge":
                    self._send(b'{"choices": [{"message": {"content": "' + b"x" * (5 << 20) + b'"}}]}')
                elif mode == "shape":
                    self._send(json.dumps({"choices": []}).encode())
                elif mode == "list":
                    self._send(b"[1, 2, 3]")
                elif mode == "header_drip":  # the status line, then one header byte a second
                    self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                    for _ in range(60):
                        self.wfile.write(b"X")
                        self.wfile.flush()
                        time.sleep(1)
                elif mode == "error_drip":  # an HTTP error whose body drips
                    self.wfile.write(b"HTTP/1.1 500 Oops\r\nContent-Length: 1000\r\n\r\n")
                    for _ in range(60):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(1)
                elif mode == "inf_tokens":
                    self._send(b'{"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 1e999}}')
                elif mode == "neg_tokens":
                    self._send(b'{"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": -5}}')
                elif mode == "nested":
                    self._send(b"[" * 100000)
                elif mode == "bigint":  # past Python's 4300-digit int conversion limit: a ValueError in json.loads
                    self._send(b'{"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": '
                               + b"9" * 5000 + b"}}")
                elif mode == "surrogate":  # half a UTF-16 pair: the report could not be written
                    self._send(b'{"choices": [{"message": {"content": "hi \\ud800 there"}}]}')
            except (BrokenPipeError, ConnectionResetError):
                pass

    return H


@pytest.fixture
def server(request):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(request.param))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize("server,needle", [
    ("silent", "did not answer prompt 1 of 8 in time"),
    ("drip", "did not answer prompt 1 of 8 in time"),
    ("html", "did not answer JSON"),
    ("huge", "sent more than 1048576 bytes"),
    ("shape", "without choices[0].message.content"),
    ("list", "answered list, not a JSON object"),
    ("header_drip", "in time"),
    ("error_drip", "answered HTTP 500"),
    ("inf_tokens", "is not a token count"),
    ("neg_tokens", "is not a token count"),
    ("nested", "did not answer JSON"),
    ("bigint", "did not answer JSON"),  # issue 34: both were tracebacks
    ("surrogate", "answered text that is not valid Unicode (a lone surrogate in the reply to prompt 1)"),
], indirect=["server"])
def test_broken_servers_are_one_line_errors(server, needle, tmp_path, pipeline_env):
    t0 = time.time()
    res = run([PY, "pipeline_coherence_test.py", "m", "--backend", "endpoint", "--endpoint-url", server,
               "--no-wandb", "--timeout", "3", "--deadline", "6", "--output-dir", str(tmp_path)], env=pipeline_env,
              timeout=120)
    assert time.time() - t0 < 30  # the deadline holds wherever the server stalls
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("\n") == 1 and needle in res.stderr, res.stderr
    assert not list(tmp_path.iterdir())  # no report from a broken run


@pytest.mark.parametrize("args,needle", [
    (["--endpoint-url", "file:///etc/passwd"], "must start with http:// or https://"),
    (["--endpoint-url", "http://127.0.0.1:9", "--timeout", "0"], "--timeout must be a positive number"),
    (["--endpoint-url", "http://127.0.0.1:9", "--deadline", "nan"], "--deadline must be a positive number"),
    (["--endpoint-url", "http://[::1"], "is not a valid URL"),
    (["--endpoint-url", "http://"], "has no host"),
    (["--discovery-file", "/tmp"], "is a directory"),
])
def test_bad_endpoint_arguments(args, needle, pipeline_env):
    res = run([PY, "pipeline_coherence_test.py", "m", "--backend", "endpoint", "--no-wandb", *args], env=pipeline_env)
    assert res.returncode == 2 and needle in res.stderr and res.stderr.count("\n") == 1, res.stderr


@pytest.mark.parametrize("content,needle", [
    (b"\xff\xfe\x00", "is not readable text"),
    (b'{"url": 5}', "holds no http(s) URL"),
    (b'{"url": ["http://x"]}', "holds no http(s) URL"),
    (b'{"url": "http://[::1"}', "is not a valid URL"),
])
def test_bad_discovery_files(content, needle, tmp_path, pipeline_env):
    f = tmp_path / "serve.endpoint"
    f.write_bytes(content)
    res = run([PY, "pipeline_coherence_test.py", "m", "--backend", "endpoint", "--discovery-file", str(f),
               "--no-wandb"], env=pipeline_env)
    assert res.returncode == 2 and needle in res.stderr and res.stderr.count("\n") == 1, res.stderr
