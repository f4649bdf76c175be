"""The catalogue and the matcher: every signature on a realistic fixture, traceback grouping, a clean
100,000-line log with no match, streaming == block scanning, and catalogue validation errors."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from orchestrator.errors import InventoryError
from orchestrator.sigmatch import Matcher, match_exit
from orchestrator.signatures import (
    SEVERITY_RANK,
    UNCLASSIFIED,
    load_catalogue,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "signatures"


@pytest.fixture(scope="module")
def catalogue():
    return load_catalogue()


def run_lines(catalogue, text: str):
    m = Matcher(catalogue)
    events = []
    # split("\n"), not splitlines(): splitlines also splits on "\r" and would renumber progress bars.
    lines = text.split("\n")
    for line in lines[:-1] if lines[-1] == "" else lines:
        events.extend(m.feed_line(line))
    return events + m.finish()


def run_blocks(catalogue, data: bytes, size: int):
    m = Matcher(catalogue)
    events, start = [], 0
    while start < len(data):
        cut = data.rfind(b"\n", start, start + size) + 1
        cut = len(data) if cut <= start else cut
        events.extend(m.scan_chunk(data[start:cut]))
        start = cut
    return events + m.finish(), m.line_no


def top(events):
    classified = [e for e in events if e.signature != UNCLASSIFIED]
    return max(classified, key=lambda e: (SEVERITY_RANK[e.severity], _prio(e))) if classified else None


def _prio(event):
    return load_catalogue().get(event.signature).priority


def test_every_signature_has_a_fixture(catalogue):
    ids = {s.id for s in catalogue}
    assert ids == {p.stem for p in FIXTURES.glob("*.log")}
    assert len(ids) >= 16


@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("*.log")), ids=lambda p: p.stem)
def test_fixture_matches_its_signature(catalogue, fixture):
    events = run_lines(catalogue, fixture.read_text())
    assert top(events) is not None, f"{fixture.name}: nothing matched"
    assert top(events).signature == fixture.stem
    # The block scanner (diagnose's fast path) finds exactly the same events, at any block size.
    for size in (64, 1000, 1 << 20):
        blocks, _ = run_blocks(catalogue, fixture.read_bytes(), size)
        assert [e.to_dict() for e in blocks] == [e.to_dict() for e in events]


@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("*.log")), ids=lambda p: p.stem)
def test_prefilter_covers_every_pattern_hit(catalogue, fixture):
    # A line a pattern matches must also hit the prefilter, or block scanning would skip it.
    for line in fixture.read_text().splitlines():
        for sig, _ in catalogue.match_text(line):
            assert catalogue.prefilter.search(line), f"{sig.id}: prefilter misses {line!r}"


def test_fx_race_is_one_event_with_compile_wrapper_as_last_frame(catalogue):
    events = run_lines(catalogue, (FIXTURES / "fx-tracing-race.log").read_text())
    assert len(events) == 1
    ev = events[0]
    assert ev.kind == "traceback" and ev.line_no == 5 and ev.end_line_no == 37
    assert ev.last_frame.function == "compile_wrapper"
    assert ev.last_frame.file.endswith("torch/_dynamo/eval_frame.py") and ev.last_frame.line == 817
    assert ev.exception.startswith("RuntimeError: Detected that you are using FX")
    sig = catalogue.get(ev.signature)
    assert "module_call_wrapper" in sig.diagnosis and "transformers" in sig.diagnosis
    assert any("transformers" in n for n in sig.not_this)
    assert any("venv" in n for n in sig.not_this)
    assert any("one GPU" in n for n in sig.not_this)


def test_missing_module_names_the_module(catalogue):
    ev = top(run_lines(catalogue, (FIXTURES / "missing-module.log").read_text()))
    assert ev.groups == {"module": "accelerate"}
    text = catalogue.get(ev.signature).render(ev.groups)
    assert "accelerate" in text["title"] and "accelerate" in text["fix"] and "rebuild-venv" in text["fix"]


def test_driver_too_old_names_the_drivers_cuda_and_the_false_lead(catalogue):
    # torch only warns (is_available() returns False); the rank then blames the GPU indices.
    events = run_lines(catalogue, (FIXTURES / "driver-too-old.log").read_text())
    ev = top(events)
    assert ev.signature == "driver-too-old" and ev.groups == {"found": "12040"} and ev.line_no == 3
    text = catalogue.get(ev.signature).render(ev.groups)
    assert "12040" in text["title"] and "cu126" in text["fix"] and "--no-kernel-modules" in text["fix"]
    assert any("CUDA_VISIBLE_DEVICES" in n for n in text["not_this"])


@pytest.mark.parametrize("line", [
    "Failed to initialize NVML: Driver/library version mismatch",
    "[rank 3] RuntimeError: Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions before "
    "calling NumCudaDevices() that might have already set an error? Error 803: system has unsupported display "
    "driver / cuda driver combination",
])
def test_library_mismatch_as_nvml_and_as_cuda_say_it(catalogue, line):
    ev = top(run_lines(catalogue, line + "\n"))
    assert ev is not None and ev.signature == "driver-library-mismatch"
    assert "kernel module" in catalogue.get(ev.signature).diagnosis


def test_chained_traceback_is_one_event_with_all_exceptions(catalogue):
    events = run_lines(catalogue, (FIXTURES / "disk-full.log").read_text())
    assert len(events) == 1
    ev = events[0]
    assert len(ev.exceptions) == 3
    assert ev.exception.startswith("OSError: [Errno 28]")
    assert ev.last_frame.file.endswith("trainer/checkpoint.py") and ev.last_frame.line == 101


def test_rank_prefixed_traceback_tolerates_interleaved_ranks(catalogue):
    text = (
        "[rank5]: Traceback (most recent call last):\n"
        '[rank5]:   File "/x/loop.py", line 10, in step\n'
        "[rank6]: [train] step 3 | loss 2.1\n"
        "[rank5]:     loss.backward()\n"
        "[rank5]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.\n"
        "[train] step 4 | loss 2.0\n"
    )
    events = run_lines(catalogue, text)
    assert [(e.signature, e.kind, e.line_no, e.end_line_no) for e in events] == [("cuda-oom", "traceback", 1, 5)]
    assert events[0].last_frame.function == "step"


def test_progress_bar_glued_to_traceback_with_carriage_returns(catalogue):
    text = (
        "epoch 0:  10%|#         | 1/10 [00:01<00:09]\repoch 0:  20%|##        | 2/10 [00:02<00:08]"
        "Traceback (most recent call last):\n"
        '  File "/x/train.py", line 5, in <module>\n'
        "    main()\n"
        "ModuleNotFoundError: No module named 'flash_attn'\n"
    )
    events = run_lines(catalogue, text)
    assert [(e.signature, e.line_no, e.groups) for e in events] == [("missing-module", 1, {"module": "flash_attn"})]


def test_unknown_traceback_is_one_unclassified_event(catalogue):
    text = 'Traceback (most recent call last):\n  File "/x.py", line 1, in f\n    g()\nKeyError: \'x\'\n\nnext\n'
    events = run_lines(catalogue, text)
    assert [(e.signature, e.severity, e.exception) for e in events] == [(UNCLASSIFIED, "error", "KeyError: 'x'")]


def clean_log_lines(n: int, seed: int = 0) -> list[str]:
    """A realistic healthy training log: trainer step lines, metrics-style lines, and warnings that are
    not errors (deprecations, dataloader, tokenizer, NCCL info, one-off recompile info)."""
    rnd = random.Random(seed)
    noise = [
        "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py:617: UserWarning: This DataLoader will create 8 worker processes in total. Our suggested max number of worker in current system is 4.\n",
        "/venv/lib/python3.11/site-packages/transformers/utils/generic.py:441: FutureWarning: `torch.utils._pytree._register_pytree_node` is deprecated.\n",
        "W0611 10:00:01.000000 100 torch/_inductor/utils.py:1250] [0/0] Not enough SMs to use max_autotune_gemm mode\n",
        "ct200:4120:4120 [0] NCCL INFO Bootstrap : Using eth0:10.10.0.12<0>\n",
        "ct200:4120:4120 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so), using internal implementation\n",
        "huggingface/tokenizers: The current process just got forked, after parallelism has already been used. Disabling parallelism to avoid deadlocks...\n",
        "2025-06-11 10:00:02,001 INFO trainer.checkpoint: saved checkpoint step-1000 (1.21 GiB) in 3.2 s; pruned step-500\n",
        "2025-06-11 10:00:02,002 INFO trainer.eval: held-out tau 3.412 (accept lengths mean 3.41, p50 3, p90 6)\n",
        "warmup gpu 5: compile 41.2 s (cache miss), gpu 6: 3.1 s (cache hit), gpu 7: 3.0 s (cache hit)\n",
        "memory: rss 9120 MiB, cuda peak 61234 MiB (limit 81559 MiB), no inf/nan in gradients this epoch\n",
    ]
    out = []
    for step in range(n):
        k = rnd.random()
        if k < 0.85:
            out.append(
                f"step {step}/{n} ep {step // 5000} loss {rnd.uniform(0.8, 4.0):.4f} acc {rnd.random():.3f} "
                f"sim_tau {rnd.uniform(1, 6):.2f} {rnd.uniform(18000, 21000):.0f} tok/s lr {3e-4:.2e} rss {rnd.uniform(9000, 9100):.0f}MB\n"
            )
        elif k < 0.93:
            out.append(
                f'{{"kind":"train","step":{step},"loss":{rnd.uniform(0.8, 4):.4f},"acc":{rnd.random():.3f},'
                f'"tokens_per_s":{rnd.uniform(18000, 21000):.1f},"rss_mb":{rnd.uniform(9000, 9100):.1f},"time":{1.7e9 + step:.3f}}}\n'
            )
        else:
            out.append(rnd.choice(noise))
    return out


def test_clean_100k_line_log_has_no_match(catalogue):
    lines = clean_log_lines(100_000)
    assert len(lines) == 100_000
    m = Matcher(catalogue)
    events = [e for line in lines for e in m.feed_line(line)] + m.finish()
    assert events == []
    blocks, line_no = run_blocks(catalogue, "".join(lines).encode(), 1 << 20)
    assert blocks == [] and line_no == 100_000
    # The same log with one crash appended is caught at the right line (the test can fail).
    crash = (FIXTURES / "cuda-oom.log").read_text()
    blocks, _ = run_blocks(catalogue, ("".join(lines) + crash).encode(), 1 << 20)
    assert [(e.signature, e.line_no) for e in blocks] == [("cuda-oom", 100_003)]


def test_training_recompile_line_of_the_trainer_is_a_warning_with_step_and_count(catalogue):
    events = run_lines(catalogue, (FIXTURES / "training-recompile.log").read_text())
    assert [(e.signature, e.line_no, e.groups) for e in events] == [("training-recompile", 10, {"graphs": "2", "step": "231"})]
    sig = catalogue.get("training-recompile")
    assert sig.severity == "warning" and "guard failure" in sig.fix and "fixed" in sig.fix
    assert events[0].title.startswith("torch.compile recompiled during training: 2 new graph(s) at step 231")
    assert any("recompile_limit" in n for n in sig.not_this)
    # The exact line trainer/loop.py logs (colocated: no rank prefix) is recognised too.
    line = ("[compile] recompile during training: 1 new graph(s) at step 7 (recompiles 1); "
            "shapes must stay fixed, see the guard failure above")
    assert [e.signature for e in run_lines(catalogue, line + "\n")] == ["training-recompile"]
    # A healthy step line that reports `recompiles 0` is not one.
    assert run_lines(catalogue, "step 300/12000 loss 3.5 acc 0.2 sim_tau 2.7 19000 tok/s recompiles 0\n") == []


def test_trainer_nan_metric_lines_match(catalogue):
    for line in ["step 12/100 ep 0 loss nan acc 0.000 sim_tau 1.00 20000 tok/s lr 3.00e-04 rss 9000MB",
                 '{"kind":"train","step":12,"loss":"nan","acc":0.0}', "[train] step 12 | loss inf | acc 0.0",
                 "Loss is NaN, stopping training"]:
        assert [e.signature for e in run_lines(catalogue, line + "\n")] == ["nan-loss"], line
    for line in ["loss 0.8812 finance nan-free", "Loss scaler: skipping step, overflow"]:
        assert run_lines(catalogue, line + "\n") == [], line


@pytest.mark.parametrize("value", ["nan", "NaN", "NAN", "inf", "Inf", "INF", "-inf", "+Inf"])
def test_nan_loss_prefilter_covers_every_spelling(catalogue, value):
    # The prefilter anchors on the value ("nan", "nf", ...), not on "loss": each spelling must still hit,
    # in both the streaming (str) and the block (bytes) prefilter.
    for line in [f"step 1 loss {value} acc 0.1", f'{{"loss": "{value}"}}', f"loss={value}", f"Loss: {value}"]:
        assert catalogue.prefilter.search(line), line
        assert catalogue.prefilter_bytes.search(line.encode()), line
        assert [e.signature for e in run_lines(catalogue, line + "\n")] == ["nan-loss"], line


def _first_chars(pattern: str) -> set[str]:
    """The characters the top-level alternation's branches start with (each branch starts with a literal)."""
    parsed = re._parser.parse(pattern)
    (op, (_, branches)), = parsed.data
    assert str(op) == "BRANCH"
    out = set()
    for branch in branches:
        first = branch.data[0]
        while str(first[0]) == "SUBPATTERN":
            first = first[1][3].data[0]
        assert str(first[0]) == "LITERAL", branch
        out.add(chr(first[1]))
    return out


def test_prefilter_cannot_start_on_a_healthy_step_line(catalogue):
    # Speed: sre tries the whole alternation at every position whose character can start a branch, so a
    # prefilter starting with a character of every step line ("l" of loss/lr) made diagnose 2x slower
    # (bench/diagnose_vs_grep.py).
    step = "step 4100/200000 ep 0 loss 1.2345 acc 0.512 sim_tau 3.21 19876 tok/s lr 3.00e-04 rss 9050MB"
    assert _first_chars(catalogue.prefilter.pattern) & set(step) == set()


def test_match_exit(catalogue):
    assert match_exit(catalogue, 137, None).signature == "host-oom-kill"
    assert match_exit(catalogue, None, "SIGSEGV").signature == "segfault"
    assert match_exit(catalogue, 1, None) is None


def test_inventory_entries_extend_and_override(catalogue):
    extra = [
        {"id": "cuda-oom", "severity": "error"},
        {"id": "my-assert", "patterns": [r"MyCheck failed: (?P<what>\w+)"], "severity": "fatal",
         "title": "custom check {what}", "diagnosis": "d", "fix": "f"},
    ]
    cat = load_catalogue(extra)
    assert cat.get("cuda-oom").severity == "error" and cat.get("cuda-oom").patterns == catalogue.get("cuda-oom").patterns
    events = run_lines(cat, "x\nMyCheck failed: shapes\n")
    assert [(e.signature, e.title) for e in events] == [("my-assert", "custom check shapes")]
    # No prefilter given: the literal "MyCheck failed: " was derived, so block scanning finds it too.
    blocks, _ = run_blocks(cat, b"x\nMyCheck failed: shapes\n", 1 << 20)
    assert [e.signature for e in blocks] == ["my-assert"]


@pytest.mark.parametrize("entry, words", [
    ({"id": "x", "patterns": ["("], "severity": "fatal", "title": "t", "diagnosis": "d", "fix": "f"}, "patterns[0]"),
    ({"id": "x", "patterns": ["a"], "severity": "deadly", "title": "t", "diagnosis": "d", "fix": "f"}, "severity 'deadly'"),
    ({"id": "x", "patterns": ["a"], "severity": "fatal", "title": "t", "diagnosis": "d"}, "missing fix"),
    ({"id": "x", "patterns": ["a"], "severity": "fatal", "title": "t", "diagnosis": "d", "fix": "f", "sevrity": 1}, "unknown key(s) sevrity"),
    ({"id": "Bad Id", "patterns": ["a"], "severity": "fatal", "title": "t", "diagnosis": "d", "fix": "f"}, "bad id"),
    ({"id": "x", "patterns": ["(?i)a"], "severity": "fatal", "title": "t", "diagnosis": "d", "fix": "f"}, "(?i:"),
])
def test_bad_entries_are_clear_errors(entry, words):
    with pytest.raises(InventoryError) as info:
        load_catalogue([entry])
    text = str(info.value)
    assert "inventory signatures[0]" in text and words in text, text


def test_shipped_patterns_are_grep_compatible(catalogue):
    # bench/diagnose_vs_grep.py converts them to ERE; no lookarounds or lazy quantifiers may sneak in.
    for sig in catalogue:
        for pat in sig.patterns:
            assert not re.search(r"\(\?[=!<]|[*+?}]\?", pat.replace("(?P<", "(")), (sig.id, pat)


# -------------------------------------------------- the edges of one traceback event (fast; the mutation run's)

FRAME = ['  File "/w/train.py", line 3, in step', "    loss.backward()"]


def test_a_traceback_event_holds_its_lines_and_their_numbers(catalogue):
    text = "\n".join(["step 1", "Traceback (most recent call last):", *FRAME, "ValueError: boom",
                      "2026-01-01 10:00:00 INFO step 2"])  # a new log record ends the message
    [m] = run_lines(catalogue, text)
    assert (m.line_no, m.end_line_no, m.exception) == (2, 5, "ValueError: boom")
    assert m.lines == ["Traceback (most recent call last):", *FRAME, "ValueError: boom"]
    # A header and then the end of the log: a one-line event, ending where it starts.
    [m] = run_lines(catalogue, "x\nTraceback (most recent call last):")
    assert (m.line_no, m.end_line_no, m.lines) == (2, 2, ["Traceback (most recent call last):"])


def test_a_traceback_event_keeps_its_first_400_lines(catalogue):
    frames = FRAME * 300
    [m] = run_lines(catalogue, "\n".join(["Traceback (most recent call last):", *frames, "ValueError: deep"]))
    assert len(m.lines) == 400 and m.lines[:3] == ["Traceback (most recent call last):", *FRAME]
    assert m.end_line_no == 602 and m.exception == "ValueError: deep"  # counted to the end, kept to 400


def test_a_tagged_traceback_survives_200_interleaved_lines_of_another_rank_not_201(catalogue):
    def log(foreign: int) -> str:
        other = [f"[rank0]: step {i} loss 0.5" for i in range(foreign)]
        return "\n".join(["[rank1]: Traceback (most recent call last):", *other,
                          *(f"[rank1]: {line}" for line in FRAME), "[rank1]: ValueError: boom"])

    [m] = run_lines(catalogue, log(200))
    assert m.exception == "ValueError: boom" and m.last_frame.function == "step"
    cut = run_lines(catalogue, log(201))  # the 201st foreign line ends the tagged traceback
    assert cut[0].exception is None and cut[0].lines == ["[rank1]: Traceback (most recent call last):"]


def _entry(sig_id: str, pattern: str, severity: str, priority: int) -> dict:
    return {"id": sig_id, "patterns": [pattern], "severity": severity, "priority": priority,
            "title": f"{sig_id}: {{what}}", "diagnosis": "d", "fix": "f"}


def test_the_winner_of_a_traceback_is_the_most_severe_then_the_first_in_catalogue_order():
    cat = load_catalogue([_entry("zz-first", r"alpha-(?P<what>\w+)", "error", 3),
                          _entry("zz-second", r"beta-(?P<what>\w+)", "error", 3),
                          _entry("zz-worse", r"gamma-(?P<what>\w+)", "fatal", 3)])
    tb = ["Traceback (most recent call last):", *FRAME]
    [m] = run_lines(cat, "\n".join([*tb, "RuntimeError: alpha-one beta-two"]))
    # a tie (same severity and priority): the first in catalogue order wins, the other is `also`
    assert (m.signature, m.also, m.title, m.groups) == ("zz-first", ["zz-second"], "zz-first: one", {"what": "one"})
    assert m.text == "RuntimeError: alpha-one beta-two" and m.kind == "traceback"
    [m] = run_lines(cat, "\n".join([*tb, "RuntimeError: beta-two gamma-three alpha-one"]))
    assert (m.signature, m.severity, sorted(m.also)) == ("zz-worse", "fatal", ["zz-first", "zz-second"])
    [m] = run_lines(cat, "\n".join(tb))  # no exception line: the header is the event's text
    assert (m.signature, m.text, m.exception, m.also) == ("unclassified-traceback", tb[0], None, [])


def test_lines_fed_with_their_newline_and_progress_bars_before_a_header(catalogue):
    m = Matcher(catalogue)
    events = []
    for line in ["step 1\n", " 10%|#    | 1/10\r 20%|##   | 2/10\rTraceback (most recent call last):\n",
                 f"{FRAME[0]}\n", f"{FRAME[1]}\n", "ValueError: boom\n"]:
        events += m.feed_line(line)
    [ev] = events + m.finish()
    # the header starts the event at its own segment: no progress text, no newline kept, line 2
    assert ev.lines == ["Traceback (most recent call last):", *FRAME, "ValueError: boom"]
    assert (ev.line_no, ev.end_line_no, ev.exception) == (2, 5, "ValueError: boom")


OOM_LINE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB."


def test_only_this_runs_own_lines_are_skipped_not_any_line_of_their_shape(catalogue):
    """With the run's mark known, only lines with that mark are dflashctl's own; a line of the same shape with
    another mark (a job that runs dflashctl itself) is the job's output and is matched like any other."""
    def events(line):
        m = Matcher(catalogue, mark="0123456789abcdef")
        return m.feed_line(line) + m.finish()

    assert events(f"[dflashctl 0123456789abcdef] {OOM_LINE}") == []
    [other] = events(f"[dflashctl fedcba9876543210] {OOM_LINE}")
    assert (other.signature, other.kind, other.line_no) == ("cuda-oom", "line", 1)


def test_a_line_holding_two_ranks_tracebacks_follows_the_first_ranks_tag(catalogue):
    """Two ranks' headers glued on one line (a rank wrote without its newline): the traceback is the first
    one's, tagged `[rank0]: `, and its next tagged lines complete it."""
    lines = ["[rank0]: Traceback (most recent call last):[rank1]: Traceback (most recent call last):",
             '[rank0]:   File "/x/loop.py", line 10, in step', "[rank0]:     loss.backward()  ",
             "[rank0]: ValueError: no layer X"]
    [event] = run_lines(catalogue, "\n".join(lines))
    assert (event.signature, event.line_no, event.end_line_no) == (UNCLASSIFIED, 1, 4)
    # every line is kept as written, trailing blanks and a final X too (only the newline is cut)
    assert event.lines == lines and event.exception == "ValueError: no layer X"
    assert event.last_frame.function == "step"


# ---------------------------------------------------------------- the inventory's own patterns


SLOW = {"id": "slow-one", "patterns": [r"(a|aa)+$"], "severity": "error", "title": "slow",
        "diagnosis": "d", "fix": "f"}


def test_a_backtracking_inventory_pattern_is_bounded_named_once_and_skipped():
    """A user pattern with catastrophic backtracking costs at most the bound per line, then its signature is
    skipped (one warning naming it); the shipped signatures go on matching."""
    warnings: list[str] = []
    catalogue = load_catalogue([SLOW])
    catalogue.on_warning = warnings.append
    m = Matcher(catalogue)
    assert m.feed_line("a" * 60 + "!") == [] and m.feed_line("a" * 60 + "!") == []
    hits = m.feed_line("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert [h.signature for h in hits] == ["cuda-oom"]
    assert catalogue.timed_out == {"slow-one": r"(a|aa)+$"}
    assert len(warnings) == 1 and "'slow-one'" in warnings[0] and "(a|aa)+$" in warnings[0]
    # Still a working signature on a line it matches quickly.
    assert [h.signature for h in Matcher(load_catalogue([SLOW])).feed_line("aaaa")] == ["slow-one"]


def test_diagnose_with_a_backtracking_inventory_pattern_ends_with_one_warning(tmp_path, dflashctl):
    """`dflashctl diagnose` through the installed script: the backtracking pattern (which `re` would run for
    ever on this line) is named in one warning and the log's CUDA OOM is still the diagnosis."""
    import yaml

    log = tmp_path / "train.log"
    log.write_text("step 1\n" + "a" * 60 + "!\n" + "a" * 60 + "!\n"
                   "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"targets": {"local": {"kind": "local"}}, "signatures": [SLOW]}))
    res = dflashctl("--inventory", str(inv), "diagnose", str(log), timeout=120)
    assert res.returncode == 2, res.stderr
    assert "cuda-oom" in res.stdout + res.stderr
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "'slow-one'" in warnings[0] and "fix:" in warnings[0]


def test_an_inventory_pattern_never_enters_the_unbounded_prefilter():
    """The prefilter runs on `re` without a bound: an inventory pattern gives it only its literal run."""
    catalogue = load_catalogue([SLOW, {**SLOW, "id": "lit-one", "patterns": [r"ERROR (a|aa)+$"]}])
    assert "(a|aa)" not in catalogue.prefilter.pattern and "ERROR\\ " in catalogue.prefilter.pattern
