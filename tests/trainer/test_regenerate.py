"""The regeneration stage (trainer.regenerate, trainer.engines): sharded and resumable after kill -9 with a
byte-identical result, content-keyed reuse, clear errors for a corrupt shard, a dying or hanging engine and an
endpoint that answers errors; the vllm and openai engines against a real vLLM (marked `vllm`)."""

from __future__ import annotations

import http.server
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

import pytest

from trainer.config import TinyTargetConfig, parse_config
from trainer.data import SkipReport, read_conversations
from trainer.engines import EngineError, HFEngine, _retrying
from trainer.regenerate import (
    RegenerateError, dataset_dir, dataset_files, dataset_key, engine_spec, key_inputs, read_manifest,
    regenerated_files, run_stage, worker_slots,
)
from trainer.tiny import build_target_model, build_tokenizer, generate_prompts
from vllm_venv import vllm_python

# head_dim 64: vLLM's CPU attention needs >= 32 (the default tiny target has 16).
TARGET = TinyTargetConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64)
MAX_NEW = 12
SHARD = 4


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("regen-target") / "target"
    tok = build_tokenizer(TARGET)
    model = build_target_model(TARGET, tok)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _write_convs(path: Path, n: int, seed: int = 5) -> Path:
    """n conversations (every fifth with two assistant turns) and one bad line."""
    lines = []
    for i, p in enumerate(generate_prompts(TinyTargetConfig(num_prompts=max(n, 4), seed=seed))[:n]):
        msgs = [{"role": "user", "content": p}, {"role": "assistant", "content": "x"}]
        if i % 5 == 0:
            msgs += [{"role": "user", "content": "continue : kato ."}, {"role": "assistant", "content": "y"}]
        lines.append(json.dumps({"messages": msgs}))
    lines.insert(3, "{not json")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def convs_file(tmp_path_factory) -> Path:
    return _write_convs(tmp_path_factory.mktemp("regen-data") / "convs.jsonl", 20)


def _cfg(target_dir: Path, files, **data):
    raw = {"model": {"target": str(target_dir), "num_target_features": 1},
           "data": {"train_files": [str(f) for f in files], "regenerate_max_new_tokens": MAX_NEW,
                    "regenerate_shard_size": SHARD, **data}}
    return parse_config(raw)


def _write_cfg(path: Path, target_dir: Path, files, **data) -> Path:
    cfg = _cfg(target_dir, files, **data)
    path.write_text(cfg.model_dump_json())
    return path


@pytest.fixture(scope="module")
def hf_engine(target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype="float32").eval()
    return HFEngine(model, tok, MAX_NEW)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, target_dir, convs_file, hf_engine) -> Path:
    """The uninterrupted hf regeneration of convs_file (in this process)."""
    root = tmp_path_factory.mktemp("regen-ref")
    return run_stage(_cfg(target_dir, [convs_file]), target_dir, [convs_file], root, engine=hf_engine,
                     tokenizer=hf_engine.tokenizer, log=lambda _: None)


def _tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _stage(cfg_file: Path, root: Path, *extra: str, python: str = sys.executable, env: dict | None = None):
    return subprocess.Popen([python, "-m", "trainer", "regenerate", str(cfg_file), "--datasets", str(root), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    st = Path(f"/proc/{pid}/stat")
    return st.exists() and st.read_text().split()[2] != "Z"


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_dataset_holds_every_conversation_regenerated_with_counts(reference, convs_file, hf_engine):
    """The shards read back through read_conversations, in input order, each assistant turn the engine's own
    greedy text; the manifest counts conversations, response tokens and the skipped bad line."""
    m = read_manifest(reference)
    assert m["complete"] and m["conversations"] == 20 and len(m["shards"]) == 5
    assert m["skipped"]["total"] == 1 and "convs.jsonl:4" in m["skipped"]["where"]["bad JSON"][0]
    got = read_conversations(dataset_files(reference))
    src = read_conversations([convs_file])
    assert [c.messages[0] for c in got] == [c.messages[0] for c in src]
    assert got[0].messages[3]["content"] not in ("x", "y") and len(got[0].messages) == 4
    tok = hf_engine.tokenizer
    prompt = tok(tok.apply_chat_template(got[1].messages[:1], add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    assert got[1].messages[1]["content"] == hf_engine.generate([prompt])[0].text
    assert m["response_tokens"] == sum(r["response_tokens"] for r in m["shards"]) > 0


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_kill_9_mid_run_redoes_at_most_the_shard_in_flight_and_ends_byte_identical(tmp_path, target_dir, convs_file,
                                                                                     reference):
    """kill -9 of the stage after its first finished shard: its engine worker dies with it; the relaunch keeps
    every finished shard, redoes only the rest, and the dataset is byte-identical to an uninterrupted run's."""
    cfg = _write_cfg(tmp_path / "cfg.json", target_dir, [convs_file])
    root = tmp_path / "datasets"
    out = dataset_dir(root, read_manifest(reference)["key"])
    proc = _stage(cfg, root, "--run-dir", str(tmp_path / "run"))
    worker_pid = None
    for line in proc.stdout:
        if line.startswith("regen worker=0 pid="):
            worker_pid = int(line.split("pid=")[1].split()[0])
            break
    _wait(lambda: list(out.glob("shard-*.json")), 300, "the first finished shard")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = {p.name for p in out.glob("shard-*.json")}
    assert len(finished) < 5, "the stage finished before the kill: the test proves nothing"
    _wait(lambda: not _pid_alive(worker_pid), 10, "the engine worker to die with its stage")

    again = _stage(cfg, root, "--run-dir", str(tmp_path / "run"))
    stdout, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stderr
    start = next(line for line in stdout.splitlines() if line.startswith("regen start"))
    assert f"done_before={len(finished)} " in start and f"todo={5 - len(finished)} " in start
    assert stdout.splitlines()[-1] == str(out)
    assert _tree(out) == _tree(reference)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r.get("kind") == "regen"][-1]
    assert last["regen_conversations"] == last["regen_conversations_total"] == 20 and "step" not in last


def test_same_key_reuses_and_a_changed_cap_or_input_makes_a_new_dataset(tmp_path, target_dir, convs_file, reference,
                                                                         hf_engine):
    """The same key: zero conversations regenerated, nothing rewritten; a changed regenerate_max_new_tokens or
    input file: another key and a new dataset, the old one left complete."""
    root = reference.parent
    before = {p.name: p.stat().st_mtime_ns for p in reference.iterdir()}
    lines: list[str] = []
    cfg = _cfg(target_dir, [convs_file])
    assert run_stage(cfg, target_dir, [convs_file], root, engine=hf_engine, tokenizer=hf_engine.tokenizer,
                     log=lines.append) == reference
    assert any("reused=1" in x and "regenerated=0" in x for x in lines)
    assert {p.name: p.stat().st_mtime_ns for p in reference.iterdir()} == before

    small = _write_convs(tmp_path / "small.jsonl", 3)
    keys = set()
    for c, files in ((_cfg(target_dir, [small]), [small]), (_cfg(target_dir, [small], regenerate_max_new_tokens=5), [small])):
        lines.clear()
        got = run_stage(c, target_dir, files, root, engine=HFEngine(hf_engine.model, hf_engine.tokenizer,
                        c.data.regenerate_max_new_tokens), tokenizer=hf_engine.tokenizer, log=lines.append)
        keys.add(got.name)
        assert any("regenerated=3" in x for x in lines)
    assert len(keys) == 2 and reference.name not in keys
    assert read_manifest(reference)["complete"]
    spec = engine_spec(cfg, target_dir, "float32")
    inputs = key_inputs(cfg, target_dir, [convs_file], spec)
    assert dataset_key(inputs) == read_manifest(reference)["key"]
    changed = tmp_path / "changed.jsonl"
    changed.write_bytes(convs_file.read_bytes().replace(b"continue : kato", b"continue : kami"))
    assert dataset_key(key_inputs(cfg, target_dir, [changed], spec)) != dataset_key(inputs)


def test_a_corrupt_or_truncated_shard_is_named_with_a_fix_that_works(tmp_path, target_dir, convs_file, reference,
                                                                      hf_engine):
    """A finished shard changed on disk is never used: the error names the file, says truncated or corrupt and
    gives an rm that, pasted, makes the next run redo that shard alone (the result equals the reference)."""
    root = tmp_path / "datasets"
    out = root / reference.name
    shutil.copytree(reference, out)
    other = out / "shard-00002.jsonl"
    other.write_bytes(other.read_bytes().replace(b"assistant", b"assistanT", 1))
    with pytest.raises(RegenerateError, match="shard-00002.jsonl: corrupt"):
        dataset_files(out)
    other.write_bytes((reference / other.name).read_bytes())
    shard = out / "shard-00001.jsonl"
    shard.write_bytes(shard.read_bytes()[:-20])
    cfg = _cfg(target_dir, [convs_file])
    with pytest.raises(RegenerateError) as err:
        dataset_files(out)
    assert str(shard) in str(err.value) and "truncated" in str(err.value)
    with pytest.raises(RegenerateError) as err:
        run_stage(cfg, target_dir, [convs_file], root, engine=hf_engine, tokenizer=hf_engine.tokenizer, log=lambda _: None)
    msg = str(err.value)
    assert str(shard) in msg and "truncated" in msg
    fix = msg.split("delete it and its record (")[1].split(")")[0]
    subprocess.run(fix, shell=True, check=True)
    lines: list[str] = []
    run_stage(cfg, target_dir, [convs_file], root, engine=hf_engine, tokenizer=hf_engine.tokenizer, log=lines.append)
    assert any(f"regenerated={SHARD} " in x for x in lines)
    assert _tree(out) == _tree(reference)


def test_the_trainer_regenerates_in_process_once_then_reuses_the_dataset(tmp_path, target_dir, convs_file, reference):
    """build_samples with data.regenerate: the first run of a target makes the dataset in process (hf, the
    trainer's own target) under the workdir's datasets/, the same bytes as the stage's; a second run of the same
    key reuses it and regenerates nothing; the bad input line is in the run's skip report."""
    import torch
    from transformers import AutoTokenizer

    from trainer.setup import Sources, build_samples, load_target

    cfg = _cfg(target_dir, [convs_file])
    target = load_target(cfg, target_dir, torch.device("cpu"))
    tok = AutoTokenizer.from_pretrained(target_dir)
    src = Sources(target_dir, [str(convs_file)], [], True)
    for run, expect in (("r1", "todo=5 "), ("r2", "reused=1")):
        lines: list[str] = []
        build_samples(cfg, src, target, tok, tmp_path / "runs" / run, lines.append)
        assert any(expect in x for x in lines), lines
        skipped = json.loads((tmp_path / "runs" / run / "data" / "skipped.json").read_text())
        assert skipped["counts"].get("bad JSON") == 1
    assert _tree(tmp_path / "datasets" / reference.name) == _tree(reference)


def _start_and_wait_worker(proc) -> int:
    pid = None
    for line in proc.stdout:
        if line.startswith("regen worker=0 pid="):
            pid = int(line.split("pid=")[1].split()[0])
        if line.startswith("regen worker=0 ready=1"):
            return pid
    raise AssertionError(f"the stage ended before its worker was ready: {proc.stderr.read()}")


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_an_engine_that_dies_or_hangs_stops_the_stage_naming_it(tmp_path, target_dir):
    """A worker killed mid-run: the stage exits non-zero with one line naming the engine worker and how it
    died; a stopped (hung) worker: the watchdog's error after regenerate_timeout_s. Finished shards stay."""
    data = _write_convs(tmp_path / "c.jsonl", 40)
    cfg = _write_cfg(tmp_path / "cfg.json", target_dir, [data], regenerate_max_new_tokens=48, regenerate_timeout_s=10)
    root = tmp_path / "datasets"
    proc = _stage(cfg, root)
    pid = _start_and_wait_worker(proc)
    os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    [err] = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert err.startswith("error: hf engine worker 0 (cpu0, pid ") and "died (killed by SIGKILL)" in err
    assert "run the stage again" in err

    proc = _stage(cfg, root)
    pid = _start_and_wait_worker(proc)
    os.kill(pid, signal.SIGSTOP)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 2
    [err] = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert "hf engine worker 0" in err and "hangs" in err and "after 10 s (data.regenerate_timeout_s)" in err
    assert not read_manifest(next(root.glob("regen-*"))).get("complete")


class _Failing(http.server.BaseHTTPRequestHandler):
    code = 500

    def _answer(self):
        self.send_response(self.code)
        self.end_headers()
        self.wfile.write(b'{"error": "boom"}')

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def failing_server():
    servers = []

    def start(code: int) -> str:
        handler = type("H", (_Failing,), {"code": code})
        s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
        return f"http://127.0.0.1:{s.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_an_endpoint_that_answers_errors_stops_with_its_url(tmp_path, target_dir, convs_file, failing_server):
    """openai engine: 500s are retried with backoff for regenerate_timeout_s, then one error naming the URL
    and the fix; a 4xx is not retried (a wrong model name does not heal)."""
    url = failing_server(500)
    cfg = _cfg(target_dir, [convs_file], regenerate_engine="openai", regenerate_url=url, regenerate_timeout_s=10)
    t = time.monotonic()
    with pytest.raises(EngineError) as err:
        run_stage(cfg, target_dir, [convs_file], tmp_path, log=lambda _: None)
    assert 9 < time.monotonic() - t < 30
    assert url in str(err.value) and "HTTP 500" in str(err.value) and "did not answer" in str(err.value)
    url = failing_server(404)
    cfg = _cfg(target_dir, [convs_file], regenerate_engine="openai", regenerate_url=url, regenerate_model="m")
    with pytest.raises((EngineError, RegenerateError), match="HTTP 404"):
        run_stage(cfg, target_dir, [convs_file], tmp_path, log=lambda _: None)
    assert not list(tmp_path.glob("regen-*/shard-*"))


def test_retries_back_off_and_recover():
    """Connection errors are retried with doubling sleeps; a later success is returned."""
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise urllib.error.URLError("refused")
        return "ok"

    assert _retrying("GET /x", "http://h:1", flaky, 60, sleep=sleeps.append) == "ok"
    assert sleeps == [0.25, 0.5, 1.0]


def test_config_errors_say_how_to_fix(target_dir, convs_file):
    """An openai engine without a URL, a URL without the openai engine, more CPU workers than cores, GPUs that
    do not split into tensor-parallel groups: each refused with the setting to change."""
    with pytest.raises(ValueError, match="regenerate_url: http://"):
        _cfg(target_dir, [convs_file], regenerate_engine="openai")
    with pytest.raises(ValueError, match="set regenerate_engine: openai, or delete them"):
        _cfg(target_dir, [convs_file], regenerate_url="http://x:1")
    cfg = _cfg(target_dir, [convs_file], regenerate_workers=3)
    with pytest.raises(RegenerateError, match="at most 2"):
        worker_slots(cfg, engine_spec(cfg, target_dir, "float32"), cpus=[0, 1])
    two = worker_slots(_cfg(target_dir, [convs_file], regenerate_workers=2),
                       engine_spec(cfg, target_dir, "float32"), cpus=[0, 1])
    assert [dict(s.env)["VLLM_CPU_OMP_THREADS_BIND"] for s in two] == ["0", "1"]
    raw = {"model": {"target": str(target_dir)}, "layout": {"target_gpus": [0, 1, 2], "drafter_gpus": [3, 4]},
           "data": {"train_files": [str(convs_file)], "regenerate_engine": "vllm", "regenerate_tensor_parallel": 2}}
    cfg = parse_config(raw)
    with pytest.raises(RegenerateError, match="does not divide the layout's 5 GPUs"):
        worker_slots(cfg, engine_spec(cfg, target_dir))
    raw["data"]["regenerate_tensor_parallel"] = 1
    cfg = parse_config(raw)
    slots = worker_slots(cfg, engine_spec(cfg, target_dir))
    assert [dict(s.env)["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0", "1", "2", "3", "4"]
    assert engine_spec(cfg, target_dir).dtype == "bfloat16"


def test_the_trainer_refuses_a_vllm_config_without_vllm_or_its_dataset(tmp_path, target_dir, convs_file):
    """Engine vllm in a venv without vLLM and no finished dataset: one error whose fix is the data stage."""
    pytest.importorskip("transformers")
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this Python: the trainer would run the stage itself")
    cfg = _cfg(target_dir, [convs_file], regenerate_engine="vllm")
    with pytest.raises(RegenerateError, match="run the data stage first: dflashctl launch EXP"):
        regenerated_files(cfg, target_dir, [str(convs_file)], tmp_path, SkipReport(), log=lambda _: None)


# -- against a real vLLM (its own venv) ------------------------------------------------------------------
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def vllm_dataset(tmp_path_factory, target_dir, convs_file):
    """The vllm engine's stage (fp32) run once, in the vLLM venv: (its dataset, its stdout)."""
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("regen-vllm")
    cfg = _write_cfg(tmp / "cfg.json", target_dir, [convs_file], regenerate_engine="vllm", regenerate_dtype="float32")
    proc = _stage(cfg, tmp / "datasets", python=python, env=VLLM_ENV)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-3000:]
    return Path(stdout.splitlines()[-1]), stdout


def _agreement(a: Path, b: Path, tokenizer) -> tuple[int, int]:
    """(tokens equal at the same position before the first difference, tokens in all) over every assistant turn."""
    same = total = 0
    for x, y in zip(read_conversations(dataset_files(a)), read_conversations(dataset_files(b)), strict=True):
        for m, n in zip(x.messages, y.messages, strict=True):
            if m["role"] != "assistant":
                assert m == n
                continue
            t, u = tokenizer(m["content"])["input_ids"], tokenizer(n["content"])["input_ids"]
            k = next((i for i, (p, q) in enumerate(zip(t, u)) if p != q), min(len(t), len(u)))
            same, total = same + k, total + max(len(t), len(u))
    return same, total


@pytest.mark.vllm
@pytest.mark.timeout(1800)  # an engine's first start compiles for minutes on a busy 2-core machine
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_vllm_and_hf_engines_regenerate_the_same_texts(vllm_dataset, reference, hf_engine, target_dir, convs_file):
    """fp32: the vllm engine's turns equal the hf engine's token for token (reported, bounded at 98 %); the
    trainer's venv without vLLM finds the vllm dataset by its key inputs (any vLLM version)."""
    path, stdout = vllm_dataset
    assert "regen done" in stdout and read_manifest(path)["engine_version"].startswith("vllm")
    same, total = _agreement(path, reference, hf_engine.tokenizer)
    print(f"vllm vs hf: {same}/{total} tokens agree")
    assert same >= 0.98 * total
    if __import__("importlib").util.find_spec("vllm") is None:
        cfg = _cfg(target_dir, [convs_file], regenerate_engine="vllm", regenerate_dtype="float32")
        files = regenerated_files(cfg, target_dir, [str(convs_file)], path.parent, SkipReport(), log=lambda _: None)
        assert files == dataset_files(path)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, target_dir):
    """A real OpenAI-compatible server: vLLM's api_server (fp32) on 127.0.0.1, for the module."""
    import socket

    python = vllm_python()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("vllm-server") / "server.log", "w+")  # read only on failure: never a full pipe
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target_dir),
                             "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--seed", "0"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **VLLM_ENV},
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        def up():
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"vLLM's server exited: {log.read()[-3000:]}")
            try:
                return urllib.request.urlopen(f"{url}/v1/models", timeout=2).status == 200
            except OSError:
                return False

        _wait(up, 1500, "vLLM's server")  # its first start compiled for > 10 min at a load of 40 on 2 cores
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.mark.vllm
@pytest.mark.timeout(1800)  # an engine's first start compiles for minutes on a busy 2-core machine
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_openai_engine_against_a_real_vllm_server(tmp_path, vllm_server, reference, hf_engine, target_dir, convs_file):
    """The openai engine regenerates the dataset through a real server (bounded requests in flight); its turns
    agree with the hf engine's (fp32; reported, bounded at 98 %)."""
    cfg = _cfg(target_dir, [convs_file], regenerate_engine="openai", regenerate_url=vllm_server,
               regenerate_max_in_flight=4)
    path = run_stage(cfg, target_dir, [convs_file], tmp_path, log=lambda _: None)
    m = read_manifest(path)
    assert m["complete"] and m["engine"] == "openai" and "model " in m["engine_version"]
    same, total = _agreement(path, reference, hf_engine.tokenizer)
    print(f"openai (vLLM server) vs hf: {same}/{total} tokens agree")
    assert same >= 0.98 * total


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare for a mount namespace")
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_stage_without_shared_memory_names_it_and_its_printed_mount_lets_the_stage_run(tmp_path, target_dir):
    """A container without a writable /dev/shm (no systemd mounted one): the stage's worker queues cannot be
    made; the one error line says why and ends with the mount that fixes it, which, pasted where the stage runs
    (here a private mount namespace whose /dev/shm is a read-only tmpfs), lets the same stage finish."""
    data = _write_convs(tmp_path / "c.jsonl", 4)
    cfg = _write_cfg(tmp_path / "cfg.json", target_dir, [data], regenerate_max_new_tokens=8)
    stage = shlex.join([sys.executable, "-m", "trainer", "regenerate", str(cfg), "--datasets", str(tmp_path / "d")])

    def in_namespace(script: str) -> subprocess.CompletedProcess:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               f"mount -t tmpfs -o ro,size=4k tmpfs /dev/shm && {script}"],
                              capture_output=True, text=True, timeout=600)

    failed = in_namespace(stage)
    assert failed.returncode == 2, failed.stderr[-2000:]
    [err] = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert "hf engine's workers cannot start: their queues need POSIX shared memory" in err, err
    assert "Read-only file system" in err
    fix = err.split("Fix, as root in the container: ", 1)[1]
    assert fix == "mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm"
    fixed = in_namespace(f"{fix} && {stage}")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
