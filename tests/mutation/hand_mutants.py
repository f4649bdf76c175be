"""Hand-made mutants: bugs that mutmut cannot make (a deleted file, a packaging change, a reordered
output, a shell script's switch and prune) or that a reader should see named, each applied to a scratch copy of
the tree with the tests that must fail on it; prints one row per mutant (killed or SURVIVED, the tests' exit code,
the seconds it took) and exits 1 if any survives.

    python3 tests/mutation/hand_mutants.py [--only ID ...] [--list]

Killed means each listed test fails or errors on the mutant (for a parametrized test: at least one of its
cases; pytest exit 1, or 2 when a test module no longer imports); a skip is not a kill.
Some tests here are slow (a venv build, a fake Proxmox container, the installed console script): this is a
check to run by hand when a test or a mutated line changes, not part of CI (the main suite runs those tests
on the unmutated code; tests/mutation/run.py is CI's mutation score).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRATCH = REPO / "build" / "issue-mutants"


@dataclass
class Mutant:
    id: str
    what: str
    tests: list[str]
    edits: list[tuple[str, str, str]] = field(default_factory=list)  # (file, original text, mutated text)
    delete: list[str] = field(default_factory=list)


_VERBS = ("doctor", "trust", "diagnose", "rebuild_venv", "lock", "launch", "status", "stop", "attach", "logs",
          "metrics", "warmup", "runs")
_SILENT_CLI = (
    "orchestrator/cli.py",
    "from orchestrator.commands import (\n" + "".join(f"    {n},\n" for n in sorted((*_VERBS, "early"))) + ")\n",
    f"from orchestrator.commands import early\nimport importlib as _il\n_verbs = []\nfor _n in {_VERBS!r}:\n    try:\n"
    "        _verbs.append(_il.import_module('orchestrator.commands.' + _n))\n"
    "    except ImportError:\n        pass\n",
)
_SILENT_LOOP = ("orchestrator/cli.py", f"for _module in ({', '.join(_VERBS)}):", "for _module in _verbs:")

MUTANTS = [
    Mutant("gamma-loss", "the loss uses γ = 2 whatever it is given",
           ["tests/trainer/test_objective.py::test_loss_is_the_weighted_mean_of_slot_cross_entropies"],
           [("trainer/objective.py", "labels, weights = block_labels(batch, anchors, keep, bs, gamma)",
             "labels, weights = block_labels(batch, anchors, keep, bs, 2.0)")]),
    Mutant("gamma-labels", "block_labels decays with a constant γ",
           ["tests/trainer/test_objective.py::test_labels_and_weights_by_hand"],
           [("trainer/objective.py", "decay = torch.exp(-(k.float() - 1).clamp_min(0) / gamma)",
             "decay = torch.exp(-(k.float() - 1).clamp_min(0) / 7.0)")]),
    Mutant("gamma-config", "the training loop ignores the config's γ (the block size's default instead)",
           ["tests/trainer/test_config.py::test_the_configs_gamma_reaches_the_loss_the_loop_logs"],
           [("trainer/config.py", "return self.gamma if self.gamma is not None else default_gamma(self.model.block_size)",
             "return default_gamma(self.model.block_size)")]),
    Mutant("gamma-default", "default_gamma is one constant",
           ["tests/trainer/test_objective.py::test_default_gamma_is_the_papers_table_else_block_over_2_3"],
           [("trainer/config.py", "def default_gamma(block_size: int) -> float:\n",
             "def default_gamma(block_size: int) -> float:\n    return 7.0\n")]),
    Mutant("rope-theta", "the export writes rope_theta 10000 whatever the target's base",
           ["tests/trainer/test_export.py::test_reload_drafts_the_same_tokens"],
           [("trainer/export.py", '"rope_theta": c.rope_theta,', '"rope_theta": 10000.0,'),
            ("trainer/export.py", '"rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},',
             '"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},')]),
    Mutant("diagnose-no-not-this", "diagnose prints no 'will not help' items",
           ["tests/orchestrator/ops/test_diagnose.py::test_the_user_reads_the_diagnosis_the_fix_and_every_false_lead_in_order"],
           [("orchestrator/commands/diagnose.py", 'out.print(f"  - {item}")', "pass")]),
    Mutant("diagnose-fix-under-not-this", "diagnose prints the fix under the 'will not help' heading",
           ["tests/orchestrator/ops/test_diagnose.py::test_the_user_reads_the_diagnosis_the_fix_and_every_false_lead_in_order"],
           [("orchestrator/commands/diagnose.py",
             'out.print(text(("fix:", "bold"), f" {worst.fix}"))\n    if worst.not_this:\n'
             '        out.print(text(("will not help:", "bold")))',
             'if worst.not_this:\n        out.print(text(("will not help:", "bold")))\n'
             '        out.print(text(("fix:", "bold"), f" {worst.fix}"))')]),
    Mutant("follow-no-not-this", "logs --follow prints no 'will not help' items",
           ["tests/orchestrator/ops/test_logs_follow_cli.py::test_crash_diagnosis_is_printed_identically_by_both_follows"],
           [("orchestrator/commands/following.py", 'for wrong in m.get("not_this") or ():', "for wrong in ():")]),
    Mutant("follow-fix-as-not-this", "logs --follow prints the fix as a 'will not help' item",
           ["tests/orchestrator/ops/test_logs_follow_cli.py::test_crash_diagnosis_is_printed_identically_by_both_follows"],
           [("orchestrator/commands/following.py", 'for label in ("diagnosis", "fix"):', 'for label in ("diagnosis",):'),
            ("orchestrator/commands/following.py", 'for wrong in m.get("not_this") or ():',
             'for wrong in [m.get("fix"), *(m.get("not_this") or ())]:')]),
    Mutant("reconnect-offset-0", "a reconnect asks the agent for offset 0 (the client's trim hides the re-read)",
           ["tests/orchestrator/ops/test_logs.py::test_a_reconnect_asks_for_the_next_byte_and_no_byte_is_sent_twice"],
           [("orchestrator/ops/follow.py", 'else {"offset": st.log_offset}', 'else {"offset": 0}')]),
    Mutant("no-overlap-trim", "the client no longer trims bytes it has shown already",
           ["tests/orchestrator/ops/test_logs.py::test_an_overlapping_chunk_is_trimmed_a_resent_one_skipped_a_gap_refused"],
           [("orchestrator/ops/follow.py", "raw = raw[expected - start:]", "raw = raw")]),
    Mutant("lock-released-early", "launch releases its lock right after taking it",
           ["tests/orchestrator/ops/test_launch.py::test_two_concurrent_launches_make_exactly_one_run",
            "tests/orchestrator/ops/test_launch_claims.py::test_disjoint_gpus_launch_side_by_side_and_the_same_experiment_waits_for_its_lock"],
           [("orchestrator/agent/verbs/launch.py", 'emit.progress("lock", f"holding {lock.path}")',
             'lock.release()\n    emit.progress("lock", f"holding {lock.path}")')]),
    Mutant("check-run-ref-dotdot", "check_run_ref reduced to the `..` check",
           ["tests/orchestrator/test_names.py::test_every_verb_that_takes_a_run_refuses_a_bad_one_as_the_user_sees_it"],
           [("orchestrator/inventory_models.py", "        return names.check_run_id(value, kind)\n",
             "        if '..' in value:\n            raise names.BadName(f'bad {kind} {value!r}', fix='')\n"
             "        return value\n")]),
    Mutant("dollar-validator", "the name rule matches with `$` (accepts 'abc\\n')",
           ["tests/orchestrator/test_names.py::test_names_refuse",
            "tests/orchestrator/test_names_property.py::test_nothing_with_a_newline_a_slash_or_dotdot_passes_anywhere",
            "tests/orchestrator/test_names_property.py::test_fullmatch_a_valid_name_with_anything_after_it_is_refused"],
           [("orchestrator/names.py", "_CHARS.fullmatch(value) is not None",
             're.match(_CHARS.pattern + "$", value) is not None')]),
    Mutant("venv-verbs-deleted", "commands/rebuild_venv.py and lock.py deleted and cli.py skipping a missing verb module",
           ["tests/orchestrator/test_cli.py::test_every_verb_the_readme_lists_answers_help",
            "tests/orchestrator/ops/test_lock.py::test_the_lock_verb_through_the_installed_cli"],
           [_SILENT_CLI, _SILENT_LOOP], ["orchestrator/commands/rebuild_venv.py", "orchestrator/commands/lock.py"]),
    Mutant("warmup-verb-deleted", "commands/warmup.py deleted and cli.py skipping a missing verb module",
           ["tests/orchestrator/test_cli.py::test_every_verb_the_readme_lists_answers_help",
            "tests/orchestrator/ops/test_ops_warmup.py::test_the_warmup_verb_through_the_installed_cli"],
           [_SILENT_CLI, _SILENT_LOOP], ["orchestrator/commands/warmup.py"]),
    Mutant("verb-module-deleted", "commands/warmup.py deleted (cli.py as it is)",
           ["tests/orchestrator/test_cli.py::test_every_verb_the_readme_lists_answers_help"],
           delete=["orchestrator/commands/warmup.py"]),
    Mutant("default-not-packaged", "the embedded default inventory left out of the package data",
           ["tests/orchestrator/test_inventory.py::test_a_wheel_install_carries_the_embedded_default_and_launches_tiny_from_it"],
           [("pyproject.toml", '"orchestrator.templates" = ["*.yaml", "*.sh", "locks/*"]',
             '"orchestrator.templates" = ["*.sh", "locks/*"]')]),
    Mutant("trainer-warmup-deleted", "trainer/warmup.py deleted (the test used to turn into a skip)",
           ["tests/orchestrator/ops/test_launch.py::test_warm_up_runs_the_trainer_warmup_per_drafter_gpu_and_streams_events"],
           delete=["trainer/warmup.py"]),
    Mutant("rank-gpu-swapped", "trainer.launch gives each rank the next rank's GPU",
           ["tests/orchestrator/ops/test_launch.py::"
            "test_container_dflash_gpu_layout_warms_each_drafter_gpu_and_trainer_launch_gives_each_rank_its_gpu"],
           [("trainer/layout.py", "        gpu = self.gpu(rank)\n        if gpu is None:\n            return {\"CUDA_VISIBLE_DEVICES\": \"\"}",
             "        gpu = self.gpu((rank + 1) % self.world_size)\n        if gpu is None:\n"
             "            return {\"CUDA_VISIBLE_DEVICES\": \"\"}")]),
    # -- checkpoints: what resume finds after a crash, a half copy or a bad file
    Mutant("ckpt-complete-without-meta", "list_complete no longer requires meta.json (keep-N pruning counts a half copy)",
           ["tests/trainer/test_checkpoint.py::test_keep_1_pruning_never_counts_a_folder_without_meta_json"],
           [("trainer/checkpoint.py", 'if m and p.is_dir() and (p / "meta.json").exists():', "if m and p.is_dir():")]),
    Mutant("ckpt-load-oserror-only", "only an OSError from torch.load means unusable (a bad pickle crashes the resume)",
           ["tests/trainer/test_checkpoint.py::test_a_hash_valid_state_that_does_not_unpickle_is_skipped"],
           [("trainer/checkpoint.py", "except Exception as exc:  # noqa: BLE001", "except OSError as exc:  # noqa: BLE001")]),
    Mutant("ckpt-resave-delete-then-rename", "a same-step re-save deletes the old folder, then renames the new one in",
           ["tests/trainer/test_checkpoint.py::test_a_same_step_resave_killed_in_the_middle_keeps_the_step"],
           [("trainer/checkpoint.py", "            os.rename(final, old)\n            os.rename(tmp, final)\n"
             "            shutil.rmtree(old, ignore_errors=True)\n",
             "            shutil.rmtree(final)\n            os.rename(tmp, final)\n")]),
    Mutant("ckpt-no-recover", "nothing puts back a step a killed same-step swap left under .old- (the code before the fix)",
           ["tests/trainer/test_checkpoint.py::test_a_same_step_resave_killed_in_the_middle_keeps_the_step"],
           [("trainer/checkpoint.py", "        if not self.root.exists():\n            return\n        for p in sorted(",
             "        if True:\n            return\n        for p in sorted(")]),
    # -- sampling: the bonus token after every draft kept
    Mutant("bonus-argmax", "with every draft kept at T > 0 the bonus token is the target's argmax, not a sample",
           ["tests/trainer/test_sampling.py::test_the_bonus_token_is_sampled_from_the_targets_next_distribution",
            "tests/trainer/test_sampling.py::test_the_bonus_token_after_every_draft_kept_follows_the_target_distribution"],
           [("trainer/sampling.py", "    return n, int(draw(p[n], generator))", "    return n, int(p[n].argmax())")]),
    # -- monitor: the hang check and the last good run
    Mutant("hang-ignores-metrics", "metrics progress no longer re-arms the hang check (log bytes only)",
           ["tests/orchestrator/test_monitor.py::test_metrics_progress_alone_rearms_the_hang_check"],
           [("orchestrator/monitor.py", "progress = (log_bytes, metrics_seen)", "progress = (log_bytes, 0)")]),
    Mutant("baseline-newer-run", "a run newer than the followed one may be its baseline",
           ["tests/orchestrator/agent/test_baseline.py::test_a_newer_run_is_never_the_baseline"],
           [("orchestrator/agent/tailer.py", "        if created_key(other) >= created_key(ref):\n            continue\n", "")]),
    Mutant("baseline-stopped-exit-0", "any exit 0 is a good run (a run stopped by the user whose trainer exits 0 too)",
           ["tests/orchestrator/agent/test_baseline.py::test_a_run_stopped_by_the_user_is_never_the_baseline_whatever_its_exit_code",
            "tests/orchestrator/agent/test_baseline.py::test_a_real_run_stopped_with_exit_0_is_not_the_baseline_of_the_next"],
           [("orchestrator/agent/tailer.py", 'state_of(exit_info, False, stopped_by(other, exit_info)) != "succeeded"',
             'exit_info.get("exit_code") != 0')]),
    # -- verification skip: the verified-wheels record
    Mutant("skip-key-no-patch-version", "the Python patch version dropped from the key (3.11.4's verification skips on 3.11.9)",
           ["tests/orchestrator/agent/test_importcheck.py::test_a_wheel_verified_under_another_patch_version_of_python_is_imported_again"],
           [("orchestrator/agent/importcheck.py", "{sys.implementation.name}-{platform.python_version()}-{sys.platform}",
             "{sys.implementation.name}-{'.'.join(platform.python_version().split('.')[:2])}-{sys.platform}")]),
    Mutant("skip-records-failed", "a wheel whose import FAILED is recorded as verified (and skipped next time)",
           ["tests/orchestrator/agent/test_importcheck.py::test_a_wheel_whose_import_failed_is_not_recorded_and_is_imported_again"],
           [("orchestrator/agent/venvinfo.py", "if record is not None and not failed and not missing:",
             "if record is not None and not missing:")]),
    # -- gradient accumulation: several batches per drafter per step
    Mutant("ddp-reduce-first-batch", "DDP all-reduces on the FIRST micro-batch of a step (the others stay local)",
           ["tests/trainer/test_accumulation.py::test_two_drafters_with_two_batches_each_match_one_process_accumulating_four"],
           [("trainer/loop.py", "last = j == len(items) - 1", "last = j == 0")]),
    Mutant("accumulation-summed", "the step's batches' gradients summed, not averaged",
           ["tests/trainer/test_accumulation.py::test_two_drafters_with_two_batches_each_match_one_process_accumulating_four"],
           [("trainer/loop.py", "scale = 1.0 / len(items)", "scale = 1.0")]),
    # -- follow: the reconnect policy of logs --follow
    Mutant("follow-give-up-counts-every-outage", "progress resets the backoff but not the outage clock (the give-up counts every outage since the first)",
           ["tests/orchestrator/ops/test_follow_reconnect.py::test_outages_separated_by_progress_each_get_the_whole_give_up_time"],
           [("orchestrator/ops/follow.py", "            attempt, down_since = 0, None\n", "            attempt = 0\n")]),
    Mutant("follow-host-key-transient", "a changed host key is retried as a dropped connection",
           ["tests/orchestrator/ops/test_follow_reconnect.py::test_a_host_key_that_changed_during_a_follow_is_refused_at_once"],
           [("orchestrator/ops/follow.py", "        return False  # a changed or unknown host key never fixes itself",
             "        return True")]),
    Mutant("follow-stopped-is-failed", "a stopped run's follow exits 1 like a failed one, not 5",
           ["tests/orchestrator/ops/test_follow_reconnect.py::test_a_run_stopped_during_the_follow_ends_it_with_exit_code_5"],
           [("orchestrator/ops/followoutcome.py", '        if self.state == "stopped":\n            return EXIT_STOPPED\n', "")]),
    # -- the venv script: switch, prune, no-op
    Mutant("venv-prune-takes-previous", "pruning no longer protects `previous` (keep 1 deletes the venv a rollback needs)",
           ["tests/orchestrator/test_rebuild_venv_switch.py::test_keep_1_keeps_the_previous_venv_and_a_rollback_finds_it"],
           [("templates/rebuild_venv.sh", 'if [ "$d" = "$name" ] || [ "$d" = "$prev" ]; then', 'if [ "$d" = "$name" ]; then')]),
    Mutant("venv-relink-not-atomic", "`current` relinked by rm, a pause, ln (a reader finds it missing meanwhile)",
           ["tests/orchestrator/test_rebuild_venv_switch.py::test_a_reader_of_current_never_finds_it_missing_during_a_switch"],
           [("templates/rebuild_venv.sh",
             'relink() { ln -sfn -- "$2" "$venvs/.$1.tmp.$$" && mv -fT -- "$venvs/.$1.tmp.$$" "$venvs/$1"; }',
             'relink() { rm -f -- "$venvs/$1" && sleep 0.3 && ln -sfn -- "$2" "$venvs/$1"; }')]),
    Mutant("venv-noop-ignores-python", "the no-op check ignores the stamp's Python (another `python:` on the same lock: nothing to do)",
           ["tests/orchestrator/test_rebuild_venv_switch.py::test_the_same_lock_under_another_python_request_is_not_a_no_op"],
           [("templates/rebuild_venv.sh", '[ "$s_bundle" = "$bundle_hash" ] && [ "$s_py" = "$py_req" ]',
             '[ "$s_bundle" = "$bundle_hash" ]')]),
]


def _copy(dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
    for name in ("orchestrator", "trainer", "templates", "tests", "bench", "docs"):
        if (REPO / name).exists():
            shutil.copytree(REPO / name, dest / name, ignore=ignore, symlinks=True)
    for name in ("pyproject.toml", "README.md", "inventory.yaml"):
        shutil.copy(REPO / name, dest / name)


def apply(m: Mutant, root: Path) -> None:
    for rel, old, new in m.edits:
        path = root / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"{m.id}: {rel} has {text.count(old)} copies of {old!r}, not 1: update the mutant")
        path.write_text(text.replace(old, new))
    for rel in m.delete:
        (root / rel).unlink()


# Imported at start-up by every interpreter of a mutant's run (the scratch copy is on PYTHONPATH): the scratch copy
# must be the only source of our packages. setuptools' editable finder (from `pip install -e` of the real checkout)
# comes after PYTHONPATH but answers for a submodule PYTHONPATH lacks, so a module the mutant deleted was served
# from the checkout and the mutant survived (trainer-warmup-deleted, seen).
_ONLY_THE_SCRATCH_COPY = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
"""


def run(m: Mutant) -> tuple[bool, int, float, dict[str, str]]:
    """Apply `m` to a scratch copy and run its tests there: (killed, pytest's exit code, seconds, the outcome
    of each test from pytest's summary)."""
    root = SCRATCH / m.id
    _copy(root)
    apply(m, root)
    (root / "sitecustomize.py").write_text(_ONLY_THE_SCRATCH_COPY)
    env = {**os.environ, "PYTHONPATH": str(root)}
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *m.tests],
                         cwd=root, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    outcomes = {}
    for line in res.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
            outcomes[rest.split(" - ")[0]] = word
    failing = {t for t, o in outcomes.items() if o in ("FAILED", "ERROR")}
    killed = res.returncode in (1, 2) and all(any(t == n or t.startswith(n + "[") for t in failing) for n in m.tests)
    if res.returncode == 2 and not outcomes:  # a test module that no longer imports: pytest's own report
        outcomes = {"(collection)": "ERROR " + " ".join(res.stdout.strip().splitlines()[-1:])}
    return killed, res.returncode, wall, outcomes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", metavar="ID", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only]
    if args.only and len(chosen) != len(args.only):
        ap.error(f"unknown id(s); choose from {', '.join(m.id for m in MUTANTS)}")
    survived = []
    for m in chosen:
        if args.list:
            print(f"{m.id}: {m.what}\n  " + "\n  ".join(m.tests))
            continue
        killed, code, wall, outcomes = run(m)
        print(f"{m.id:28} {'killed' if killed else 'SURVIVED'} (pytest exit {code}, {wall:.0f} s): {m.what}", flush=True)
        for test, outcome in outcomes.items():
            if outcome != "PASSED":
                print(f"    {outcome:8} {test}", flush=True)
        if not killed:
            survived.append(m.id)
    if survived:
        print(f"survived: {', '.join(survived)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
