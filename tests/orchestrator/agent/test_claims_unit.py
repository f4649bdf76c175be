"""GPU claims and the per-experiment launch lock as units (orchestrator.agent.claims, launchlock.LaunchLock): real
files, real flock, real processes for liveness; no launch. Fast, so the mutation run (tests/mutation/run.py)
can use them; the races through real launches are in ops/test_launch_claims.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.agent import claims
from orchestrator.agent import launchlock, liveness, rundirs
from orchestrator.agent.protocol import AgentFailure


class Emit:
    def __init__(self):
        self.progress_calls: list[tuple[str, str]] = []

    def progress(self, step: str, message: str) -> None:
        self.progress_calls.append((step, message))


def on_disk(workdir: Path) -> dict:
    return json.loads((workdir / "locks" / claims.CLAIMS_NAME).read_text())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def make_run(workdir: Path, run_id: str, ended: bool = False) -> None:
    """A run directory as start_training.sh leaves it: its command's pid (this test process: alive), and
    exit.json once it ended."""
    run = workdir / "runs" / run_id
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": run_id, "experiment": run_id.split("-")[0]}))
    (run / "pid").write_text(f"{os.getpid()}\n")
    if ended:
        (run / "exit.json").write_text(json.dumps({"exit_code": 0}))


def test_a_claim_is_all_gpus_of_the_launch_and_names_this_process(tmp_path):
    token = claims.claim(tmp_path, [1, 3], {"run_id": "a-1", "experiment": "a"}, Emit(), wait_s=0)
    data = on_disk(tmp_path)
    assert sorted(data) == ["1", "3"]
    for entry in data.values():
        assert entry["token"] == token and entry["phase"] == "launch" and entry["pid"] == os.getpid()
        assert entry["run_id"] == "a-1" and entry["experiment"] == "a" and entry["since"].endswith("Z")
    assert sorted(claims.held(tmp_path, [0, 1, 2, 3])) == [1, 3]
    assert claims.held(tmp_path, [0, 2]) == {}


def test_an_overlapping_claim_is_refused_naming_gpu_and_run_and_takes_nothing(tmp_path):
    first = claims.claim(tmp_path, [1, 2], {"run_id": "a-1", "experiment": "a"}, Emit(), wait_s=0)
    make_run(tmp_path, "a-1")
    claims.promote(tmp_path, first, "a-1")  # a running run: refused at once, no waiting
    emit = Emit()
    with pytest.raises(AgentFailure) as info:
        claims.claim(tmp_path, [2, 5], {"run_id": "b-1", "experiment": "b"}, emit, wait_s=30)
    err = info.value
    assert err.type == "GpuClaimed" and emit.progress_calls == []
    assert err.message == "GPU 2 is held by run a-1 (experiment a), running"
    assert err.fix.startswith("wait for run a-1 to end, or stop it (dflashctl stop a-1)")
    assert err.data["gpus"] == [2]
    assert sorted(on_disk(tmp_path)) == ["1", "2"]  # all or none: GPU 5 was not taken either
    assert claims.claim(tmp_path, [0, 5], {"run_id": "c-1", "experiment": "c"}, Emit(), wait_s=0)  # disjoint: fine
    assert sorted(on_disk(tmp_path)) == ["0", "1", "2", "5"]


def test_a_launch_in_its_preflight_is_waited_for_then_refused_with_the_wait(tmp_path):
    claims.claim(tmp_path, [4], {"run_id": "a-1", "experiment": "a"}, Emit(), wait_s=0)
    emit = Emit()
    with pytest.raises(AgentFailure) as info:
        claims.claim(tmp_path, [4], {"run_id": "b-1", "experiment": "b"}, emit, wait_s=0.6)
    assert info.value.message.startswith("GPU 4 is held by run a-1 (experiment a), launching since ")
    assert info.value.message.endswith("(waited 1 s for its preflight)")
    assert len(emit.progress_calls) == 1  # announced once, not once per poll
    step, text = emit.progress_calls[0]
    assert step == "gpus" and text.endswith("; waiting up to 1 s for its preflight") and "GPU 4" in text


def test_two_holders_are_named_in_the_fix(tmp_path):
    a = claims.claim(tmp_path, [0], {"run_id": "a-1", "experiment": "a"}, Emit(), wait_s=0)
    b = claims.claim(tmp_path, [1], {"run_id": None, "experiment": "w"}, Emit(), wait_s=0)
    make_run(tmp_path, "a-1")
    claims.promote(tmp_path, a, "a-1")
    with pytest.raises(AgentFailure) as info:
        claims.claim(tmp_path, [0, 1], {"run_id": "c-1", "experiment": "c"}, Emit(), wait_s=0)
    assert info.value.message == ("GPU 0 is held by run a-1 (experiment a), running; GPU 1 is held by the warm-up "
                                  f"of experiment w, since {on_disk(tmp_path)['1']['since']} (pid {os.getpid()})")
    assert info.value.fix.startswith("wait for runs (the warm-up of w), a-1 to end, or stop them")
    claims.release(tmp_path, b)
    assert sorted(on_disk(tmp_path)) == ["0"]


def test_release_drops_only_this_launchs_claims_and_promote_passes_them_to_the_run(tmp_path):
    a = claims.claim(tmp_path, [0, 1], {"run_id": "a-1", "experiment": "a"}, Emit(), wait_s=0)
    b = claims.claim(tmp_path, [2], {"run_id": "b-1", "experiment": "b"}, Emit(), wait_s=0)
    claims.promote(tmp_path, b, "b-1-2")
    assert {k: (c["phase"], c["run_id"]) for k, c in on_disk(tmp_path).items()} == {
        "0": ("launch", "a-1"), "1": ("launch", "a-1"), "2": ("run", "b-1-2")}
    claims.release(tmp_path, a)
    assert sorted(on_disk(tmp_path)) == ["2"]
    claims.release(tmp_path, "no-such-token")
    assert sorted(on_disk(tmp_path)) == ["2"]


def _write_claims(workdir: Path, data: dict) -> None:
    (workdir / "locks").mkdir(parents=True, exist_ok=True)
    (workdir / "locks" / claims.CLAIMS_NAME).write_text(json.dumps(data))


def test_stale_claims_are_dropped_by_the_next_claim(tmp_path):
    me = claims.this_process()
    make_run(tmp_path, "ended-1", ended=True)
    make_run(tmp_path, "live-1")
    _write_claims(tmp_path, {
        "0": {"phase": "launch", "pid": dead_pid(), "token": "t0", "run_id": "x-1"},          # launcher died
        "1": {"phase": "launch", "pid": me["pid"], "pid_start": me["pid_start"] - 100, "token": "t1"},  # pid reused
        "2": {"phase": "run", "run_id": "ended-1", "token": "t2"},                           # run ended
        "3": {"phase": "run", "run_id": "gone-1", "token": "t3"},                            # run dir deleted
        "4": {"phase": "run", "run_id": "../etc", "token": "t4"},                            # not a run id
        "5": {"phase": "launch", "pid": "42", "token": "t5"},                                # not a pid
        "6": {"phase": "run", "run_id": "live-1", "token": "t6"},                            # still running
    })
    assert sorted(claims.held(tmp_path, list(range(8)))) == [6]
    token = claims.claim(tmp_path, [0, 1, 2, 3, 4, 5], {"run_id": "n-1", "experiment": "n"}, Emit(), wait_s=0)
    data = on_disk(tmp_path)
    assert {k: c["token"] for k, c in data.items()} == {**{str(g): token for g in range(6)}, "6": "t6"}
    with pytest.raises(AgentFailure, match="GPU 6 is held by run live-1"):
        claims.claim(tmp_path, [6], {"run_id": "m-1", "experiment": "m"}, Emit(), wait_s=0)


def test_a_claim_within_the_pid_start_tolerance_is_alive(tmp_path):
    me = claims.this_process()
    assert claims.claim_alive(tmp_path, {"phase": "launch", "pid": me["pid"], "pid_start": me["pid_start"] + 1.5})
    assert claims.claim_alive(tmp_path, {"phase": "launch", "pid": me["pid"]})  # no start time: the pid decides
    assert not claims.claim_alive(tmp_path, {"phase": "launch", "pid": me["pid"], "pid_start": me["pid_start"] + 3})


# ------------------------------------------------------------------------------------------ the lock


def test_the_launch_lock_is_one_holder_at_a_time_and_names_it(tmp_path):
    first = launchlock.LaunchLock(tmp_path, "exp")
    holder = {"pid": 4242, "run_id": "exp-20260101T000000Z", "since": "2026-01-01T00:00:00Z"}
    first.acquire(holder)
    lock_file = tmp_path / "locks" / "exp.lock"
    assert json.loads(lock_file.read_text()) == holder
    second = launchlock.LaunchLock(tmp_path, "exp")
    with pytest.raises(AgentFailure) as info:
        second.acquire({"pid": 1})
    assert info.value.type == "LockHeld"
    assert info.value.message == (f"another launch of experiment exp holds {lock_file}: pid 4242 launching run "
                                  "exp-20260101T000000Z since 2026-01-01T00:00:00Z")
    assert info.value.fix == "wait for it to finish, then check `dflashctl status`"
    assert info.value.data == {"holder": holder, "lock": str(lock_file)}
    other = launchlock.LaunchLock(tmp_path, "other")  # another experiment: its own lock
    other.acquire({"pid": 2})
    other.release()
    first.release()
    assert lock_file.read_text() == "" and first.fd is None
    second.acquire({"pid": 7})  # free again
    assert json.loads(lock_file.read_text()) == {"pid": 7}
    second.release()
    first.release()  # a second release does nothing


def test_the_lock_is_held_by_the_process_until_release_even_across_processes(tmp_path):
    lock = launchlock.LaunchLock(tmp_path, "exp")
    lock.acquire({"pid": os.getpid(), "run_id": "r", "since": "s"})
    probe = ("import sys; from orchestrator.agent import launchlock\n"
             "try:\n    launchlock.LaunchLock(sys.argv[1], 'exp').acquire({'pid': 1})\n"
             "except Exception as e:\n    print(type(e).__name__, e.type)\nelse:\n    print('acquired')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "AgentFailure LockHeld", out.stderr
    lock.release()
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "acquired", out.stderr


def test_a_holder_that_never_wrote_its_name_is_described(tmp_path):
    (tmp_path / "locks").mkdir()
    lock_file = tmp_path / "locks" / "exp.lock"
    import fcntl

    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(AgentFailure) as info:
            launchlock.LaunchLock(tmp_path, "exp").acquire({"pid": 1})
        assert info.value.message == (f"another launch of experiment exp holds {lock_file}: a launch that has not "
                                      "written its name yet")
    finally:
        os.close(fd)
    with pytest.raises(AgentFailure, match="bad experiment name"):
        launchlock.LaunchLock(tmp_path, "../x")


# ------------------------------------------------------------------------- edges the mutation run found


def test_aliveness_is_checked_per_holder_not_shared_between_holders(tmp_path):
    # Two warm-ups (no run id, same phase): one launcher died, one lives. The dead one's verdict must not be
    # reused for the live one.
    me = claims.this_process()
    _write_claims(tmp_path, {
        "0": {"phase": "launch", "pid": dead_pid(), "token": "t0", "run_id": None, "experiment": "w0"},
        "1": {"phase": "launch", "pid": me["pid"], "pid_start": me["pid_start"], "token": "t1", "run_id": None,
              "experiment": "w1"},
    })
    claims.claim(tmp_path, [0], {"run_id": "n-1", "experiment": "n"}, Emit(), wait_s=0)
    assert on_disk(tmp_path)["1"]["token"] == "t1"
    with pytest.raises(AgentFailure, match="GPU 1 is held by the warm-up of experiment w1"):
        claims.claim(tmp_path, [1], {"run_id": "m-1", "experiment": "m"}, Emit(), wait_s=0)


def test_a_claim_without_a_token_still_holds_its_gpu(tmp_path):
    me = claims.this_process()
    _write_claims(tmp_path, {"3": {"phase": "launch", "pid": me["pid"], "run_id": "old-1", "experiment": "old"}})
    with pytest.raises(AgentFailure, match="GPU 3 is held by run old-1"):
        claims.claim(tmp_path, [3], {"run_id": "n-1", "experiment": "n"}, Emit(), wait_s=0)


def test_waiting_names_every_held_gpu(tmp_path):
    claims.claim(tmp_path, [0], {"run_id": "a-1", "experiment": "a"}, Emit(), wait_s=0)
    claims.claim(tmp_path, [1], {"run_id": "b-1", "experiment": "b"}, Emit(), wait_s=0)
    emit = Emit()
    with pytest.raises(AgentFailure):
        claims.claim(tmp_path, [0, 1], {"run_id": "c-1", "experiment": "c"}, emit, wait_s=0.2)
    text = emit.progress_calls[0][1]
    assert text.startswith("GPU 0 is held by run a-1 (experiment a), launching since ")
    assert "; GPU 1 is held by run b-1 (experiment b), launching since " in text


def test_a_run_id_longer_than_a_name_and_a_path_outside_runs(tmp_path):
    long_id = ("x" * 64) + "-" + ("y" * 40) + "-20260101T000000Z"
    make_run(tmp_path, long_id)
    (tmp_path / "locks").mkdir(exist_ok=True)
    assert claims.claim_alive(tmp_path, {"phase": "run", "run_id": long_id})  # any run id launch makes
    assert not claims.claim_alive(tmp_path, {"phase": "run", "run_id": "../locks"})  # a directory, not a run
    assert not claims.claim_alive(tmp_path, {"phase": "run", "run_id": 7})


def test_the_pid_start_tolerance_is_two_seconds_inclusive(tmp_path, monkeypatch):
    monkeypatch.setattr(liveness, "process_start", lambda pid: 1000.0)
    me = os.getpid()
    assert claims.claim_alive(tmp_path, {"phase": "launch", "pid": me, "pid_start": 1002.0})
    assert claims.claim_alive(tmp_path, {"phase": "launch", "pid": me, "pid_start": 998.0})
    assert not claims.claim_alive(tmp_path, {"phase": "launch", "pid": me, "pid_start": 1002.5})


def test_promote_restamps_since(tmp_path):
    token = claims.claim(tmp_path, [2], {"run_id": "a-1", "experiment": "a"}, Emit(), wait_s=0)
    data = on_disk(tmp_path)
    data["2"]["since"] = "2000-01-01T00:00:00Z"
    _write_claims(tmp_path, data)
    claims.promote(tmp_path, token, "a-1")
    since = on_disk(tmp_path)["2"]["since"]
    assert since != "2000-01-01T00:00:00Z" and since.startswith("20") and since.endswith("Z")


def test_the_first_lock_makes_its_directories_and_a_0644_file_and_an_unused_lock_releases_nothing(tmp_path):
    workdir = tmp_path / "not" / "yet"
    lock = launchlock.LaunchLock(workdir, "exp")
    lock.release()  # never acquired: nothing to release, no error
    old = os.umask(0o022)
    try:
        lock.acquire({"pid": 1})
    finally:
        os.umask(old)
    path = workdir / "locks" / "exp.lock"
    assert (path.stat().st_mode & 0o777) == 0o644 and json.loads(path.read_text()) == {"pid": 1}
    lock.release()


def marked_sleeper(run_dir: Path) -> subprocess.Popen:
    """A real process carrying the run's environment marker, as every process a run starts does (a rank
    that outlived its launcher, here), in a session of its own as torch starts ranks."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                            env={**os.environ, "DFLASHCTL_RUN_DIR": str(run_dir)})
    for _ in range(100):  # the marker is readable once the exec is done
        if liveness.live_processes(rundirs.load_ref(run_dir)):
            break
        import time

        time.sleep(0.05)
    return proc


def test_a_run_with_a_live_process_keeps_its_gpus_after_exit_json(tmp_path):
    """A launcher killed under its ranks wrote exit.json (failed), but a rank lives on its GPUs: the claim
    stays, the GPU is refused to the next launch naming the run; once the rank is gone the GPU is free."""
    token = claims.claim(tmp_path, [0], {"run_id": "a-1", "experiment": "a"}, Emit(), wait_s=0)
    make_run(tmp_path, "a-1", ended=True)
    (tmp_path / "runs" / "a-1" / "pid").write_text(f"{dead_pid()}\n")  # the launcher is gone
    claims.promote(tmp_path, token, "a-1")
    rank = marked_sleeper(tmp_path / "runs" / "a-1")
    try:
        with pytest.raises(AgentFailure) as info:
            claims.claim(tmp_path, [0], {"run_id": "b-1", "experiment": "b"}, Emit(), wait_s=0)
        assert info.value.message == (f"GPU 0 is held by run a-1 (experiment a), ended, but its pid {rank.pid} "
                                      f"({sys.executable} -c import time; time.sleep(60)) still run")
    finally:
        rank.kill()
        rank.wait()
    assert claims.claim(tmp_path, [0], {"run_id": "b-1", "experiment": "b"}, Emit(), wait_s=0)


def test_a_run_whose_liveness_is_unknown_keeps_its_gpus(tmp_path, monkeypatch):
    """No exit.json, no pid file yet, and no tmux to ask (not on PATH): nothing knows the run gone, so its GPU
    is not handed to another launch."""
    token = claims.claim(tmp_path, [3], {"run_id": "a-1", "experiment": "a"}, Emit(), wait_s=0)
    make_run(tmp_path, "a-1")
    (tmp_path / "runs" / "a-1" / "pid").unlink()
    claims.promote(tmp_path, token, "a-1")
    monkeypatch.setenv("PATH", str(tmp_path / "no-tmux-here"))
    ref = rundirs.load_ref(tmp_path / "runs" / "a-1")
    assert liveness.run_alive(ref) is None  # unknown, not gone
    assert sorted(claims.held(tmp_path, [3])) == [3]
    with pytest.raises(AgentFailure) as info:
        claims.claim(tmp_path, [3], {"run_id": "b-1", "experiment": "b"}, Emit(), wait_s=0)
    assert info.value.type == "GpuClaimed"


# ------------------------------------------------- what the mutation run found untested (tests/mutation/run.py)


def test_tokenless_claims_of_two_runs_are_checked_each_not_as_one_holder(tmp_path):
    """Claims written without a token (an older agent's): one holder per run and phase, so a dead launch of
    run r-1 does not make r-1's live run claim, nor a dead run d-1 make the live run live-1, look dead."""
    make_run(tmp_path, "ended-1", ended=True)
    make_run(tmp_path, "live-1")
    make_run(tmp_path, "r-1")
    _write_claims(tmp_path, {
        "0": {"phase": "run", "run_id": "ended-1"},
        "1": {"phase": "run", "run_id": "live-1", "experiment": "live"},
        "2": {"phase": "launch", "pid": dead_pid(), "run_id": "r-1"},
        "3": {"phase": "run", "run_id": "r-1", "experiment": "r"},
    })
    with pytest.raises(AgentFailure) as info:
        claims.claim(tmp_path, [1, 3], {"run_id": "n-1", "experiment": "n"}, Emit(), wait_s=0)
    assert info.value.message == ("GPU 1 is held by run live-1 (experiment live), running; "
                                  "GPU 3 is held by run r-1 (experiment r), running")


def test_a_run_claim_naming_the_runs_parent_is_no_claim(tmp_path, monkeypatch):
    """run_id '..' is a string but not a run id: runs/.. is the workdir, a directory, and must not read as a
    run whose liveness is unknown (no tmux to ask), which would hold the GPU for ever."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-tmux-here"))
    _write_claims(tmp_path, {"0": {"phase": "run", "run_id": "..", "token": "t"},
                             "1": {"phase": "run", "run_id": 7, "token": "u"}})
    assert not claims.claim_alive(tmp_path, {"phase": "run", "run_id": ".."})
    assert not claims.claim_alive(tmp_path, {"phase": "run", "run_id": None})
    assert claims.held(tmp_path, [0, 1]) == {}


def test_a_launch_claim_of_an_ended_run_is_launching_and_names_no_survivors(tmp_path):
    """A resume's launch claims the old run's id while the old run's exit.json is there and one of its
    processes still lives: the claim is the launch's (launching), survivors are named only for run claims."""
    make_run(tmp_path, "a-1", ended=True)
    (tmp_path / "runs" / "a-1" / "pid").write_text(f"{dead_pid()}\n")
    rank = marked_sleeper(tmp_path / "runs" / "a-1")
    try:
        claims.claim(tmp_path, [0], {"run_id": "a-1", "experiment": "a"}, Emit(), wait_s=0)
        with pytest.raises(AgentFailure) as info:
            claims.claim(tmp_path, [0], {"run_id": "b-1", "experiment": "b"}, Emit(), wait_s=0)
    finally:
        rank.kill()
        rank.wait()
    assert "launching since" in info.value.message
    assert "survivors" not in info.value.data["claims"]["0"]
    assert info.value.data["claims"]["0"] == on_disk(tmp_path)["0"]


def test_a_launch_that_becomes_a_run_while_waited_for_is_refused_as_running_without_the_wait(tmp_path):
    import threading

    token = claims.claim(tmp_path, [2], {"run_id": "a-1", "experiment": "a"}, Emit(), wait_s=0)

    def start_the_run():
        make_run(tmp_path, "a-1")
        claims.promote(tmp_path, token, "a-1")

    timer = threading.Timer(0.8, start_the_run)
    timer.start()
    emit = Emit()
    try:
        with pytest.raises(AgentFailure) as info:
            claims.claim(tmp_path, [2], {"run_id": "b-1", "experiment": "b"}, emit, wait_s=30)
    finally:
        timer.join()
    assert len(emit.progress_calls) == 1  # it did wait for the preflight
    assert info.value.message == "GPU 2 is held by run a-1 (experiment a), running"  # no "(waited N s ...)"


def test_the_refusal_names_the_wait_from_half_a_second_and_carries_the_claims_by_gpu():
    c = {"run_id": "a-1", "experiment": "a", "phase": "run"}
    err = claims.refusal({1: c})
    assert err.message == "GPU 1 is held by run a-1 (experiment a), running"  # preflight's call: no wait
    assert err.fix == ("wait for run a-1 to end, or stop it (dflashctl stop a-1), or change this experiment's "
                       "layout")
    assert err.data == {"claims": {"1": c}, "gpus": [1]}
    assert claims.refusal({1: c}, 0.5).message.endswith(", running (waited 0 s for its preflight)")
    assert claims.refusal({1: c}, 0.49).message.endswith(", running")
    two = claims.refusal({3: c, 1: {**c, "run_id": "b-2"}})
    assert two.fix == "wait for runs a-1, b-2 to end, or stop them, or change this experiment's layout"
    assert two.data["gpus"] == [1, 3] and list(two.data["claims"]) == ["3", "1"]


def test_an_ended_run_with_a_long_id_names_its_survivors(tmp_path):
    """Run ids are longer than names (experiment, stamp, clash suffix): the survivors of one longer than 64
    characters are named too."""
    long_id = ("x" * 64) + "-" + ("y" * 40) + "-20260101T000000Z"
    token = claims.claim(tmp_path, [0], {"run_id": long_id, "experiment": "x" * 64}, Emit(), wait_s=0)
    make_run(tmp_path, long_id, ended=True)
    (tmp_path / "runs" / long_id / "pid").write_text(f"{dead_pid()}\n")
    claims.promote(tmp_path, token, long_id)
    rank = marked_sleeper(tmp_path / "runs" / long_id)
    try:
        with pytest.raises(AgentFailure) as info:
            claims.claim(tmp_path, [0], {"run_id": "b-1", "experiment": "b"}, Emit(), wait_s=0)
    finally:
        rank.kill()
        rank.wait()
    assert info.value.message.endswith(f"ended, but its pid {rank.pid} ({sys.executable} -c import time; "
                                       "time.sleep(60)) still run")


def test_a_run_claim_whose_id_is_a_path_to_a_live_run_is_no_claim(tmp_path):
    """'a-1/.' leads to the live run a-1's directory but is not a run id: the claim does not hold."""
    make_run(tmp_path, "a-1")
    assert claims.claim_alive(tmp_path, {"phase": "run", "run_id": "a-1"})
    assert not claims.claim_alive(tmp_path, {"phase": "run", "run_id": "a-1/."})
