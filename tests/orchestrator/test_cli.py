"""The CLI shell: `--help` stays light, doctor's exit codes and output, readable inventory errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "paramiko", "fabric", "invoke")

INVENTORY = """\
targets:
  local:
    kind: local
    workdir: {workdir}
    venv: workstation
venvs:
  workstation: {{kind: workstation}}
experiments:
  tiny:
    kind: dflash
    target: local
"""


@pytest.fixture
def cli(dflashctl_main):
    """`dflashctl ARGS` in this process (orchestrator.cli.main; conftest's dflashctl_main): these tests are
    about what the verbs print and return. A fresh interpreter is what the import tests below need, and the
    installed console script is run by the usage-error tests at the end."""
    return dflashctl_main


def write_inventory(tmp_path: Path) -> Path:
    p = tmp_path / "inv.yaml"
    p.write_text(INVENTORY.format(workdir=tmp_path / "work"))
    return p


def imported_by(*args: str, inventory: Path | None = None) -> list[str]:
    """The top-level packages a fresh interpreter has imported after `dflashctl ARGS` (`-i inventory` first),
    among those this project's commands import only when they use them; what `import typer` itself brings is
    typer's, not ours (typer releases before 0.20 import rich with themselves, later ones do not)."""
    watched = (*HEAVY, "pydantic", "yaml", "rich", "platformdirs", "plotext", "trainer")
    code = textwrap.dedent(
        """
        import json, sys
        import typer
        typers = {m.split(".")[0] for m in sys.modules}
        from orchestrator.cli import main
        try:
            main(sys.argv[1:])
        except SystemExit:
            pass
        print("MODULES=" + json.dumps(sorted(({m.split(".")[0] for m in sys.modules} - typers) & set(%r))))
        """ % (watched,)
    )
    argv = [*(["-i", str(inventory)] if inventory else []), *args]
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("MODULES="))
    return json.loads(line[len("MODULES="):])


def test_help_imports_nothing_heavy():
    assert imported_by("--help") == []


@pytest.mark.parametrize("verb", ["launch", "status", "logs", "metrics", "doctor", "lock", "runs"])
def test_a_verbs_help_imports_nothing_it_does_not_use(verb):
    """A verb's --help loads no inventory, transport, trainer or renderer. (typer >= 0.20 checks its own
    option values with pydantic TypeAdapters, so pydantic may come with typer.)"""
    assert [m for m in imported_by(verb, "--help") if m != "pydantic"] == []


def test_status_of_a_local_target_imports_no_ssh_tmux_or_torch(tmp_path):
    """The workstation side of a local status validates the inventory (pydantic, yaml, the trainer's config)
    and prints (rich); the SSH stack, torch and plotext it never uses."""
    got = imported_by("status", "--target", "local", inventory=write_inventory(tmp_path))
    assert set(got) <= {"pydantic", "yaml", "trainer", "rich", "platformdirs"}, got


def test_doctor_json_on_a_local_target(tmp_path, cli):
    res = cli("--inventory", str(write_inventory(tmp_path)), "doctor", "--json")
    assert res.returncode == 0, res.stderr + res.stdout
    report = json.loads(res.stdout)
    assert report["target"] == "local" and report["ok"] is True
    names = [c["name"] for c in report["checks"]]
    assert names == ["python3", "nvidia-smi readable", "driver libraries = kernel module",
                     "driver runs the venv's torch", "tmux", "uv", "free disk", "workdir writable",
                     "inductor cache dir writable"]
    assert (tmp_path / "work" / "inductor-cache").is_dir()


def test_doctor_table_and_exit_1_when_a_check_fails(tmp_path, cli):
    # PATH without tmux or uv: the agent still runs (absolute interpreter) and reports them missing.
    env = dict(os.environ, PATH=str(tmp_path / "empty-bin"), HOME=str(tmp_path / "home"))
    res = cli("--inventory", str(write_inventory(tmp_path)), "doctor", env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "tmux" in res.stdout and "fail" in res.stdout
    assert "apt-get install -y tmux" in res.stdout
    assert "some checks failed" in res.stdout


def test_unknown_target_is_suggested(tmp_path, cli):
    res = cli("--inventory", str(write_inventory(tmp_path)), "doctor", "--target", "locl")
    assert res.returncode == 1
    assert "no target 'locl'" in res.stderr and "did you mean 'local'?" in res.stderr
    assert "Traceback" not in res.stderr


def test_hostile_target_name_is_refused(tmp_path, cli):
    res = cli("--inventory", str(write_inventory(tmp_path)), "doctor", "--target", "../$(id)")
    assert res.returncode == 1
    assert "bad target name" in res.stderr


def test_bad_inventory_names_file_and_line(tmp_path, cli):
    bad = tmp_path / "bad.yaml"
    bad.write_text(INVENTORY.format(workdir=tmp_path).replace("    venv: workstation", "    venv: workstation\n    wrkdir: x"))
    res = cli("--inventory", str(bad), "doctor")
    assert res.returncode == 1
    assert f"{bad}:6: targets.local.wrkdir: unknown key; did you mean 'workdir'?" in res.stderr


def test_missing_inventory_file(tmp_path, cli):
    res = cli("--inventory", str(tmp_path / "nope.yaml"), "doctor")
    assert res.returncode == 1 and "nope.yaml" in res.stderr and "does not exist" in res.stderr


def test_env_inventory_is_used(tmp_path, cli):
    env = dict(os.environ, DFLASHCTL_INVENTORY=str(write_inventory(tmp_path)))
    res = cli("doctor", "--json", env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["checks"][-1]["detail"] == str(tmp_path / "work" / "inductor-cache")


def test_trust_records_the_key_and_refuses_a_changed_one(pve, tmp_path, cli):
    import yaml

    known = tmp_path / "known_hosts"
    known.write_text("")
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"pve1": dict(pve.host_entry(), known_hosts=str(known))}}))

    res = cli("-i", str(inv), "trust", "pve1")
    assert res.returncode == 0, res.stderr
    assert "trusted pve1" in res.stdout and "SHA256:" in res.stdout
    line = known.read_text().strip()
    assert line.startswith(f"[127.0.0.1]:{pve.port} ssh-ed25519 ")
    assert cli("-i", str(inv), "trust", "pve1").returncode == 0  # idempotent
    assert known.read_text().strip() == line

    # Another key on record for this host: refused, never replaced.
    other = "AAAAC3NzaC1lZDI1NTE5AAAAIBcdBSeHUjyQoKsR3O3ayNXjQ3W0xVMm6eH8m2Dz2LrQ"
    known.write_text(f"[127.0.0.1]:{pve.port} ssh-ed25519 {other}\n")
    res = cli("-i", str(inv), "trust", "pve1")
    assert res.returncode == 1
    assert other in known.read_text()
    assert "error:" in res.stderr and "Traceback" not in res.stderr


def test_trust_unknown_host_is_suggested(tmp_path, cli):
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  pve1: {ssh: example.invalid}\n")
    res = cli("-i", str(inv), "trust", "pve2")
    assert res.returncode == 1 and "did you mean 'pve1'?" in res.stderr


def test_event_printer_writes_progress_to_stderr_only(capsys):
    from orchestrator.agent.events import Heartbeat, Progress
    from orchestrator.render import EventPrinter

    printer = EventPrinter()
    printer(Progress(step="warmup", message="GPU 5 compiled in 12.0 s"))
    printer(Progress(step="stop", message="[bold]not markup[/]"))
    printer(Heartbeat(session_alive=True, log_size=1))
    EventPrinter(quiet=True)(Progress(step="hidden", message="no"))
    out, err = capsys.readouterr()
    assert out == ""
    assert "warmup GPU 5 compiled in 12.0 s" in err
    assert "stop [bold]not markup[/]" in err  # messages are data, never rich markup
    assert 'heartbeat {"session_alive": true, "log_size": 1}' in err
    assert "hidden" not in err


# ------------------------------------------------------------------ the installed console script: usage errors

def _one_error_line(res: subprocess.CompletedProcess) -> str:
    """The usage error's single stderr line (exit 2, nothing on stdout, no traceback)."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_a_misspelt_verb_gets_clicks_suggestion(dflashctl):
    line = _one_error_line(dflashctl("lauch", "tiny"))
    assert "No such command 'lauch'" in line and "Did you mean 'launch'?" in line


def test_an_unknown_option_and_a_bad_value_are_one_line(dflashctl):
    line = _one_error_line(dflashctl("launch", "tiny", "--bogus"))
    # click's wording varies by release ("No such option: --bogus", "No such option '--bogus'.")
    assert line.startswith("error: No such option") and "--bogus" in line
    assert line.endswith("(see: dflashctl launch --help)")
    line = _one_error_line(dflashctl("logs", "--tail", "abc"))
    assert line.startswith("error: Invalid value for '--tail'") and line.endswith("(see: dflashctl logs --help)")


def test_bare_dflashctl_prints_the_help_without_a_traceback(dflashctl):
    res = dflashctl()
    assert res.returncode in (0, 2), res.stderr  # click 8.2+ says 2 (NoArgsIsHelpError), older clicks 0
    assert "Traceback" not in res.stderr
    assert "Usage" in res.stdout + res.stderr and "launch" in res.stdout + res.stderr


VERBS = [["doctor"], ["trust", "h"], ["diagnose", "f"], ["rebuild-venv"], ["lock"], ["launch", "tiny"], ["status"],
         ["stop", "r"], ["attach", "r"], ["logs"], ["metrics"], ["warmup"], ["runs"], ["runs", "diff", "a", "b"]]


@pytest.mark.parametrize("verb", VERBS, ids=lambda v: " ".join(v[:2]))
def test_every_verb_answers_a_usage_error_with_one_line_and_exit_2(dflashctl_main, verb):
    # In this process (orchestrator.cli.main, what the console script calls): the script itself answers the
    # usage errors of the three tests above.
    line = _one_error_line(dflashctl_main(*verb, "--no-such-flag"))
    path = " ".join(w for w in verb if w in ("runs", "diff") or w == verb[0])
    assert line.startswith("error: No such option") and "--no-such-flag" in line
    assert line.endswith(f"(see: dflashctl {path} --help)")


def _readme_verbs() -> list[list[str]]:
    """The verbs of README's `## Commands` block: `dflashctl VERB ...`, `| VERB ...`, `runs diff`."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Commands", 1)[1].split("```", 2)[1]
    verbs: list[list[str]] = []
    for line in block.splitlines():
        for part in line.split("|"):
            words = part.split()
            if words and words[0] == "dflashctl":
                words = words[1:]
            if words and words[0].islower() and words[0].replace("-", "").isalpha():
                verb = words[:2] if words[:2] == ["runs", "diff"] else words[:1]
                if verb not in verbs:
                    verbs.append(verb)
    return verbs


def test_every_verb_the_readme_lists_answers_help(dflashctl_main):
    verbs = _readme_verbs()
    assert len(verbs) >= 14 and ["runs", "diff"] in verbs and ["attach"] in verbs, verbs
    for verb in verbs:  # in this process: a fresh interpreter per verb shows nothing more about its --help
        res = dflashctl_main(*verb, "--help")
        assert res.returncode == 0, (verb, res.stderr)
        assert "Usage" in res.stdout and f"dflashctl {' '.join(verb)}" in res.stdout, (verb, res.stdout)


def test_a_missing_verb_module_breaks_the_cli_loudly():
    # Every verb is imported explicitly: a lost module is an ImportError, never a verb silently left out.
    code = "import sys; sys.modules['orchestrator.commands.warmup'] = None; import orchestrator.cli"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr and "orchestrator.commands.warmup" in res.stderr
