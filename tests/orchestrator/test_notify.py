"""Notifications against a real HTTP server on 127.0.0.1 and a real local command."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orchestrator.notify import make_event, notify


@pytest.fixture
def server():
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        status = 200

        def do_POST(self):  # noqa: N802 - http.server API
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append({"path": self.path, "type": self.headers["Content-Type"], "body": json.loads(body)})
            self.send_response(503 if self.path == "/down" else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", received
    httpd.shutdown()
    httpd.server_close()


def crash_event():
    return make_event("crash", "20250611-101512", experiment="exp-ddtree-expanded", message="fx-tracing-race",
                      diagnosis={"signature": "fx-tracing-race", "fix": "one process per GPU"}, exit_code=1)


def test_webhook_receives_the_event(server):
    url, received = server
    outcomes = notify({"webhook": url + "/hook"}, crash_event())
    assert [(o.channel, o.ok) for o in outcomes] == [("webhook", True)]
    assert len(received) == 1 and received[0]["type"] == "application/json"
    body = received[0]["body"]
    assert body["event"] == "crash" and body["run_id"] == "20250611-101512"
    assert body["diagnosis"]["signature"] == "fx-tracing-race" and body["exit_code"] == 1
    assert "fx-tracing-race" in body["text"]


def test_command_gets_the_event_on_stdin(tmp_path):
    out = tmp_path / "event.json"
    script = f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())"
    event = make_event("completion", "r2", message="succeeded")
    outcomes = notify({"command": [sys.executable, "-c", script]}, event)
    assert [(o.channel, o.ok) for o in outcomes] == [("command", True)]
    assert json.loads(out.read_text())["event"] == "completion"


def test_failures_are_reported_not_raised(server, tmp_path):
    url, _ = server
    cfg = {"webhook": url + "/down", "command": [sys.executable, "-c", "import sys; sys.exit('boom')"]}
    outcomes = notify(cfg, make_event("hang", "r3"))
    assert [(o.channel, o.ok) for o in outcomes] == [("webhook", False), ("command", False)]
    assert "503" in outcomes[0].detail and "boom" in outcomes[1].detail
    # Nobody listening, a missing program, and a non-http URL: reported too.
    dead = notify({"webhook": "http://127.0.0.1:9/x", "command": [str(tmp_path / "nope")]}, make_event("regression", "r4"), timeout=2)
    assert [o.ok for o in dead] == [False, False] and "not found" in dead[1].detail
    assert not notify({"webhook": "ftp://x"}, make_event("crash", "r5"))[0].ok
    assert notify({}, make_event("crash", "r6")) == []


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown notification kind"):
        make_event("exploded", "r1")
