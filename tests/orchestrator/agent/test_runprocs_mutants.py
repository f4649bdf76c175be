"""orchestrator.agent.runprocs on real processes started here: which are a run's (the environment marker, by
the path as given or resolved, never a look-alike variable or an empty value), a group's members, zombies and
stopped processes, and how they are described. Fast: what tests/mutation/run.py runs against runprocs' mutants
(tests/orchestrator/agent/test_run_processes.py has the same through a real launch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.agent import runprocs
from orchestrator.agent.runprocs import RunProcess
from waiting import wait_for

SLEEP = "import time; time.sleep(120)"


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []

    def start(code: str = SLEEP, env_extra: dict | None = None, *args: str, **kw) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != runprocs.MARKER}
        env.update(env_extra or {})
        p = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdin=subprocess.DEVNULL, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def test_the_runs_processes_are_those_marked_with_its_directory_as_given_or_resolved(tmp_path, procs):
    run_dir = tmp_path / "runs" / "a-1"
    run_dir.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "runs")
    mine = [procs(SLEEP, {runprocs.MARKER: str(run_dir)}, "x"),
            procs(env_extra={runprocs.MARKER: str(link / "a-1")})]
    other = procs(env_extra={runprocs.MARKER: str(tmp_path / "runs" / "b-2")})
    # look-alikes: a variable whose name ends in the marker's, and an empty marker
    procs(env_extra={"OTHER_" + runprocs.MARKER: str(run_dir)})
    procs(env_extra={runprocs.MARKER: ""})
    procs()
    for p in mine + [other]:
        wait_for(lambda p=p: runprocs.MARKER.encode() in Path(f"/proc/{p.pid}/environ").read_bytes(),
                 what="the child's exec")

    marked = runprocs.marked_processes()
    assert [p.pid for p in marked[str(run_dir)]] == [mine[0].pid]
    assert [p.pid for p in marked[str(link / "a-1")]] == [mine[1].pid]
    assert [p.pid for p in marked[str(tmp_path / "runs" / "b-2")]] == [other.pid]
    assert "" not in marked
    # asked by a path through a link: the processes marked with it as given and those marked with its real
    # path, by pid (asked by the real path: only those marked with it)
    want = sorted(p.pid for p in mine)
    assert [p.pid for p in runprocs.of_run(marked, run_dir)] == [mine[0].pid]
    assert [p.pid for p in runprocs.of_run(marked, link / "a-1")] == want
    assert [p.pid for p in runprocs.run_processes(str(link / "a-1"))] == want
    assert [p.pid for p in runprocs.run_processes(tmp_path / "runs" / "b-2")] == [other.pid]
    assert runprocs.run_processes(tmp_path / "runs" / "c-3") == []
    # exclude leaves those pids out; this process never counts (its own marker, if it had one)
    left = runprocs.marked_processes(exclude={mine[0].pid})
    assert [p.pid for p in runprocs.of_run(left, link / "a-1")] == [mine[1].pid]
    got = {p.pid: p for p in runprocs.run_processes(run_dir)}
    assert got[mine[0].pid].argv == f"{sys.executable} -c {SLEEP} x"
    assert got[mine[0].pid].pgid == os.getpgid(mine[0].pid) and got[mine[0].pid].state in ("R", "S")


def test_many_marked_processes_are_listed_by_pid(tmp_path, procs):
    run_dir = tmp_path / "r"
    children = [procs(env_extra={runprocs.MARKER: str(run_dir)}) for _ in range(4)]
    for p in children:
        wait_for(lambda p=p: runprocs.MARKER.encode() in Path(f"/proc/{p.pid}/environ").read_bytes(),
                 what="the child's exec")
    assert [p.pid for p in runprocs.marked_processes()[str(run_dir)]] == sorted(p.pid for p in children)


def test_a_zombie_is_no_process_of_the_run_nor_of_its_group(tmp_path, procs):
    run_dir = tmp_path / "r"
    z = procs("pass", {runprocs.MARKER: str(run_dir)}, start_new_session=True)
    wait_for(lambda: _state(z.pid) == "Z", what="the child's exit (not reaped)")
    assert runprocs.describe_pid(z.pid) is None
    assert runprocs.run_processes(run_dir) == []
    assert runprocs.group_members(z.pid) == []
    z.wait()
    assert runprocs.describe_pid(z.pid) is None  # reaped: gone
    assert runprocs._argv(z.pid) == "?"


def test_a_groups_members_are_its_live_processes_by_pid_and_no_other_groups(procs):
    leader = procs("import subprocess, sys, time\n"
                   "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                   "print('ok', flush=True)\ntime.sleep(120)\n", start_new_session=True, stdout=subprocess.PIPE)
    assert leader.stdout.readline().strip() == b"ok"
    procs()  # another group (this test's)
    members = runprocs.group_members(leader.pid)
    assert len(members) == 2 and members[0].pid == leader.pid and members[0].pid < members[1].pid
    assert all(m.pgid == leader.pid for m in members)
    assert runprocs.group_members(os.getpgid(0)) and all(m.pgid == os.getpgid(0)
                                                          for m in runprocs.group_members(os.getpgid(0)))
    os.killpg(leader.pid, signal.SIGKILL)


def test_a_stopped_process_is_described_with_its_state_a_running_one_without(tmp_path, procs):
    run_dir = tmp_path / "r"
    p = procs(env_extra={runprocs.MARKER: str(run_dir)})
    wait_for(lambda: runprocs.run_processes(run_dir), what="the child's exec")
    [rp] = runprocs.run_processes(run_dir)
    assert rp.describe() == f"pid {p.pid} ({sys.executable} -c {SLEEP})"
    os.kill(p.pid, signal.SIGSTOP)
    wait_for(lambda: _state(p.pid) == "T", what="the child's stop")
    [rp] = runprocs.run_processes(run_dir)
    assert rp.state == "T" and rp.describe() == f"pid {p.pid} ({sys.executable} -c {SLEEP}, state T)"
    os.kill(p.pid, signal.SIGCONT)


def test_a_name_with_parentheses_and_spaces_does_not_shift_the_stat_fields(procs):
    # comm "a) b (c" as a process may name itself: the state and group come after the LAST ')'
    p = procs("import time\nopen('/proc/self/comm', 'w').write('a) 1 2 (c')\nprint('ok', flush=True)\n"
              "time.sleep(120)\n", start_new_session=True, stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"ok"
    assert runprocs._stat(p.pid) == (_state(p.pid), p.pid)
    assert runprocs.describe_pid(p.pid).pgid == p.pid


def test_a_long_command_line_is_cut_at_200_characters_and_nuls_read_as_spaces(procs):
    arg = "y" * 300
    p = procs(SLEEP, None, arg)
    wait_for(lambda: arg.encode() in Path(f"/proc/{p.pid}/cmdline").read_bytes(), what="the child's exec")
    full = f"{sys.executable} -c {SLEEP} {arg}"
    assert runprocs._argv(p.pid) == full[:200] + "..."
    short = procs(SLEEP, None, "z" * (200 - len(f"{sys.executable} -c {SLEEP} ")))
    wait_for(lambda: b"zz" in Path(f"/proc/{short.pid}/cmdline").read_bytes(), what="the child's exec")
    text = runprocs._argv(short.pid)
    assert len(text) == 200 and not text.endswith("...") and " -c " in text


def test_gone_processes_and_unreadable_stat(tmp_path):
    assert runprocs._stat(2 ** 22 + 1) is None and runprocs.describe_pid(2 ** 22 + 1) is None
    assert runprocs._argv(2 ** 22 + 1) == "?"
    assert runprocs.group_members(2 ** 22 + 1) == []
    assert runprocs.of_run({}, tmp_path) == []


def test_describe_all_names_four_and_counts_the_rest():
    ps = [RunProcess(i, 1, "S", f"cmd{i}") for i in range(1, 7)]
    assert runprocs.describe_all(ps[:1]) == "pid 1 (cmd1)"
    assert runprocs.describe_all(ps[:4]) == "pid 1 (cmd1), pid 2 (cmd2), pid 3 (cmd3), pid 4 (cmd4)"
    assert runprocs.describe_all(ps) == ("pid 1 (cmd1), pid 2 (cmd2), pid 3 (cmd3), pid 4 (cmd4) and 2 more")
    assert runprocs.describe_all(ps[:5], most=5).endswith("pid 5 (cmd5)")
    assert RunProcess(9, 9, "R", "x").describe() == "pid 9 (x)"
    assert RunProcess(9, 9, "D", "x").describe() == "pid 9 (x, state D)"


def test_bytes_that_are_not_utf_8_in_a_command_line_or_a_marker_are_replaced_not_fatal(tmp_path):
    """A command line or run directory holding bytes that are not UTF-8 (a file name from another locale):
    the process is still found and described, the bad bytes shown as U+FFFD; an argument ending in X keeps it
    (only trailing NULs are cut); a process with no command line (a zombie's) reads '?'."""
    env = {os.fsencode(k): os.fsencode(v) for k, v in os.environ.items() if k != runprocs.MARKER}
    env[runprocs.MARKER.encode()] = os.fsencode(str(tmp_path)) + b"/r\xff"
    p = subprocess.Popen([sys.executable.encode(), b"-c", SLEEP.encode(), b"caf\xe9X"], env=env,
                         stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: b"caf" in Path(f"/proc/{p.pid}/cmdline").read_bytes(), what="the child's exec")
        assert runprocs._argv(p.pid) == f"{sys.executable} -c {SLEEP} caf\ufffdX"
        marked = runprocs.marked_processes()
        assert [q.pid for q in marked[f"{tmp_path}/r\ufffd"]] == [p.pid]
    finally:
        p.kill()
        p.wait()
    z = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: _state(z.pid) == "Z", what="the child's exit (not reaped)")
    assert runprocs._argv(z.pid) == "?"
    z.wait()
