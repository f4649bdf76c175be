"""The one name rule (orchestrator.names): what passes, what never does, and the longest legal experiment and
tag followed end to end through the installed `dflashctl` (launch, status, attach, logs --follow, stop, runs,
runs diff) on a local target."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator import names
from orchestrator.agent import rundirs
from orchestrator.agent.protocol import AgentFailure
from orchestrator.errors import UserError
from orchestrator.inventory import check_name, check_run_ref

REPO = Path(__file__).resolve().parents[2]
ALLOWED = "ABCXYZabcxyz0189._-"
# The longest legal names, with a '.' (tmux turns it into '_' in a session name) in the experiment.
EXPERIMENT = ("qwen3.5-8b-drafter-3x-h200-flex-" + "x" * 64)[: names.NAME_MAX]
TAG = ("ablation-no-regenerate-" + "y" * 64)[: names.NAME_MAX]


@pytest.mark.parametrize("bad", ["abc\n", "a\nb", "a/b", "a..b", "..", ".hidden", "-x", "", "a b", "x" * 65, "é",
                                 "a;id", "$(id)", "a\x00b", "abc\r"])
def test_names_refuse(bad):
    assert not names.is_valid(bad)
    with pytest.raises(names.BadName):
        names.check("tag", bad)
    with pytest.raises(UserError, match="bad tag name"):
        check_name("tag", bad)


def test_run_ids_refuse_a_newline_a_slash_and_dotdot():
    for bad in ("exp-1\n", "exp/1", "exp..1", "x" * (names.RUN_ID_MAX + 1)):
        with pytest.raises(UserError, match="bad run id"):
            check_run_ref(bad)
        with pytest.raises(AgentFailure) as info:
            rundirs.check_run_id(bad)
        assert info.value.type == "BadRunId"


@pytest.mark.parametrize("bad", ["exp-1\n", "exp/1", "exp..1"])
def test_every_verb_that_takes_a_run_refuses_a_bad_one_as_the_user_sees_it(dflashctl, dflashctl_main, tmp_path, bad):
    """Before any target is contacted: one error line naming the value as Python writes it (a newline shows as
    \\n), the rule, and the fix; exit 1. Through the installed console script for `logs`; the other verbs
    through orchestrator.cli.main in this process (what the script calls: an interpreter start-up less each)."""
    rule = f"use 1-{names.RUN_ID_MAX} characters from {names.RULE}"
    env = {**os.environ, "DFLASHCTL_STATE_DIR": str(tmp_path)}
    for argv, kind, run in ((["logs", bad], "run id or experiment", dflashctl), (["stop", bad], "run id", dflashctl_main),
                            (["attach", bad], "run id or experiment", dflashctl_main),
                            (["launch", "tiny", "--resume", bad, "--dry-run"], "run id", dflashctl_main)):
        r = run(*argv, env=env)
        assert r.returncode == 1, (argv, r.stderr)
        assert r.stderr.splitlines() == [f"error: bad {kind} {bad!r}: {rule}",
                                          "fix: copy the run id from `dflashctl runs` or `dflashctl status`"], argv


def test_the_longest_names_make_a_run_id_every_consumer_accepts():
    rid = names.run_id(EXPERIMENT, TAG)
    longest = names.clash_variant(rid, names.CLASH_MAX)
    assert len(longest) == names.RUN_ID_MAX
    assert check_run_ref(longest) == longest and rundirs.check_run_id(longest) == longest
    assert names.session_name(EXPERIMENT) == "dflash-qwen3_5-8b-drafter-3x-h200-flex-" + "x" * 32


def test_error_text_is_correct_english():
    with pytest.raises(UserError) as info:
        check_name("experiment", "a/b")
    assert info.value.fix == "choose another experiment name, e.g. 'exp-1' or 'run_2'"


name_text = st.text(alphabet=ALLOWED, min_size=1, max_size=names.NAME_MAX)


@given(experiment=name_text, tag=st.one_of(st.none(), name_text))
def test_any_accepted_experiment_and_tag_give_a_run_id_every_consumer_accepts(experiment, tag):
    try:
        names.check("experiment", experiment)
        if tag is not None:
            names.check("tag", tag)
    except names.BadName:
        return  # launch refuses these before anything else
    rid = names.run_id(experiment, tag)
    for n in (1, 2, names.CLASH_MAX):
        variant = names.clash_variant(rid, n)
        assert check_run_ref(variant) == variant
        assert rundirs.check_run_id(variant) == variant
    session = names.session_name(experiment)
    assert "." not in session and ":" not in session  # tmux would rename it


@given(st.text(max_size=200))
def test_nothing_with_a_newline_slash_or_dotdot_passes(text):
    if "\n" in text or "/" in text or ".." in text:
        assert not names.is_valid(text, names.RUN_ID_MAX)
    if names.is_valid(text, names.RUN_ID_MAX):
        assert all(c in "._-" or (c.isascii() and c.isalnum()) for c in text)


# ---------------------------------------------------------------------------- end to end, installed CLI

COMMAND = 'echo started; while [ ! -e "$DFLASHCTL_RUN_DIR/go" ]; do sleep 0.1; done; echo finished'


def _inventory(tmp_path: Path) -> Path:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"""
targets:
  local: {{kind: local, workdir: {tmp_path / "work"}, venv: workstation}}
venvs:
  workstation: {{kind: workstation}}
experiments:
  {EXPERIMENT}:
    kind: command
    target: local
    command: [bash, -c, {json.dumps(COMMAND)}]
""")
    return inv


def _wait(pred, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def _attach_and_detach(inv: str, run_id: str, session: str) -> None:
    """The installed `dflashctl attach RUN -r` on a pty: it must reach the run's session (a client appears),
    and end with exit 0 when that client is detached."""
    import shutil

    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm"}
    master, slave = pty.openpty()
    proc = subprocess.Popen([shutil.which("dflashctl"), "-i", inv, "attach", run_id, "--read-only"], stdin=slave,
                            stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    try:
        clients = lambda: subprocess.run(["tmux", "list-clients", "-t", "=" + session], capture_output=True,  # noqa: E731
                                         text=True).stdout.strip()
        _wait(lambda: clients() or proc.poll() is not None)
        assert proc.poll() is None, os.read(master, 65536).decode(errors="replace")
        subprocess.run(["tmux", "detach-client", "-s", "=" + session], check=True)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


@pytest.mark.usefixtures("isolated_tmux")
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_longest_legal_names_end_to_end(tmp_path, dflashctl):
    inv = str(_inventory(tmp_path))
    r = dflashctl("-i", inv, "launch", EXPERIMENT, "--tag", TAG)
    assert r.returncode == 0, r.stderr
    run_a = f"{EXPERIMENT}-{TAG}-"  # the stamp is launch's
    line = next(ln for ln in r.stdout.splitlines() if "follow: dflashctl logs" in ln)
    rid_a = line.split("logs ", 1)[1].split()[0]
    assert rid_a.startswith(run_a) and len(rid_a) == 2 * names.NAME_MAX + 2 + names.STAMP_LEN
    session = names.session_name(EXPERIMENT)

    st_ = json.loads(dflashctl("-i", inv, "status", "--json").stdout)
    assert [(x["run_id"], x["state"]) for x in st_["runs"]] == [(rid_a, "running")]
    assert [s["name"] for s in st_["sessions"]] == [session]

    _attach_and_detach(inv, rid_a, session)

    (tmp_path / "work" / "runs" / rid_a / "go").touch()
    r = dflashctl("-i", inv, "logs", rid_a, "--follow")  # the follow hint launch printed, as printed
    assert r.returncode == 0, r.stderr
    assert "started" in r.stdout and "finished" in r.stdout

    r = dflashctl("-i", inv, "launch", EXPERIMENT, "--tag", TAG)
    assert r.returncode == 0, r.stderr
    rid_b = json.loads(dflashctl("-i", inv, "runs", "--json").stdout)[-1]["run_id"]
    assert rid_b != rid_a and rid_b.startswith(run_a)
    r = dflashctl("-i", inv, "stop", rid_b, "--grace", "1")
    assert r.returncode == 0, r.stderr
    assert f"run {rid_b} stopped with SIGINT" in r.stdout

    r = dflashctl("-i", inv, "runs", "--json", "--experiment", EXPERIMENT)
    assert [x["run_id"] for x in json.loads(r.stdout)] == [rid_a, rid_b]
    r = dflashctl("-i", inv, "runs", "diff", rid_a, rid_b, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["a"] == rid_a
    r = dflashctl("-i", inv, "logs", rid_b)
    assert r.returncode == 5, r.stderr  # the README's code for a stopped run: found, not a name error
    assert "started" in r.stdout and f"run {rid_b}: stopped" in r.stderr
