"""Property tests of the one name rule (orchestrator.names): every experiment and tag that launch
accepts makes run ids that EVERY consumer accepts and finds (the workstation's check, the agent's check and
run lookup, the run records, tmux's session naming and attach's exact target), and nothing with a newline, a
slash or `..` ever passes, whatever surrounds it (fullmatch, not `$`)."""

from __future__ import annotations

import datetime as dt
import json
import os
import string
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orchestrator import names, records
from orchestrator.agent import rundirs
from orchestrator.agent.protocol import AgentFailure
from orchestrator.errors import UserError
from orchestrator.inventory import check_name, check_run_ref
from orchestrator.target import tmux_attach_argv

FIRST = string.ascii_letters + string.digits
ALLOWED = FIRST + "._-"


def _valid(first: str, rest: str) -> str:
    name = first + rest
    while ".." in name:
        name = name.replace("..", "._")
    return name


# Names launch accepts, built by the rule (not filtered from random text): up to the longest legal length.
NAME = st.builds(_valid, st.sampled_from(FIRST), st.text(ALLOWED, max_size=names.NAME_MAX - 1))
LONGEST = ("q.5-" + "x" * 64)[: names.NAME_MAX]
STAMP = st.datetimes(min_value=dt.datetime(2000, 1, 1), max_value=dt.datetime(2999, 12, 31),
                     timezones=st.just(dt.timezone.utc))
BAD_PIECES = ["\n", "/", "..", "\r", "\x00", " ", ";", "$", "\\", "é"]


@pytest.fixture(scope="module")
def tmux_server():
    """A tmux server of its own (socket in a temporary directory), killed at the end."""
    with tempfile.TemporaryDirectory() as d:
        sock = str(Path(d) / "tmux.sock")
        yield lambda *args: subprocess.run(["tmux", "-S", sock, *args], capture_output=True, text=True, timeout=20)
        subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(experiment=NAME, tag=st.one_of(st.none(), NAME), when=STAMP, clash=st.integers(1, names.CLASH_MAX))
@example(experiment=LONGEST, tag=LONGEST.replace("q", "t"), when=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
         clash=names.CLASH_MAX)
def test_every_run_id_launch_makes_is_accepted_and_found_by_every_consumer(tmux_server, monkeypatch, experiment,
                                                                           tag, when, clash):
    assert check_name("experiment", experiment) == experiment  # launch accepts both names
    if tag is not None:
        assert check_name("tag", tag) == tag
    rid = names.clash_variant(names.run_id(experiment, tag, when), clash)
    assert len(rid) <= names.RUN_ID_MAX
    assert check_run_ref(rid) == rid and rundirs.check_run_id(rid) == rid

    with tempfile.TemporaryDirectory() as d:
        # The agent: the run directory is made under that very name and found by it and by its experiment.
        workdir = Path(d) / "work"
        used = rundirs.free_run_id(workdir, rid)
        path = rundirs.make_run_dir(workdir, used)
        assert used == rid and path.name == rid
        (path / "run.json").write_text(json.dumps({"run_id": rid, "experiment": experiment,
                                                   "created": "2026-01-01T00:00:00Z"}))
        assert rundirs.resolve_run(workdir, rid).run_id == rid
        assert rundirs.resolve_run(workdir, None, experiment).run_id == rid
        # The workstation's records: written under the id, found by the id, by the experiment, by a prefix.
        monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(Path(d) / "state"))
        records.append_record({"run_id": rid, "experiment": experiment})
        assert records.find_record(rid)["run_id"] == rid
        assert records.find_record(experiment)["run_id"] == rid
        assert records.find_record(rid[:-1])["run_id"] == rid

    # tmux keeps the session name we compute exactly as given, and attach's exact target (`=NAME`) finds it.
    session = names.session_name(experiment)
    assert tmux_server("new-session", "-d", "-s", session, "sleep 30").returncode == 0
    try:
        listed = tmux_server("list-sessions", "-F", "#{session_name}").stdout.split("\n")
        assert session in listed
        target = tmux_attach_argv(session)[-1]
        assert tmux_server("has-session", "-t", target).returncode == 0
    finally:
        tmux_server("kill-session", "-t", "=" + session)


@settings(max_examples=300, deadline=None)
@given(before=st.text(max_size=30), bad=st.sampled_from(BAD_PIECES), after=st.text(max_size=30))
@example(before="abc", bad="\n", after="")  # `$` would let this one through
@example(before="exp-1", bad="/", after="x")
@example(before="a", bad="..", after="b")
def test_nothing_with_a_newline_a_slash_or_dotdot_passes_anywhere(before, bad, after):
    text = before + bad + after
    assert not names.is_valid(text) and not names.is_valid(text, names.RUN_ID_MAX)
    with pytest.raises(UserError, match="bad run id"):
        check_run_ref(text)
    with pytest.raises(AgentFailure) as info:
        rundirs.check_run_id(text)
    assert info.value.type == "BadRunId"
    with pytest.raises(names.BadName, match=r"bad experiment name .*: use 1-64 characters"):
        names.check("experiment", text)
    with pytest.raises(UserError, match="bad experiment name"):
        check_name("experiment", text)
    with pytest.raises(names.BadName, match="bad tag name"):
        names.run_id("exp", text)  # a tag launch would refuse never reaches a run id


@settings(max_examples=200, deadline=None)
@given(name=NAME, tail=st.sampled_from(["\n", "\r\n", "\n\n", " ", "\t", "\x00", "/"]))
def test_fullmatch_a_valid_name_with_anything_after_it_is_refused(name, tail):
    assert names.is_valid(name)
    assert not names.is_valid(name + tail) and not names.is_valid(tail + name)
    with pytest.raises(UserError, match="bad run id"):
        check_run_ref(name + tail)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=names.RUN_ID_MAX + 5))
def test_what_passes_is_only_the_rule(text):
    if names.is_valid(text, names.RUN_ID_MAX):
        assert 1 <= len(text) <= names.RUN_ID_MAX and text[0] in FIRST
        assert all(c in ALLOWED for c in text) and ".." not in text
        assert os.path.basename(text) == text and text not in (".", "..")


# ------------------------------------------------------------------------- edges the mutation run found


def test_the_run_id_stamp_is_utc_whatever_the_machines_zone(monkeypatch):
    import time

    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        when = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone(dt.timedelta(hours=2)))
        assert names.run_id("exp", "t", when) == "exp-t-20260101T100000Z"
        assert names.run_id("exp", None, when) == "exp-20260101T100000Z"
    finally:
        monkeypatch.undo()
        time.tzset()


def test_clash_variants_and_their_limits():
    assert names.clash_variant("r", 1) == "r" and names.clash_variant("r", 2) == "r-2"
    assert names.clash_variant("r", names.CLASH_MAX) == f"r-{names.CLASH_MAX}"
    for n in (0, names.CLASH_MAX + 1):
        with pytest.raises(ValueError, match=f"clash number {n} outside 1..{names.CLASH_MAX}"):
            names.clash_variant("r", n)


def test_each_refusal_names_what_was_refused():
    with pytest.raises(names.BadName, match=r"^bad run id 'a/b': use 1-"):
        names.check_run_id("a/b")
    with pytest.raises(names.BadName, match=r"^bad experiment name 'a/b'"):
        names.run_id("a/b", None)
    with pytest.raises(names.BadName, match=r"^bad experiment name 'a/b'"):
        names.session_name("a/b")
    with pytest.raises(names.BadName, match=r"^bad tag name 'a b'") as info:
        names.run_id("exp", "a b")
    assert info.value.fix == "choose another tag name, e.g. 'exp-1' or 'run_2'"


def test_a_name_longer_than_the_callers_limit_is_refused_with_that_limit():
    assert names.check("tag", "a" * 5, limit=5) == "a" * 5
    with pytest.raises(names.BadName, match=r"^bad tag name 'aaaaaa': use 1-5 characters from "):
        names.check("tag", "a" * 6, limit=5)


def test_a_refused_run_reference_says_where_to_copy_a_real_one():
    with pytest.raises(names.BadName) as info:
        names.check_run_id("exp-1\n", kind="run id or experiment")
    assert info.value.message == (f"bad run id or experiment 'exp-1\\n': use 1-{names.RUN_ID_MAX} characters "
                                  f"from {names.RULE}")
    assert info.value.fix == "copy the run id from `dflashctl runs` or `dflashctl status`"


@pytest.mark.parametrize("word, ok", [("user", True), ("host.example.org", True), ("a@b:22", True), ("", False),
                                      ("-oProxyCommand=id", False), ("a b", False), ("a\tb", False),
                                      ("a\nb", False), ("a\x1bb", False), ("\u00a0x", False)])
def test_an_ssh_word_is_printable_has_no_space_and_is_no_option(word, ok):
    assert names.is_ssh_word(word) is ok


@given(values=st.lists(st.one_of(
    st.text(alphabet="ab9._-\n/ ", min_size=0, max_size=8),
    st.sampled_from(["a" * 64, "a" * 65, "a..b", "a\n", "\na", "-a", ".a", "A_b-9.c"]),
    st.integers(), st.none()), max_size=6), limit=st.sampled_from([0, 1, 3, 64]))
@example(values=["ok", "a..b"], limit=64)
@example(values=["a" * 64, "b"], limit=64)
@example(values=["a" * 65], limit=64)
@example(values=["ok", "x\n"], limit=64)
@example(values=["ok", 7], limit=64)
@example(values=[""], limit=64)
def test_all_valid_is_is_valid_for_every_value(values, limit):
    """The one-pass check of many names answers what is_valid answers for each: line breaks in a value, a `..`
    across what would be two names, the length limit, values that are not text."""
    assert names.all_valid(values, limit) == all(names.is_valid(v, limit) for v in values)
