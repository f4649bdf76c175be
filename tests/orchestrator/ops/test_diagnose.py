"""`diagnose` over files and through the real CLI: summary, exit codes, JSON, \\r and bad bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import assets
from orchestrator.errors import UserError
from orchestrator.ops.diagnose import diagnose

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "signatures"
CATALOGUE = assets.on_disk("signatures.yaml")


def catalogue_entry(sig_id: str) -> dict:
    """A signature's texts as the catalogue file writes them (YAML folded: one line each)."""
    import yaml

    return next(e for e in yaml.safe_load(CATALOGUE.read_text()) if e["id"] == sig_id)


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-c", "import sys; from orchestrator.cli import main; sys.exit(main(sys.argv[1:]))", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def test_report_orders_by_severity_and_counts(tmp_path):
    log = tmp_path / "train.log"
    parts = [(FIXTURES / n).read_bytes() for n in ("nan-loss.log", "dynamo-recompile-limit.log", "cuda-oom.log")]
    log.write_bytes(b"".join(parts))
    report = diagnose(log, block_size=100)  # tiny blocks: lines and tracebacks cross block edges
    assert [(s.id, s.count) for s in report.signatures] == [("cuda-oom", 1), ("nan-loss", 2), ("dynamo-recompile-limit", 1)]
    assert report.signatures[1].first_line == 3
    assert report.signatures[0].first_line == 4 + 7 + 3
    assert report.exit_code == 2 and report.worst.id == "cuda-oom"
    assert report.lines == sum(p.count(b"\n") for p in parts)


def test_binary_garbage_carriage_returns_and_no_final_newline(tmp_path):
    log = tmp_path / "train.log"
    log.write_bytes(b"\xff\xfe bad bytes \x00\n" + b"progress 10%\rprogress 20%\rloss nan" + b"\nok\nlast line no newline Killed")
    report = diagnose(log)
    assert [(s.id, s.first_line) for s in report.signatures] == [("nan-loss", 2)]
    assert report.lines == 4 and report.exit_code == 1


def test_cli_exit_codes_and_json(tmp_path):
    clean = tmp_path / "clean.log"
    clean.write_text("step 1/10 ep 0 loss 2.0 acc 0.1\n" * 50)
    r = cli("diagnose", str(clean))
    assert r.returncode == 0 and "no known signature" in r.stdout
    r = cli("diagnose", str(FIXTURES / "fx-tracing-race.log"))
    assert r.returncode == 2, r.stderr
    assert "fx-tracing-race" in r.stdout and "compile_wrapper" in r.stdout and "will not help" in r.stdout
    r = cli("diagnose", "--json", str(FIXTURES / "missing-module.log"))
    data = json.loads(r.stdout)
    assert r.returncode == 2 and data["worst"] == "missing-module"
    assert data["signatures"][0]["examples"][0]["groups"] == {"module": "accelerate"}
    assert "accelerate" in data["signatures"][0]["fix"]
    r = cli("diagnose", str(tmp_path / "missing.log"))
    assert r.returncode == 1 and "no such log file" in r.stderr


def test_inventory_signatures_extend_the_cli(tmp_path):
    inv = tmp_path / "inventory.yaml"
    inv.write_text("signatures:\n  - id: my-check\n    patterns: ['MyCheck failed']\n    severity: warning\n"
                   "    title: custom\n    diagnosis: d\n    fix: f\n")
    log = tmp_path / "x.log"
    log.write_text("hello\nMyCheck failed here\n")
    r = cli("--inventory", str(inv), "diagnose", "--json", str(log))
    assert r.returncode == 1, r.stderr
    assert json.loads(r.stdout)["worst"] == "my-check"


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such log file"):
        diagnose(tmp_path / "nope.log")


def test_the_user_reads_the_diagnosis_the_fix_and_every_false_lead_in_order(dflashctl):
    """What `diagnose` prints under the table, line by line: the fix under `fix:`, then each tempting fix that
    will not help under its own heading, in the catalogue's order (fx-tracing-race has three)."""
    entry = catalogue_entry("fx-tracing-race")
    assert len(entry["not_this"]) == 3
    r = dflashctl("diagnose", str(FIXTURES / "fx-tracing-race.log"))
    assert r.returncode == 2, r.stderr
    lines = r.stdout.splitlines()
    start = lines.index(f"diagnosis: {entry['diagnosis']}")
    assert lines[start:] == [f"diagnosis: {entry['diagnosis']}", f"fix: {entry['fix']}", "will not help:",
                             *(f"  - {item}" for item in entry["not_this"])]
    assert lines[start - 3] == f"{entry['title']}  (line 5)"  # the traceback begins on line 5
    assert "Downgrading or pinning transformers" in lines[-3]
