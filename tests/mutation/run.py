"""Mutation testing (mutmut, pinned in pyproject's `mutation` extra) over the modules whose mistakes cost a user
the most; prints the score per module and fails (exit 1) when one falls below its floor.

    python3 tests/mutation/run.py [--ci | --full] [--only MODULE ...] [--list-survivors] [--again]

It lives beside the tests because it measures them: a mutant is a deliberate bug, and a score says how many
of those bugs the fast unit tests catch. (bench/ holds speed targets; nothing here is timed against a goal.)

How: each module below is one `mutmut run` in its own scratch copy (build/mutation/<module>: mutmut writes a
`mutants/` tree and reads its config from the pyproject.toml there, so the checkout stays untouched). Only the
functions listed for a module are mutated, and each mutant runs only the tests of the module's FAST selection
that execute the mutated function (mutmut records that per test), fastest first, stopping at the first
failure. Survivors that are equivalent (no test could tell them from the original) are listed with the reason
in tests/mutation/equivalent.yaml, keyed by function, line within it and the mutated text, so they survive
renumbering; they count neither for nor against the score. Every other survivor is printed.

score = killed / (mutants - equivalent). A timeout counts as killed (the mutant hangs where the code did not);
a mutant that no selected test runs counts as a survivor.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SCRATCH = REPO / "build" / "mutation"
EQUIVALENT = Path(__file__).with_name("equivalent.yaml")

# One mutmut run per module: the file it mutates, the functions in it (mutmut's names:
# package.module.x_function / package.module.xǁClassǁmethod), and the fast unit tests that exercise them
# (tests that run the code in another process, through the console script, ssh or a container, cannot see a
# mutant: they stay in the main suite). `full`: only with --full. The default run: names, quoting, the tailer's
# offsets, signatures, the loss, export, layout, the launch lock, the GPU claims, stopping, the run's processes,
# the token store and the regeneration's shards, then checkpoints, sampling, the monitor, the last good run and
# the verified-wheels keys (--full adds the follow's reconnect policy). Where a module lists functions,
# those are the ones whose mistakes reach the user (a wrong offset, a wrong loss, a wrong file); the comment
# says what is left out.
MODULES: dict[str, dict] = {
    "names": {
        "files": ["orchestrator/names.py"],
        "functions": ["orchestrator.names.*"],
        "tests": ["tests/orchestrator/test_names.py", "tests/orchestrator/test_names_property.py",
                  "-k", "not end_to_end and not as_the_user_sees_it"],
    },
    "quoting": {
        "files": ["orchestrator/quoting.py"],
        "functions": ["orchestrator.quoting.*"],
        # test_quoting_property.py sends hundreds of texts through bash, ssh and pct (a minute or more for each
        # mutant that survives its first tests): the main suite runs it, the golden tests here are exact.
        "tests": ["tests/orchestrator/test_quoting.py"],
    },
    "tailer (offsets)": {
        "files": ["orchestrator/agent/tailer.py"],
        "functions": ["orchestrator.agent.tailer.x_tail_offset__*", "orchestrator.agent.tailer.x__last_newline_end__*",
                      "orchestrator.agent.tailer.xǁLineCursorǁ*"],
        "tests": ["tests/orchestrator/agent/test_tailer_unit.py", "tests/orchestrator/agent/test_tail.py",
                  "-k", "not agent_process and not session_gone and not live_writer and not dir_watcher"],
    },
    "follow (client offsets)": {  # --full only: the follower's overlap trimming (~40 s here)
        "full": True,
        "files": ["orchestrator/ops/follow.py"],
        "functions": ["orchestrator.ops.follow.xǁ_Followerǁ_data__*"],
        # With the silent-connection follow, which checks the printed offsets it reports (what a new follow
        # resumes after) against the log's end.
        "tests": ["tests/orchestrator/ops/test_logs.py", "tests/orchestrator/ops/test_follow_policy.py", "-k",
                  "overlapping_chunk or feeds_the_real_matcher or silent_connection_is_cut_after_the_heartbeat"],
    },
    "signatures (matcher)": {  # grouping a traceback into one event: chained exceptions, rank prefixes, winner
        "files": ["orchestrator/sigmatch.py"],
        # Not _Traceback.__init__: it stores its arguments; of its 18 mutants 13 fail every grouping test and 5
        # are equivalent, each of those running the property tests in full (a minute of this module's time).
        "functions": ["orchestrator.sigmatch.xǁMatcherǁfeed_line__*", "orchestrator.sigmatch.xǁMatcherǁ_absorb__*",
                      "orchestrator.sigmatch.xǁMatcherǁ_close__*", "orchestrator.sigmatch.xǁMatcherǁ_close_then__*",
                      "orchestrator.sigmatch.xǁMatcherǁ_idle_line__*", "orchestrator.sigmatch.xǁMatcherǁfinish__*",
                      "orchestrator.sigmatch.xǁ_Tracebackǁadd__*", "orchestrator.sigmatch.x__same_tag__*",
                      "orchestrator.sigmatch.x__winner__*"],
        "tests": ["tests/orchestrator/test_signatures.py", "tests/orchestrator/test_signatures_property.py",
                  "-k", "not clean_100k_line_log"],
    },
    "signatures (line scanning)": {  # --full only: 260 mutants, about 5 min on a quiet machine
        "full": True,
        "files": ["orchestrator/sigmatch.py"],
        "functions": ["orchestrator.sigmatch.xǁMatcherǁ_traceback_line__*",
                      "orchestrator.sigmatch.xǁMatcherǁscan_chunk__*", "orchestrator.sigmatch.xǁMatcherǁ_segment__*",
                      "orchestrator.sigmatch.xǁMatcherǁ_line_event__*"],
        "tests": ["tests/orchestrator/test_signatures.py", "tests/orchestrator/test_signatures_property.py",
                  "tests/orchestrator/test_sigmatch_scan.py"],
    },
    "inventory split": {  # where a large inventory is cut in two for two processes, and the halves merged
        "files": ["orchestrator/yamlsplit.py"],
        "functions": ["orchestrator.yamlsplit.x_split_point__*", "orchestrator.yamlsplit.x__middle__*",
                      "orchestrator.yamlsplit.x_halves__*", "orchestrator.yamlsplit.x_merge__*"],
        "tests": ["tests/orchestrator/test_yamlsplit.py"],
    },
    "launch lock": {
        "files": ["orchestrator/agent/launchlock.py"],
        "functions": ["orchestrator.agent.launchlock.xǁLaunchLockǁ*"],
        "tests": ["tests/orchestrator/agent/test_claims_unit.py"],
    },
    "gpu claims": {  # who holds a GPU: a live launch, a live run (also after exit.json), an unknown one
        "files": ["orchestrator/agent/claims.py"],
        "functions": ["orchestrator.agent.claims.x__conflicts__*", "orchestrator.agent.claims.x_claim__*",
                      "orchestrator.agent.claims.x_claim_alive__*", "orchestrator.agent.claims.x_held__*",
                      "orchestrator.agent.claims.x_promote__*", "orchestrator.agent.claims.x_release__*",
                      "orchestrator.agent.claims.x__with_survivors__*", "orchestrator.agent.claims.x_refusal__*",
                      "orchestrator.agent.claims.x_describe__*"],
        "tests": ["tests/orchestrator/agent/test_claims_unit.py"],
    },
    "stopping": {  # stop's escalation: INT, TERM after the grace, KILL, StopFailed, the pane before the pid file
        "files": ["orchestrator/agent/stopping.py"],
        "functions": ["orchestrator.agent.stopping.*"],
        # Real runs in a private tmux server, stopped by the agent's stop verb in the test's process.
        "tests": ["tests/orchestrator/agent/test_agent_stop.py"],
    },
    "run processes": {  # process lifetime: which processes are a run's (the environment marker), groups, zombies
        "files": ["orchestrator/agent/runprocs.py"],
        "functions": ["orchestrator.agent.runprocs.*"],
        "tests": ["tests/orchestrator/agent/test_runprocs_mutants.py"],
    },
    "token store": {  # the store's key, its files' sizes and hashes on open and verify, the build's publish
        "files": ["trainer/store.py", "trainer/storebuild.py"],
        # What a rank opens and trusts: the key, the checks on open and verify, the chunks, the publish. The
        # build's own code is "token store (build)" (--full: 1109 mutants with it, ~40 min here). Not the
        # workers' tokenising (forked processes: mutmut cannot see which test ran it; a mistake changes every
        # sample the list-path comparison checks), the receive over gloo (tests/trainer/test_distributed.py,
        # other processes), the run pointer and the CLI.
        "functions": ["trainer.store.x_datasets_root__*", "trainer.store.x_file_sha256__*",
                      "trainer.store.x_tokenizer_identity__*", "trainer.store.x_store_key__*",
                      "trainer.store.x_store_dir__*", "trainer.store.xǁTokenStoreǁ*",
                      "trainer.store.x__read_manifest__*", "trainer.store.x__expected_len__*",
                      "trainer.store.x_open_store__*", "trainer.store.x_verify__*",
                      "trainer.storebuild.x__publish__*", "trainer.storebuild.x__clear_stale__*",
                      "trainer.storebuild.x_split_files__*"],
        "tests": ["tests/trainer/test_store_unit.py", "tests/trainer/test_store.py",
                  "-k", "not memory_does_not_grow and not tiny_run_trains"],
    },
    "token store (build)": {  # --full only: the build, its npy files and manifest (test_store_unit compares
        # them byte for byte and against the list path)
        "full": True,
        "files": ["trainer/storebuild.py"],
        "functions": ["trainer.storebuild.x__npy_header__*", "trainer.storebuild.xǁ_Hashedǁ*",
                      "trainer.storebuild.x__count_lines__*", "trainer.storebuild.x__concatenate__*",
                      "trainer.storebuild.x_build_store__*"],
        "tests": ["tests/trainer/test_store_unit.py", "tests/trainer/test_store.py",
                  "-k", "not memory_does_not_grow and not tiny_run_trains"],
    },
    "regen shards": {  # the regeneration's shards and resume bookkeeping: records, checks, the manifest
        "files": ["trainer/regen_shards.py"],
        "functions": ["trainer.regen_shards.*"],
        "tests": ["tests/trainer/test_regen_shards_unit.py"],
    },
    "objective (loss)": {
        "files": ["trainer/objective.py", "trainer/config.py"],
        # What the loss is for given inputs: the labels and γ-decayed weights, the weighted mean, γ's default and
        # the config's γ. Not block_inputs (the drafter's inputs, an exact golden test; --full), anchor sampling
        # (random by design; its own tests are exact) nor the accuracy metrics' helpers.
        "functions": ["trainer.objective.x_dflash_loss__*", "trainer.objective.x_block_labels__*",
                      "trainer.config.x_default_gamma__*",
                      "trainer.config.xǁTrainConfigǁresolved_gamma__*"],
        "tests": ["tests/trainer/test_objective.py"],
    },
    "objective (inputs)": {  # --full only
        "full": True,
        "files": ["trainer/objective.py"],
        "functions": ["trainer.objective.x_block_inputs__*"],
        "tests": ["tests/trainer/test_objective.py"],
    },
    "export": {
        "files": ["trainer/export.py"],
        # config.json field by field and the atomic write; not reference_code (reads package data: a mistake
        # fails every export test) nor the two fsync helpers (their loss shows only on a power cut).
        "functions": ["trainer.export.x_draft_config_dict__*", "trainer.export.x_export_drafter__*"],
        # The reload through AutoModel with the RoPE base 1e6 target only: the qwen3 and llama variants run the
        # same export code (the main suite runs them); each took seconds for every mutant that reached it.
        "tests": ["tests/trainer/test_export.py",
                  "-k", "not published_decode_loop and not bundle_zip and not self_contained and not flex_backend",
                  "--deselect", "tests/trainer/test_export.py::test_reload_drafts_the_same_tokens[qwen3]",
                  "--deselect", "tests/trainer/test_export.py::test_reload_drafts_the_same_tokens[llama]"],
    },
    "layout": {
        "files": ["trainer/layout.py"],
        "functions": ["trainer.layout.*"],
        "tests": ["tests/trainer/test_layout.py"],
    },
    # -- where a mistake costs a user a run, a venv or a diagnosis (the follow, the monitor, checkpoints, ...)
    "checkpoint": {  # what resume finds: complete, intact, the newest K kept, a killed swap put back
        "files": ["trainer/checkpoint.py"],
        # Not the RNG capture/restore (an exact round-trip test; a mistake fails it every time) nor the fsync
        # helpers (their loss shows only on a power cut).
        "functions": ["trainer.checkpoint.xǁCheckpointManagerǁ*"],
        "tests": ["tests/trainer/test_checkpoint.py", "tests/trainer/test_checkpoint_mutants.py",
                  "-k", "not metrics and not rewind"],
    },
    "sampling": {  # speculative sampling's acceptance, residual and the bonus token
        "files": ["trainer/sampling.py"],
        "functions": ["trainer.sampling.*"],
        # The chi-square decodes (30 s to a minute each) stay in the main suite; the direct counts are exact.
        "tests": ["tests/trainer/test_sampling.py", "-k", "not follow_the_target_distribution"],
    },
    "monitor": {  # the hang check and the throughput regression against the last good run
        "files": ["orchestrator/monitor.py"],
        "functions": ["orchestrator.monitor.xǁHangDetectorǁ*", "orchestrator.monitor.xǁThroughputRegressionǁ*",
                      "orchestrator.monitor.x_record_time__*", "orchestrator.monitor.x__number__*"],
        "tests": ["tests/orchestrator/test_monitor.py", "tests/orchestrator/test_monitor_mutants.py"],
    },
    "tailer (baseline)": {  # the one definition of the last good run
        "files": ["orchestrator/agent/tailer.py"],
        "functions": ["orchestrator.agent.tailer.x_last_good_baseline__*", "orchestrator.agent.tailer.x_throughput_summary__*"],
        "tests": ["tests/orchestrator/agent/test_baseline.py", "tests/orchestrator/agent/test_tail.py",
                  "-k", "baseline and not real_run"],
    },
    "verification skip": {  # the verified-wheels keys and record (venvinfo.verify's use of them: --full)
        "files": ["orchestrator/agent/importcheck.py"],
        "functions": ["orchestrator.agent.importcheck.x_python_key__*", "orchestrator.agent.importcheck.x__files_digest__*",
                      "orchestrator.agent.importcheck.x_requirements__*", "orchestrator.agent.importcheck.x_closures__*",
                      "orchestrator.agent.importcheck.x_dist_keys__*", "orchestrator.agent.importcheck.x_load_record__*",
                      "orchestrator.agent.importcheck.x_save_record__*"],
        # Not the two tests that verify a whole site twice (~50 s each: every survivor would run both); they
        # are "verification skip (verify)"'s, and the main suite runs them.
        "tests": ["tests/orchestrator/agent/test_importcheck_mutants.py", "tests/orchestrator/agent/test_importcheck.py",
                  "-k", "not not_recorded_and_is_imported_again and not another_patch_version"],
    },
    "verification skip (verify)": {  # --full only: each mutant runs two verifies of a site (~10 s)
        "full": True,
        # venvinfo holds verify and its command line alone since the split (issue 21): the bundle scan verify
        # waits for is orchestrator.agent.bundlescan, the fingerprint it writes venvfingerprint (not mutated here).
        "files": ["orchestrator/agent/venvinfo.py"],
        "functions": ["orchestrator.agent.venvinfo.x_verify__*", "orchestrator.agent.venvinfo.x__skipped_torch_info__*"],
        # test_venvinfo's verify_record tests: the progress events, the result, the bundle and skip, torch's facts
        # (a CUDA build's, from a torch module that imports in no time: not the one that imports the real torch,
        # 26 s under load, which killed nothing the others do not and was the last test of every torch mutant).
        "tests": ["tests/orchestrator/agent/test_importcheck.py", "tests/orchestrator/agent/test_venvinfo.py",
                  "-k", "(recorded or patch_version or verify_record) and not imports_torch_when_not_recorded"],
    },
    "follow (reconnect policy)": {  # --full only: when logs --follow reconnects, gives up, refuses; the tail
        # exec's error classification and silence watchdog (_tail_once). FollowOutcome.exit_code is a property,
        # which mutmut does not mutate: test_follow_policy checks it as an exact table.
        "full": True,
        "files": ["orchestrator/ops/follow.py"],
        "functions": ["orchestrator.ops.follow.x_follow__*", "orchestrator.ops.follow.x__transient__*",
                      "orchestrator.ops.follow.xǁBackoffǁdelay__*", "orchestrator.ops.follow.x__tail_once__*"],
        # The pure parts' tables, then follows of real runs (about a second each; the outages test 4 s, the
        # hang alert's 4 s): not the twenty cuts through the fake Proxmox host, the CLI's, nor the killer's 30k lines.
        "tests": ["tests/orchestrator/ops/test_follow_policy.py", "tests/orchestrator/ops/test_follow_reconnect.py",
                  "tests/orchestrator/ops/test_logs.py",
                  "-k", "policy or backoff or lost_for_good or outages or host_key or stopped_during or outcome_json"
                        " or no_such_run or one_shot_tail or next_byte or hang_alert or follows_the_severity"
                        " or later_run"],
    },
    # Not here: the loop's gradient accumulation (trainer.loop.train_step runs only inside trainer processes,
    # where mutmut cannot see which test ran it; its mutants are in tests/mutation/hand_mutants.py, with the
    # venv script's switch, prune and no-op paths), and the workers of the token store's build (forked).
}

# What CI mutates (after the main suite, which already takes 11-20 min of CI's 30): see CI_NOTE.
CI: list[str] = ["names", "quoting", "tailer (offsets)"]
CI_NOTE = "names, quoting and the tailer's offsets: about 2.5 min on a loaded 2-core machine"

# Floors (percent), raised as tests are added; the script fails below them. Each is the module's score in
# the last full run less one mutant's worth, so one nondeterministic kill (hypothesis draws new examples every
# run; a timeout under load) cannot fail CI, while a second survivor does; every survivor is printed anyway.
FLOORS = {
    # 2026-12-01 (third session), shared 2-core machine: every default module 100.0% (no survivor that is not
    # listed as equivalent); first runs were names 89.3, quoting 87.3, tailer 92.7, follow 97.0, signature
    # grouping 77.6, launch lock 91.3, GPU claims 92.9, loss 91.0, export 62.0, layout 79.9.
    # The follower's offsets (--full) on 2026-12-03: 47 mutants, 97.7% (the printed offset handed on as None
    # survived: its row's tests never read the offsets); with the silent-connection follow in its selection,
    # 43 killed, 4 equivalent, 100.0% (15 s).
    "names": 98, "quoting": 98, "tailer (offsets)": 99, "follow (client offsets)": 98,
    "signatures (matcher)": 99, "signatures (line scanning)": 99, "launch lock": 99, "gpu claims": 99,
    "objective (loss)": 99, "objective (inputs)": 98, "export": 99, "layout": 99,
    # Signatures (line scanning), 2026-12-02 (issue 23): 260 mutants, 78.5% at first (204 killed, 56 survived; 278 s);
    # test_sigmatch_scan killed 42 (each checked by hand on its mutant; --again 32 s) and 14 are listed equivalent
    # (scan_chunk feeding extra hitless lines, decode defaults, count ends, an unreachable guard): 246 killed, 100.0%.
    # 2026-12-02, first runs on a machine loaded far past its 2 cores (timeouts count as kills there): monitor
    # 73.6% (148 mutants, all run), the last good run 69.6% (79, all run); checkpoint 93.6% with 181 of 211 run (the 11 survivors then were killed
    # since by test_what_a_save_leaves_and_the_warnings_resume_prints, checked by hand); sampling 82.4% with 17
    # of 112 run. The others have no full run yet: 0 until one sets their floor.
    # Issue 23 (same day): the monitor 93.9% with test_monitor_mutants, 100.0% once 8 equivalents were listed
    # (148 mutants); the last good run 91.6%, then 100.0% with 7 equivalents (83 mutants).
    # Sampling again (issue 23): all 112 mutants ran (256 s), 85.7%; 100.0% with four new tests in
    # test_sampling.py and 4 equivalents (the device of two tensors on a CPU-only machine).
    # Checkpoint (issue 23, 2026-12-02): 211 mutants, 96.1% at first (195 killed, 8 survived, 8 listed equivalent;
    # 205 s); test_checkpoint_mutants killed the 8 (--again, 17 s) and 4 of the listed ones (rmtree of a link);
    # a whole run then: 207 killed, 4 equivalent (load_latest's torch.load defaults on a CPU), 100.0% (74 s).
    # 2026-12-03, with the save's cleanup of a failed write: 222 mutants, 3 survived (the cleanup's ignore_errors),
    # killed by test_checkpoint_mutants' failing-cleanup test: 218 killed, 4 equivalent, 100.0% (29 s).
    "checkpoint": 99, "sampling": 99, "monitor": 99, "tailer (baseline)": 98,
    # the verified-wheels keys 81.8% at first, 100.0% with test_importcheck_mutants (148: 135 killed, 13 equiv.)
    "verification skip": 99,
    # venvinfo.verify (issue 23, 2026-12-02): a first run stopped at 105 of its 160 mutants (about 20 s each
    # here), before test_venvinfo's three verify_record tests were in its selection: 41 survived, 5 of them
    # listed as equivalent. 2026-12-02 (issues 21/23), after venvinfo's split, with _skipped_torch_info (180
    # mutants): 117 ran with the selection that still imported the real torch (16:43-17:17, load 9-12 on the 2
    # cores, up to 160 s a torch mutant), 111 killed, 6 survived (5 listed equivalents, and the bundle-sorted-first
    # mutant, alive only where dflashctl has a key: test_venvinfo now imports a wheel sorting after the bundle);
    # the 63 not run and that one (64) ran with this selection (the CUDA-build test; 432 s): 61 killed, 3 equiv.
    # 172 killed, 8 equivalent, none survived: 100.0%. (mutmut keeps only the last run's results of the mutants
    # it is given by name, so run.py's table for that second run counts 64.) A whole run at once: not yet.
    # The follow's reconnect policy (issue 23, 2026-12-02; with _tail_once, 222 mutants): 81.1% at first (1867 s
    # on a machine loaded far past its 2 cores, 16 timeouts at ~100 s each), 100.0% once test_follow_policy's
    # tests were added (--again: 424 s) and 21 equivalents listed (201 killed).
    "verification skip (verify)": 99, "follow (reconnect policy)": 99,
    # 2026-12-02 (issue 23), after the tests that killed their survivors:
    # stopping 81.6% at first (266 mutants, 1413 s), the run's processes 90.7% (183), GPU claims 92.3% (325),
    # regen shards 97.5% (201); each 100.0% once the tests that killed their survivors were added and the
    # equivalents listed (6, 9, 8 and 5). The token store 95.1% at first (371 mutants, 1363 s), 100.0% with 9
    # equivalents; its build (--full) has no full run yet.
    "stopping": 99, "run processes": 99, "token store": 99, "token store (build)": 0, "regen shards": 99,
    # The inventory split (issue 20, 2026-12-03): 133 mutants, 78.9% at first (28 survived, 420 s); with
    # test_yamlsplit's tests for them and the sequence check that bought nothing gone, a second whole run: 127
    # mutants, 118 killed, the 9 survivors listed equivalent (where the middle starts the search), 100.0% (211 s).
    "inventory split": 99,
    # The signature line scanner's first whole run (2026-12-02, after the matcher moved to sigmatch.py; quiet
    # machine): 260 mutants, 204 killed, 56 survived (scan_chunk 21, _traceback_line 23, _line_event 7,
    # _segment 5), 78.5% in 278 s. With tests/orchestrator/test_sigmatch_scan.py and 14 equivalents listed, a
    # second whole run: 246 killed, 14 equivalent, none survived, 100.0% in 199 s (floor 99 above).
}

KILLED = {1, 3, 36, 24, -24, 152, 255}  # mutmut's exit codes: failed tests, pytest error, timeouts
SURVIVED = {0, 33}  # the tests passed; no selected test runs the mutated function (not defended either)


def _prepare(name: str, spec: dict, scratch: Path) -> Path:
    """A scratch copy of the packages, the tests and pyproject.toml, with mutmut's config for this module."""
    root = scratch / re.sub(r"[^a-z]+", "-", name).strip("-")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
    for sub in ("orchestrator", "trainer", "templates", "tests"):  # templates/inventory.yaml: the file, not the link
        shutil.copytree(REPO / sub, root / sub, ignore=ignore)
    _write_config(root, spec)
    return root


def _write_config(root: Path, spec: dict) -> None:
    """pyproject.toml in the scratch copy: the checkout's, with mutmut's config for this module (its test
    selection as run.py has it now: --again rewrites it, so a test file added to the selection takes part)."""
    cfg = {
        "source_paths": ["orchestrator", "trainer"],
        "also_copy": ["templates"],  # orchestrator.assets reads them beside the package
        "only_mutate": spec["files"],
        "pytest_add_cli_args_test_selection": spec["tests"],
        # Each mutant starts pytest anew: only hypothesis' plugin is loaded (run with autoload off), and not
        # unraisableexception, whose five gc.collect() at every session's end were most of a quick mutant's time.
        "pytest_add_cli_args": ["-p", "_hypothesis_pytestplugin", "-p", "no:cacheprovider",
                                "-p", "no:unraisableexception", "-q", "-W", "ignore"],
        # A mutant that loops forever is stopped at 4x its tests' time (+1 s) instead of mutmut's 15x.
        "timeout_multiplier": 4.0,
    }
    text = (REPO / "pyproject.toml").read_text()
    text += "\n[tool.mutmut]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in cfg.items())
    (root / "pyproject.toml").write_text(text)


# `python -m mutmut ARGS` without its "clean tests" run: mutmut runs the whole selection once more on the
# unmutated code in case its baseline (stats) was loaded from an earlier run; here every run starts from a fresh
# scratch copy, so the baseline has just run those tests, and mutmut stops (exit 1) if any failed there. mutmut
# forks each mutant from the process that ran the baseline (its default "fork" isolation), so everything the
# tests import is imported once, and it runs a mutant's tests fastest first, stopping at the first failure.
_MUTMUT = """
import runpy, sys
from mutmut.workers.isolation import ForkRunner
ForkRunner.run_clean_tests = lambda self, tests: 0
sys.argv = ["mutmut", *sys.argv[1:]]
runpy.run_module("mutmut", run_name="__main__", alter_sys=True)
"""


def _again(name: str, spec: dict, scratch: Path, equivalent: dict[str, str]) -> tuple[Path, list[str]]:
    """--again: the module's last scratch copy with the checkout's tests copied in, and its survivors that are
    not listed as equivalent (mutmut reruns the mutants it is given by name; new tests get their stats)."""
    root = scratch / re.sub(r"[^a-z]+", "-", name).strip("-")
    if not (root / "mutants").is_dir():
        raise SystemExit(f"--again {name}: no earlier run in {root}; run it first: "
                         f"python3 tests/mutation/run.py --only {shlex.quote(name)}")
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
    shutil.rmtree(root / "tests")
    shutil.copytree(REPO / "tests", root / "tests", ignore=ignore)
    _write_config(root, spec)
    codes = _results(root, spec)
    alive = sorted(k for k, v in codes.items() if v in SURVIVED)
    diffs = _diffs(root, alive)
    return root, [k for k in alive if key_of(k, diffs[k]) not in equivalent]


def _run_module(name: str, spec: dict, scratch: Path, log, again: list[str] | None = None) -> tuple[Path, float]:
    root = scratch / re.sub(r"[^a-z]+", "-", name).strip("-") if again is not None else _prepare(name, spec, scratch)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutmut puts mutants/ first itself
    # Plugins by name only (see pytest_add_cli_args in _prepare): finding the installed ones took ~0.3 s of
    # every mutant's pytest start.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    start = time.monotonic()
    if again == []:  # nothing survived: nothing to rerun
        return root, 0.0
    res = subprocess.run([sys.executable, "-c", _MUTMUT, "run", *(again if again is not None else spec["functions"])],
                         cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    if res.returncode != 0:
        raise SystemExit(f"mutmut run for {name} failed (exit {res.returncode}); see {log.name}")
    return root, wall


def _results(root: Path, spec: dict, ran: bool = True) -> dict[str, int | None]:
    """{mutant name: exit code} for the module's mutants that ran (ran=False: every mutant made, None for one
    that has not run: a run that was stopped part way)."""
    codes: dict[str, int | None] = {}
    for meta in (root / "mutants").rglob("*.py.meta"):
        codes.update({k: v for k, v in json.loads(meta.read_text())["exit_code_by_key"].items()
                      if v is not None or not ran})
    pats = [re.compile(re.escape(p).replace(r"\*", ".*") + "$") for p in spec["functions"]]
    return {k: v for k, v in codes.items() if any(p.match(k) for p in pats)}


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
    ap.add_argument("--only", nargs="*", metavar="MODULE",
                    help=f"modules to run (default: all but --full ones): {', '.join(repr(m) for m in MODULES)}; a first word is enough")
    ap.add_argument("--ci", action="store_true", help=f"only the modules CI mutates ({CI_NOTE})")
    ap.add_argument("--full", action="store_true", help="also the modules marked full (the signature line scanner)")
    ap.add_argument("--list-survivors", action="store_true", help="print every survivor's diff too")
    ap.add_argument("--again", action="store_true",
                    help="rerun only the last run's survivors (not listed as equivalent) of each module, in its "
                         "scratch copy, against the checkout's tests as they are now: after adding tests that "
                         "should kill them (the module's source must be unchanged since that run)")
    ap.add_argument("--scratch", type=Path, default=SCRATCH, help=f"where the scratch copies go (default: {SCRATCH})")
    args = ap.parse_args(argv)
    wanted = CI if args.ci else [m for m in MODULES if args.full or args.only or not MODULES[m].get("full")]
    if args.only:
        unknown = [o for o in args.only if not any(o in (m, m.split()[0]) for m in MODULES)]
        if unknown:
            ap.error(f"unknown module(s) {', '.join(map(repr, unknown))}; choose from {', '.join(map(repr, MODULES))}")
        # a first word names every module it starts, but a --full one only with --full or by its whole name
        wanted = [m for m in (CI if args.ci else MODULES) if m in args.only
                  or (m.split()[0] in args.only and (args.full or not MODULES[m].get("full")))]
    equivalent = load_equivalent()
    args.scratch = args.scratch.resolve()
    args.scratch.mkdir(parents=True, exist_ok=True)
    rows, survivors, started = [], [], time.monotonic()
    for name in wanted:
        spec = MODULES[name]
        log_path = args.scratch / (re.sub(r"[^a-z]+", "-", name).strip("-") + ".log")
        with open(log_path, "w") as log:
            again = _again(name, spec, args.scratch, equivalent)[1] if args.again else None
            root, wall = _run_module(name, spec, args.scratch, log, again)
        codes = _results(root, spec)
        alive = sorted(k for k, v in codes.items() if v in SURVIVED)
        diffs = _diffs(root, alive)
        keys = {k: key_of(k, diffs[k]) for k in alive}
        equiv = [k for k in alive if keys[k] in equivalent]
        killed = sum(1 for v in codes.values() if v in KILLED)
        other = len(codes) - killed - len(alive)
        counted = len(codes) - len(equiv)
        score = 100.0 * killed / counted if counted else 100.0
        rows.append((name, len(codes), killed, len(alive) - len(equiv), len(equiv), other, score, wall))
        survivors += [(name, k, keys[k], diffs[k]) for k in alive if keys[k] not in equivalent]
        made = len(_results(root, spec, ran=False))
        print(f"{name}: {len(codes)} mutants, {killed} killed, score {score:.1f}% ({wall:.0f} s; log {log_path})",
              flush=True)
        if made > len(codes):  # e.g. mutmut stopped part way: the score is over the mutants that ran
            print(f"  WARNING: only {len(codes)} of the {made} mutants made for {name} have a result", flush=True)
    print(f"\n{'module':24} {'mutants':>7} {'killed':>7} {'survived':>8} {'equiv.':>6} {'other':>5} {'score':>6} "
          f"{'floor':>5} {'time':>6}")
    failed = []
    for name, n, killed, alive, equiv, other, score, wall in rows:
        floor = FLOORS.get(name, 0)
        flag = "" if score >= floor else "  BELOW FLOOR"
        print(f"{name:24} {n:7d} {killed:7d} {alive:8d} {equiv:6d} {other:5d} {score:5.1f}% {floor:4d}% {wall:5.0f}s{flag}")
        if score < floor:
            failed.append(name)
    print(f"mutation testing wall time: {time.monotonic() - started:.0f} s")
    if survivors:
        print(f"\n{len(survivors)} survivor(s) not listed in {EQUIVALENT.relative_to(REPO)}:")
        for name, mutant, key, diff in survivors:
            print(f"- [{name}] {mutant}\n  key: {key!r}")
            if args.list_survivors:
                print("  " + diff.strip().replace("\n", "\n  "))
    if failed:
        print(f"\nFAILED: below the floor: {', '.join(failed)} (kill the survivors above with a test, or list a "
              f"truly equivalent one in {EQUIVALENT.relative_to(REPO)} with the reason)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
