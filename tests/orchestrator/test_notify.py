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
            self.send_response(503 if self.path.startswith("/down") else 200)
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


def test_redacted_urls_keep_only_where_they_go():
    """A webhook's secret (user part, path token, query) never reaches a message."""
    from orchestrator.notify import redact_url

    assert redact_url("https://hooks.slack.com/services/T0/B0/s3cr3t") == "https://hooks.slack.com/..."
    assert redact_url("http://user:pw@10.0.0.5:8080/?token=s3cr3t") == "http://10.0.0.5:8080/..."
    assert redact_url("https://example.org") == "https://example.org"
    assert redact_url("not a url") == "<not a URL>"


def _finished_run(tmp_path, run_id: str, log: str, exit_code: int, notify: str):
    """A finished run in a local target's workdir and an inventory whose notify section is `notify` (YAML)."""
    work = tmp_path / "work" / "runs" / run_id
    work.mkdir(parents=True)
    (work / "run.json").write_text(json.dumps({"experiment": "tiny", "run_id": run_id, "created": run_id}))
    (work / "train.log").write_text(log)
    (work / "exit.json").write_text(json.dumps({"exit_code": exit_code, "signal": None}))
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"notify: {notify}\n"
                   f"targets:\n  local: {{kind: local, workdir: {tmp_path / 'work'}}}\n"
                   "experiments:\n  tiny: {kind: dflash, target: local}\n")
    return inv


def test_a_failed_webhook_prints_one_warning_without_its_secret(tmp_path, server, dflashctl):
    """`logs --follow` of a finished run whose webhook answers 503: the run's outcome and exit code are
    unchanged, and stderr holds exactly one warning naming the channel, the host (not the URL's token) and
    what to check."""
    url, received = server
    inv = _finished_run(tmp_path, "r-ok", "fine\n", 0, f"{{webhook: '{url}/down/s3cr3t-token?key=hunter2'}}")
    res = dflashctl("--inventory", str(inv), "logs", "r-ok", "--follow")
    assert res.returncode == 0, res.stderr
    assert len(received) == 1  # it was sent, and refused
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    host = url.removeprefix("http://")
    assert warnings == [f"warning: the completion notification by webhook failed: http://{host}/... answered "
                        "HTTP 503 Service Unavailable; fix: check the receiving service (notify.webhook)"]
    assert "s3cr3t" not in res.stderr + res.stdout and "hunter2" not in res.stderr + res.stdout


def test_a_failed_command_prints_one_warning(tmp_path, dflashctl):
    """A notify command that is missing: one warning naming it and the fix."""
    missing = tmp_path / "no-such-notifier"
    inv = _finished_run(tmp_path, "r-bad", "ValueError: nope\n", 5, f"{{command: ['{missing}']}}")
    res = dflashctl("--inventory", str(inv), "logs", "r-bad", "--follow")
    assert res.returncode == 1, res.stderr
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: the crash notification by command failed: {str(missing)!r} not found; fix: "
                        "give notify.command an existing program"]
