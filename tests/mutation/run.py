"""Mutation testing (mutmut, pinned in pyproject's `mutation` extra) over the modules whose mistakes cost a user
the most; prints the score per module and fails (exit 1) when one falls below its floor.

    python tests/mutation/run.py [--only MODULE ...] [--keep] [--list-survivors]

It lives beside the tests because it measures them: a mutant is a deliberate bug, and a score says how many
of those bugs the fast unit tests catch. (bench/ holds speed targets; nothing here is timed against a goal.)

How: each group below is one `mutmut run` in its own scratch copy (build/mutation/<group>: mutmut writes a
`mutants/` tree and reads its config from the pyproject.toml there, so the checkout stays untouched). Only the
functions listed for a module are mutated, and each mutant runs only the tests of its group's FAST selection
that execute the mutated function (mutmut records that per test), fastest first, stopping at the first
failure. Survivors that are equivalent (no test could tell them from the original) are listed with the reason
in tests/mutation/equivalent.yaml, keyed by module, function and the mutated line, so they survive renumbering;
they count neither for nor against the score. Every other survivor is printed with its diff.

score = killed / (mutants - equivalent); a timeout counts as killed (the mutant hangs where the code did not).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SCRATCH = REPO / "build" / "mutation"
EQUIVALENT = Path(__file__).with_name("equivalent.yaml")

# module -> the mutant name patterns (mutmut's names: package.module.x_function / xǁClassǁmethod)
GROUPS: dict[str, dict] = {
    "orchestrator": {
        "files": ["orchestrator/names.py", "orchestrator/transport/quoting.py", "orchestrator/agent/tailer.py",
                  "orchestrator/signatures.py", "orchestrator/agent/claims.py", "orchestrator/agent/runs.py"],
        "modules": {
            "names": ["orchestrator.names.*"],
            "quoting": ["orchestrator.transport.quoting.*"],
            "tailer (offsets)": ["orchestrator.agent.tailer.x_tail_offset__*", "orchestrator.agent.tailer.x__last_newline_end__*",
                                 "orchestrator.agent.tailer.xǁLineCursorǁ*"],
            "signatures (matcher)": ["orchestrator.signatures.xǁMatcherǁ*", "orchestrator.signatures.xǁ_Tracebackǁ*",
                                     "orchestrator.signatures.x__same_tag__*", "orchestrator.signatures.x__winner__*"],
            "claims + lock": ["orchestrator.agent.claims.x__conflicts__*", "orchestrator.agent.claims.x_claim__*",
                              "orchestrator.agent.claims.x_claim_alive__*", "orchestrator.agent.claims.x_held__*",
                              "orchestrator.agent.claims.x_promote__*", "orchestrator.agent.claims.x_release__*",
                              "orchestrator.agent.runs.xǁLaunchLockǁ*"],
        },
        "tests": ["tests/orchestrator/test_names.py", "tests/orchestrator/test_names_property.py",
                  "tests/orchestrator/test_quoting.py", "tests/orchestrator/test_quoting_property.py",
                  "tests/orchestrator/test_tail.py", "tests/orchestrator/test_tailer_unit.py",
                  "tests/orchestrator/test_signatures.py",
                  "tests/orchestrator/test_signatures_property.py", "tests/orchestrator/test_claims_unit.py",
                  # the slow ones (a real tmux, the fake host's sshd, launches) stay in the main suite
                  "-k", "not end_to_end and not every_run_id_launch_makes and not through_ssh and not nul_byte"],
    },
    "trainer": {
        "files": ["trainer/objective.py", "trainer/export.py", "trainer/layout.py"],
        "modules": {
            "objective (loss)": ["trainer.objective.x_dflash_loss__*", "trainer.objective.x_default_gamma__*",
                                 "trainer.objective.x_block_labels__*", "trainer.objective.x_block_inputs__*"],
            "export": ["trainer.export.x_draft_config_dict__*", "trainer.export.x_export_drafter__*"],
            "layout": ["trainer.layout.*"],
        },
        "tests": ["tests/trainer/test_objective.py", "tests/trainer/test_layout.py", "tests/trainer/test_export.py",
                  "-k", "not published_decode_loop and not bundle_zip and not self_contained and not flex_backend"],
    },
}

# Floors (percent) from the first honest run, raised as tests are added; CI fails below them.
FLOORS = {
    "names": 90, "quoting": 90, "tailer (offsets)": 80, "signatures (matcher)": 80, "claims + lock": 70,
    "objective (loss)": 80, "export": 70, "layout": 85,
}

KILLED = {1, 3, 36, 24, -24, 152, 255}  # mutmut's exit codes: failed tests, pytest error, timeouts
SURVIVED = 0


def _prepare(group: str, spec: dict) -> Path:
    """A scratch copy of the packages, the tests and pyproject.toml, with mutmut's config for this group."""
    root = SCRATCH / group
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
    for name in ("orchestrator", "trainer", "tests"):
        shutil.copytree(REPO / name, root / name, ignore=ignore)
    cfg = {
        "source_paths": ["orchestrator", "trainer"],
        "only_mutate": spec["files"],
        "pytest_add_cli_args_test_selection": spec["tests"],
        "pytest_add_cli_args": ["-p", "no:cacheprovider", "-q", "-W", "ignore"],
    }
    text = (REPO / "pyproject.toml").read_text()
    text += "\n[tool.mutmut]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in cfg.items())
    (root / "pyproject.toml").write_text(text)
    return root


def _run_group(group: str, spec: dict, modules: list[str], log) -> tuple[Path, float]:
    root = _prepare(group, spec)
    patterns = [p for m in modules for p in spec["modules"][m]]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutmut puts mutants/ first itself
    env["MUTMUT_GROUP"] = group
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "mutmut", "run", *patterns], cwd=root, env=env,
                         stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    if res.returncode != 0:
        raise SystemExit(f"mutmut run for {group} failed (exit {res.returncode}); see {log.name}")
    return root, wall


def _results(root: Path, spec: dict, modules: list[str]) -> dict[str, dict[str, int]]:
    """module -> {mutant name: exit code} for the mutants that ran."""
    codes: dict[str, int] = {}
    for meta in (root / "mutants").rglob("*.py.meta"):
        codes.update({k: v for k, v in json.loads(meta.read_text())["exit_code_by_key"].items() if v is not None})
    out: dict[str, dict[str, int]] = {}
    for m in modules:
        pats = [re.compile(re.escape(p).replace(r"\*", ".*") + "$") for p in spec["modules"][m]]
        out[m] = {k: v for k, v in codes.items() if any(p.match(k) for p in pats)}
    return out


_DIFFS = r"""
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
out = {}
for n in sys.argv[1:]:
    try:
        out[n] = get_diff_for_mutant(n)
    except Exception as exc:  # one unreadable mutant must not hide the others
        out[n] = f"(no diff: {type(exc).__name__}: {exc})"
print(json.dumps(out))
"""


def _diffs(root: Path, mutants: list[str]) -> dict[str, str]:
    if not mutants:
        return {}
    res = subprocess.run([sys.executable, "-c", _DIFFS, *mutants], cwd=root, capture_output=True, text=True,
                         check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def key_of(mutant: str, diff: str) -> str:
    """`function:line | original -> mutated`: what equivalent.yaml lists. The line is counted within the
    function, so the key stays the same when mutmut renumbers its mutants or code above the function moves."""
    function = mutant.rsplit("__mutmut_", 1)[0].rsplit(".", 1)[-1]
    added, removed, line_no, at = [], [], 0, None
    for line in diff.splitlines():
        if line.startswith(("+++", "---")):
            continue
        if line.startswith("@@"):
            line_no = int(line.split()[1].lstrip("-").split(",")[0])
            continue
        if line.startswith("-"):
            removed.append(line[1:].strip())
            at = line_no if at is None else at
        elif line.startswith("+"):
            added.append(line[1:].strip())
            continue
        line_no += 1
    return f"{function}:{at} | {' / '.join(removed)} -> {' / '.join(added)}"


def load_equivalent() -> dict[str, str]:
    data = yaml.safe_load(EQUIVALENT.read_text()) or []
    return {entry["mutant"]: entry["reason"] for entry in data}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="modules to run (default: all)")
    ap.add_argument("--list-survivors", action="store_true", help="print every survivor's key and diff")
    args = ap.parse_args(argv)
    equivalent = load_equivalent()
    SCRATCH.mkdir(parents=True, exist_ok=True)
    rows, survivors, total_wall = [], [], 0.0
    for group, spec in GROUPS.items():
        modules = [m for m in spec["modules"] if not args.only or m in args.only or m.split()[0] in args.only]
        if not modules:
            continue
        with open(SCRATCH / f"{group}.log", "w") as log:
            root, wall = _run_group(group, spec, modules, log)
        total_wall += wall
        print(f"group {group}: mutmut ran {wall:.0f} s (log: {SCRATCH / (group + '.log')})", flush=True)
        for m, codes in _results(root, spec, modules).items():
            alive = sorted(k for k, v in codes.items() if v == SURVIVED)
            diffs = _diffs(root, alive)
            keys = {k: key_of(k, diffs[k]) for k in alive}
            equiv = [k for k in alive if keys[k] in equivalent]
            killed = sum(1 for v in codes.values() if v in KILLED)
            other = len(codes) - killed - len(alive)
            counted = len(codes) - len(equiv)
            score = 100.0 * killed / counted if counted else 100.0
            rows.append((m, len(codes), killed, len(alive) - len(equiv), len(equiv), other, score))
            survivors += [(m, k, keys[k], diffs[k]) for k in alive if keys[k] not in equivalent]
    print(f"\n{'module':24} {'mutants':>7} {'killed':>7} {'survived':>8} {'equiv.':>6} {'other':>5} {'score':>6} floor")
    failed = []
    for m, n, killed, alive, equiv, other, score in rows:
        floor = FLOORS.get(m, 0)
        flag = "" if score >= floor else "  BELOW FLOOR"
        print(f"{m:24} {n:7d} {killed:7d} {alive:8d} {equiv:6d} {other:5d} {score:5.1f}% {floor:4d}%{flag}")
        if score < floor:
            failed.append(m)
    print(f"mutation testing wall time: {total_wall:.0f} s")
    if survivors:
        print(f"\n{len(survivors)} survivor(s) not listed in {EQUIVALENT.relative_to(REPO)}:")
        for m, name, key, diff in survivors:
            print(f"- [{m}] {name}\n  key: {key!r}")
            if args.list_survivors:
                print("  " + diff.strip().replace("\n", "\n  "))
    if failed:
        print(f"\nFAILED: below the floor: {', '.join(failed)} (kill the survivors above with a test, or list a "
              f"truly equivalent one in {EQUIVALENT.relative_to(REPO)} with the reason)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
