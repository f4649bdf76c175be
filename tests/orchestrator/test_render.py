"""Every message and table cell is printed as literal text, never rich markup: `[localhost]:2222`, `[rank0]:`
and `filenames=[f]` (and a real-looking `[bold]x[/]`) come out exactly as written, through every renderer:
tables, check statuses, agent events, errors, signature matches, progress lines, and the installed CLI's
doctor, diagnose, launch, status and logs."""

from __future__ import annotations

import json
import textwrap

import pytest

from orchestrator.errors import UserError
from orchestrator.render import console

HOSTPORT, RANK, FILENAMES, BOLD = "[localhost]:2222", "[rank0]:", "filenames=[f]", "[bold]x[/]"
LINE = f"the host key of {HOSTPORT} has CHANGED; {RANK} {FILENAMES} {BOLD}"


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # rich reads it when a Console is made: no wrapping of long lines


def test_table_title_headers_and_cells_are_literal(capsys):
    from orchestrator.render import console, status_text, table

    console().print(table(f"title {HOSTPORT}", [RANK, "status", FILENAMES], [[LINE, status_text("ok"), BOLD]]))
    out = capsys.readouterr().out
    assert f"title {HOSTPORT}" in out
    header = next(ln for ln in out.splitlines() if RANK in ln)
    assert FILENAMES in header
    row = next(ln for ln in out.splitlines() if "CHANGED" in ln)
    assert LINE in row and "ok" in row and row.count(BOLD) == 2


def test_event_printer_prints_every_event_kind_literally(capsys):
    from orchestrator.agent.events import Progress, Truncated
    from orchestrator.render import EventPrinter

    printer = EventPrinter()
    printer(Progress(step=RANK, message=LINE))
    printer(Progress(step=HOSTPORT, message=BOLD))
    printer(Truncated(file=FILENAMES))
    assert capsys.readouterr().err == (f"{RANK} {LINE}\n{HOSTPORT} {BOLD}\n"
                                       f"truncated {json.dumps({'file': FILENAMES})}\n")


def test_errors_and_their_fixes_are_literal(capsys):
    from orchestrator.cli import _dflash_error

    fix = f"ssh-keygen -R '{HOSTPORT}'"
    assert _dflash_error(UserError(LINE, fix=fix)) == 1
    assert capsys.readouterr().err == f"error: {LINE}\nfix: {fix}\n"


def test_a_signature_match_in_logs_is_literal(capsys):
    from orchestrator.commands.following import _print_match
    from orchestrator.render import console

    _print_match(console(stderr=True), {
        "severity": "fatal", "title": f"{HOSTPORT} gone", "signature": "sig", "line_no": 3,
        "exception": f"RuntimeError: {RANK} {FILENAMES}", "last_frame": {"file": "[a].py", "line": 1, "function": BOLD},
        "diagnosis": LINE, "fix": f"ssh-keygen -R '{HOSTPORT}'", "not_this": [FILENAMES]})
    assert capsys.readouterr().err == textwrap.dedent(f"""\
        fatal: {HOSTPORT} gone (sig, log line 3)
          exception: RuntimeError: {RANK} {FILENAMES}
          last frame: [a].py:1 in {BOLD}
          diagnosis: {LINE}
          fix: ssh-keygen -R '{HOSTPORT}'
          will not help: {FILENAMES}
        """)


def test_rebuild_venv_progress_lines_are_literal(capsys):
    from orchestrator.commands.rebuild_venv import _Progress

    with _Progress(quiet=False) as view:
        view({"event": "progress", "step": RANK, "message": LINE})
        view({"event": "log", "line": FILENAMES})
    err = capsys.readouterr().err
    assert f"{RANK} {LINE}\n" in err and f"  {FILENAMES}\n" in err


# ------------------------------------------------------------------------------ the installed CLI, end to end

SIGNATURE = {
    "id": "host-gone", "severity": "fatal", "title": f"{HOSTPORT} unreachable",
    "patterns": ["unreachable at"], "prefilter": ["unreachable at"],
    "diagnosis": f"{RANK} lost {FILENAMES}", "fix": f"ssh-keygen -R '{HOSTPORT}'", "not_this": [BOLD],
}
LOG_LINE = f"{RANK} unreachable at {HOSTPORT} with {FILENAMES}"


@pytest.mark.usefixtures("isolated_tmux")
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_the_cli_prints_brackets_as_written(tmp_path, dflashctl):
    import yaml

    work = tmp_path / "[rank0]" / FILENAMES / "work"  # a workdir with brackets shows up in many outputs
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({
        "targets": {"local": {"kind": "local", "workdir": str(work), "venv": "workstation"}},
        "venvs": {"workstation": {"kind": "workstation"}},
        # "at" quoted: the log's argv line must not match the signature, only the command's output does
        "experiments": {"e": {"kind": "command", "target": "local", "command": [
            "bash", "-c", 'echo "$1" unreachable "at" "$2" with "$3"; exit 3', "-", RANK, HOSTPORT, FILENAMES]}},
        "signatures": [SIGNATURE],
    }))
    run = lambda *a: dflashctl("-i", str(inv), *a, env=None)  # noqa: E731

    r = run("doctor", "--target", HOSTPORT)
    assert r.returncode == 1 and r.stderr.splitlines()[0] == f"error: bad target name '{HOSTPORT}': use 1-64 " \
        "characters from A-Z a-z 0-9 . _ -, starting with a letter or digit, no '..'"

    r = run("doctor")
    assert r.returncode == 0, r.stderr
    assert f"│ {work} " in r.stdout and f"{work / 'inductor-cache'}" in r.stdout

    log = tmp_path / "train.log"
    log.write_text(LOG_LINE + "\n")
    r = run("diagnose", str(log))
    assert r.returncode == 2, r.stderr
    assert r.stdout.splitlines()[-6:] == [
        f"{HOSTPORT} unreachable  (line 1)", f"  line: {LOG_LINE}", f"diagnosis: {RANK} lost {FILENAMES}",
        f"fix: ssh-keygen -R '{HOSTPORT}'", "will not help:", f"  - {BOLD}"]
    assert f"{HOSTPORT} unreachable" in next(ln for ln in r.stdout.splitlines() if "host-gone" in ln)

    r = run("launch", "e", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"  run dir:  {work}/runs/e-" in r.stdout

    r = run("launch", "e")
    assert r.returncode == 0, r.stderr
    r = run("logs", "e", "--follow")
    assert r.returncode == 2, r.stderr
    assert LOG_LINE in r.stdout.splitlines()
    assert f"fatal: {HOSTPORT} unreachable (host-gone, log line " in r.stderr
    assert f"  diagnosis: {RANK} lost {FILENAMES}\n  fix: ssh-keygen -R '{HOSTPORT}'\n  will not help: {BOLD}\n" in r.stderr

    r = run("status")
    assert r.returncode == 0, r.stderr
    assert f"workdir {work}" in r.stdout.splitlines()[0]


def test_a_changed_host_key_is_printed_with_its_brackets_and_the_fix_works(pve, tmp_path, dflashctl):
    import shlex
    import subprocess

    import yaml

    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    typ, b64 = (tmp_path / "other_key.pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text(f"[localhost]:{pve.port} {typ} {b64}\n")  # `[localhost]` is also a rich markup tag
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"pve1": dict(pve.host_entry(), ssh="localhost", known_hosts=str(known))}}))

    r = dflashctl("-i", str(inv), "trust", "pve1")
    assert r.returncode == 1
    error, fix = r.stderr.splitlines()[:2]
    assert error.startswith(f"error: WARNING: the host key of [localhost]:{pve.port} has CHANGED")
    command = fix.split("`")[1]
    assert command == f"ssh-keygen -R '[localhost]:{pve.port}' -f {shlex.quote(str(known))}"
    subprocess.run(command, shell=True, check=True, capture_output=True)  # pasted as printed
    assert known.read_text().strip() == ""
    assert dflashctl("-i", str(inv), "trust", "pve1").returncode == 0


def test_a_long_line_is_printed_whole_in_a_narrow_terminal(monkeypatch, capsys):
    """Output is data: a path or a command stays one line whatever the terminal's width (a line broken by rich
    is not pasteable; the terminal itself wraps what is too long for it)."""
    monkeypatch.setenv("COLUMNS", "40")
    line = "fix: " + "; ".join(["dflashctl -i /a/long/path/to/inventory.yaml rebuild-venv --target ct200"] * 3)
    console().print(line)
    console(stderr=True).print(line)
    assert capsys.readouterr() == (line + "\n", line + "\n")
