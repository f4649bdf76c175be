"""inventory.yaml: models, lookup order, and error messages that name file:line:key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from orchestrator.errors import InventoryError, UserError
from orchestrator.inventory import (
    EMBEDDED,
    CommandExperiment,
    ContainerTargetSpec,
    DflashExperiment,
    check_name,
    embedded_text,
    load_inventory,
    parse_inventory,
)

REPO = Path(__file__).resolve().parents[2]

BASE = """\
hosts:
  pve1:
    ssh: pve1.lan
targets:
  local:
    kind: local
    workdir: /tmp/x
    venv: workstation
  ct200:
    kind: container
    host: pve1
    ctid: 200
    workdir: /root/dflash
    venv: cuda
venvs:
  workstation:
    kind: workstation
  cuda:
    kind: uv
    lock: cuda
experiments:
  tiny:
    kind: dflash
    target: local
    layout: {target_gpus: [], drafter_gpus: []}
    trainer:
      max_steps: 5
  cmd:
    kind: command
    target: ct200
    command: [python, train.py]
    gpus: [0, 1]
"""


def write(tmp_path: Path, text: str, name: str = "inventory.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def load_error(tmp_path: Path, text: str) -> str:
    p = write(tmp_path, text)
    with pytest.raises(InventoryError) as info:
        load_inventory(p)
    return info.value.message


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line containing needle."""
    for n, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return n
    raise AssertionError(needle)


# ---------------------------------------------------------------- the shipped file


def test_shipped_inventory_has_tiny_and_the_worked_example():
    inv = load_inventory(REPO / "inventory.yaml")
    tiny = inv.experiment("tiny")
    assert isinstance(tiny, DflashExperiment)
    assert tiny.target == "local" and tiny.layout.colocated
    assert inv.target("local").kind == "local" and inv.target("local").venv == "workstation"
    assert inv.venv("workstation").kind == "workstation"

    exp = inv.experiment("exp-ddtree-expanded")
    assert exp.layout.target_gpus == [0, 1, 2, 3, 4]
    assert exp.layout.drafter_gpus == [5, 6, 7]
    assert exp.trainer.data.token_budget == 49152
    assert exp.trainer.data.max_batch_size == 64
    assert exp.trainer.gamma == 10.0
    ct = inv.target(exp.target)
    assert isinstance(ct, ContainerTargetSpec) and ct.ctid == 200 and ct.host == "pve1"
    assert inv.monitor.regression_fraction == 0.7 and inv.monitor.hang_seconds == 600


def test_repo_file_is_the_packaged_default():
    assert (REPO / "inventory.yaml").read_text() == embedded_text()
    assert (REPO / "templates" / "inventory.yaml").resolve() == (REPO / "inventory.yaml").resolve()
    assert not (REPO / "orchestrator" / "default_inventory.yaml").exists()


def test_a_wheel_install_carries_the_embedded_default_and_launches_tiny_from_it(tmp_path):
    """What a user's `pip install dflashctl` gets (the editable install of the tests reads the checkout, so
    embedded_text() there is the checkout's file): the wheel setuptools builds from this tree holds the
    default inventory with the text of the repo's inventory.yaml, and its console script, in a venv, with no
    inventory anywhere and no checkout on the path, plans `launch tiny` from it."""
    import os
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"
    for name in ("orchestrator", "trainer", "templates"):  # templates/inventory.yaml stays a link, as in git
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
    for name in ("pyproject.toml", "README.md", "inventory.yaml"):
        shutil.copy(REPO / name, src / name)
    build = "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))"
    res = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=src, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    wheel = tmp_path / "dist" / res.stdout.split()[-1]
    with zipfile.ZipFile(wheel) as zf:
        packaged = [n for n in zf.namelist() if n.endswith("/inventory.yaml")]
        assert packaged == ["orchestrator/templates/inventory.yaml"], zf.namelist()
        assert zf.read(packaged[0]).decode() == (REPO / "inventory.yaml").read_text()  # the text, not a link
        assert "orchestrator/templates/start_training.sh" in zf.namelist()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    subprocess.run(["uv", "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--no-deps", str(wheel)],
                   check=True, timeout=300)
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DFLASHCTL_INVENTORY")}
    env.update(XDG_CONFIG_HOME=str(home / "cfg"), XDG_DATA_HOME=str(home / "data"),
               DFLASHCTL_STATE_DIR=str(home / "state"), COLUMNS="300")
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import orchestrator; print(orchestrator.__file__)"],
                           capture_output=True, text=True, env=env, cwd=home.parent, check=True)
    assert where.stdout.startswith(str(venv)), where.stdout  # the wheel's copy, not the checkout
    empty = home / "cwd"
    empty.mkdir(parents=True)
    res = subprocess.run([str(venv / "bin" / "dflashctl"), "launch", "tiny", "--dry-run"], capture_output=True,
                         text=True, env=env, cwd=empty, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "plan (dry run, nothing changed) for tiny on local" in lines, res.stdout
    runs = home / "data" / "dflashctl" / "local" / "runs"
    assert any(line.strip().startswith(f"run dir:  {runs}/tiny-") for line in lines), res.stdout
    assert not runs.exists()  # a dry run writes nothing


def test_lookup_order(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASHCTL_INVENTORY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert load_inventory().source == EMBEDDED

    user = tmp_path / "cfg" / "dflashctl" / "inventory.yaml"
    user.parent.mkdir(parents=True)
    user.write_text(BASE)
    assert load_inventory().source == str(user)

    cwd_file = write(empty, BASE)
    assert load_inventory().source == str(cwd_file)

    env_file = write(tmp_path, BASE, "env.yaml")
    monkeypatch.setenv("DFLASHCTL_INVENTORY", str(env_file))
    assert load_inventory().source == str(env_file)

    explicit = write(tmp_path, BASE, "explicit.yaml")
    assert load_inventory(explicit).source == str(explicit)


def test_missing_explicit_file_is_named(tmp_path, monkeypatch):
    with pytest.raises(InventoryError, match=r"nope\.yaml.*--inventory.*does not exist"):
        load_inventory(tmp_path / "nope.yaml")
    monkeypatch.setenv("DFLASHCTL_INVENTORY", str(tmp_path / "gone.yaml"))
    with pytest.raises(InventoryError, match=r"gone\.yaml.*DFLASHCTL_INVENTORY"):
        load_inventory()


def test_base_parses_and_resolves(tmp_path):
    inv = load_inventory(write(tmp_path, BASE))
    assert isinstance(inv.experiment("cmd"), CommandExperiment)
    assert inv.target(inv.experiment("cmd").target).venv == "cuda" and inv.venv("cuda").kind == "uv"
    assert inv.target(inv.experiment("tiny").target).venv == "workstation"
    assert inv.experiment("tiny").trainer.max_steps == 5
    assert inv.line_of("experiments", "tiny") == line_of(BASE, "  tiny:")


# ---------------------------------------------------------------- bad files


def test_unknown_key_names_file_line_key_and_suggests(tmp_path):
    text = BASE.replace("    layout: {", "    layuot: {")
    msg = load_error(tmp_path, text)
    n = line_of(text, "layuot")
    assert f"inventory.yaml:{n}: experiments.tiny.layuot: unknown key; did you mean 'layout'?" in msg


def test_unknown_key_in_a_container_target_drops_the_union_tag(tmp_path):
    text = BASE.replace("    ctid: 200", "    ctid: 200\n    gpu_idel_mib: 5")
    msg = load_error(tmp_path, text)
    assert f":{line_of(text, 'gpu_idel_mib')}: targets.ct200.gpu_idel_mib: unknown key; did you mean 'gpu_idle_mib'?" in msg


def test_unknown_key_inside_trainer_config(tmp_path):
    text = BASE.replace("      max_steps: 5", "      max_steps: 5\n      data: {token_budgt: 4}")
    msg = load_error(tmp_path, text)
    assert f":{line_of(text, 'token_budgt')}: experiments.tiny.trainer.data.token_budgt: unknown key; did you mean 'token_budget'?" in msg


def test_wrong_type_names_line_and_value(tmp_path):
    text = BASE.replace("ctid: 200", "ctid: two-hundred")
    msg = load_error(tmp_path, text)
    assert f"inventory.yaml:{line_of(text, 'two-hundred')}: targets.ct200.ctid:" in msg
    assert "two-hundred" in msg


def test_invalid_trainer_value_is_reported_with_its_line(tmp_path):
    text = BASE.replace("max_steps: 5", "max_steps: 0")
    msg = load_error(tmp_path, text)
    assert f":{line_of(text, 'max_steps: 0')}: experiments.tiny.trainer.max_steps:" in msg


def test_missing_required_key_points_at_its_parent(tmp_path):
    text = BASE.replace("    host: pve1\n", "")
    msg = load_error(tmp_path, text)
    assert f":{line_of(text, '  ct200:')}: targets.ct200.host: required key is missing" in msg


def test_unknown_kind(tmp_path):
    text = BASE.replace("kind: container", "kind: vm")
    msg = load_error(tmp_path, text)
    assert f":{line_of(text, 'kind: vm')}: targets.ct200.kind: unknown kind" in msg
    assert "unknown kind 'vm'" in msg and "container" in msg


def test_bad_names_are_refused_with_line(tmp_path):
    for bad in ("../evil", "a;b", "$(id)", "a b", "-x", "x" * 65):
        text = BASE.replace("  tiny:", f"  {bad!r}:")
        msg = load_error(tmp_path, text)
        assert f":{line_of(text, repr(bad))}: experiments." in msg and "unsafe name" in msg, bad


def test_dangling_references(tmp_path):
    text = BASE.replace("target: local", "target: locl")
    msg = load_error(tmp_path, text)
    assert f":{line_of(text, 'target: locl')}: experiments.tiny.target: no target named 'locl'; did you mean 'local'?" in msg

    text = BASE.replace("host: pve1", "host: pve9")
    assert "targets.ct200.host: no host named 'pve9'" in load_error(tmp_path, text)

    text = BASE.replace("    venv: cuda", "    venv: gpu")
    assert "targets.ct200.venv: no venv profile named 'gpu'" in load_error(tmp_path, text)


def test_container_workdir_must_be_absolute(tmp_path):
    text = BASE.replace("workdir: /root/dflash", "workdir: dflash")
    msg = load_error(tmp_path, text)
    assert f":{line_of(text, 'workdir: dflash')}: targets.ct200.workdir: must be an absolute path" in msg


def test_gpu_lists_must_be_disjoint(tmp_path):
    text = BASE.replace("target: local\n    layout: {target_gpus: [], drafter_gpus: []}",
                        "target: ct200\n    layout: {target_gpus: [0, 1, 2], drafter_gpus: [2, 3]}")
    msg = load_error(tmp_path, text)
    assert "experiments.tiny.layout: GPU [2] is in both target_gpus and drafter_gpus" in msg


def test_duplicate_key_and_yaml_syntax(tmp_path):
    text = BASE.replace("  cmd:", "  tiny:")
    msg = load_error(tmp_path, text)
    assert "experiments.tiny: duplicate key (first at line" in msg

    msg = load_error(tmp_path, "targets:\n  local: [unclosed\n")
    assert "inventory.yaml:" in msg and "YAML syntax error" in msg


def test_all_errors_reported_at_once(tmp_path):
    text = BASE.replace("    layout: {", "    layuot: {").replace("ctid: 200", "ctid: x")
    msg = load_error(tmp_path, text)
    assert "layuot" in msg and "ctid" in msg and len(msg.splitlines()) >= 2


# ---------------------------------------------------------------- names from the command line


def test_misspelt_names_get_a_suggestion(tmp_path):
    inv = load_inventory(write(tmp_path, BASE))
    with pytest.raises(InventoryError, match=r"no experiment 'tinyy'.*did you mean 'tiny'\?"):
        inv.experiment("tinyy")
    with pytest.raises(InventoryError, match=r"no target 'ct20'.*did you mean 'ct200'\?"):
        inv.target("ct20")
    with pytest.raises(InventoryError, match=r"no host 'pve'.*did you mean 'pve1'\?"):
        inv.host("pve")
    with pytest.raises(InventoryError) as info:
        inv.experiment("zzzzzz")
    assert "did you mean" not in info.value.message and "known: cmd, tiny" in info.value.message


@pytest.mark.parametrize("bad", ["", "..", "a/b", "../x", "a..b", "$(id)", "a;b", "`x`", "a b", "-rf", "é", "x" * 65, "a\nb"])
def test_check_name_refuses_unsafe(bad):
    with pytest.raises(UserError, match="bad tag name"):
        check_name("tag", bad)


@pytest.mark.parametrize("good", ["tiny", "exp-ddtree-expanded", "run_1.2", "A", "x" * 64])
def test_check_name_accepts_safe(good):
    assert check_name("tag", good) == good


def test_lookup_refuses_unsafe_name_before_searching(tmp_path):
    inv = load_inventory(write(tmp_path, BASE))
    with pytest.raises(UserError, match="bad experiment name"):
        inv.experiment("../tiny")


def test_the_embedded_default_is_packaged():
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["tool"]["setuptools"]["package-dir"]["orchestrator.templates"] == "templates"
    assert "*.yaml" in meta["tool"]["setuptools"]["package-data"]["orchestrator.templates"]
    assert parse_inventory(embedded_text(), EMBEDDED).experiment("tiny").kind == "dflash"


def test_local_workdir_defaults_to_the_user_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    inv = parse_inventory("targets:\n  local: {kind: local}\nvenvs:\n  workstation: {kind: workstation}\n")
    assert inv.target("local").resolved_workdir() == tmp_path / "data" / "dflashctl" / "local"
    monkeypatch.setenv("SOMEWHERE", str(tmp_path / "w"))
    inv = parse_inventory("targets:\n  local: {kind: local, workdir: $SOMEWHERE/x}\nvenvs:\n  workstation: {kind: workstation}\n")
    assert inv.target("local").resolved_workdir() == tmp_path / "w" / "x"


def test_shipped_tiny_matches_the_trainers_tiny_config():
    from trainer import tiny  # the trainer extra (torch) is part of the test install: not a skip
    shipped = load_inventory(REPO / "inventory.yaml").experiment("tiny").trainer.model_dump(exclude={"output_dir"})
    assert shipped == tiny.tiny_train_config("x").model_dump(exclude={"output_dir"})


def test_minimal_inventory_gets_the_workstation_profile_implicitly():
    inv = parse_inventory("targets:\n  local: {kind: local}\n")
    assert inv.venv("workstation").kind == "workstation"


def test_non_text_names_and_non_mapping_top_level():
    with pytest.raises(InventoryError, match=r"inventory.yaml:2: experiments.123: a name must be text"):
        parse_inventory("experiments:\n  123: {kind: command, target: x, command: [a]}\n")
    with pytest.raises(InventoryError, match=r"inventory.yaml:1: the top level must be a mapping"):
        parse_inventory("- a\n- b\n")
    with pytest.raises(InventoryError, match=r"inventory.yaml:1: targets: Input should be a valid dictionary"):
        parse_inventory("targets: [1, 2]\n")


def test_system_profile_and_the_workstation_interpreter_refused_on_containers():
    base = ("hosts:\n  pve: {ssh: pve.lan}\n"
            "targets:\n  ct: {kind: container, host: pve, ctid: 200, venv: %s}\n"
            "venvs:\n  sys: {kind: system}\n  cuda: {kind: uv, wheelhouse: [~/wheels]}\n")
    inv = parse_inventory(base % "sys")
    assert inv.venv("sys").kind == "system" and inv.venv("cuda").wheelhouse == ["~/wheels"]
    with pytest.raises(InventoryError) as info:
        parse_inventory(base % "workstation")
    assert "inventory.yaml:4: targets.ct.venv: venv profile 'workstation' is the workstation's own interpreter" in str(info.value)
    assert "`kind: system`" in str(info.value)
    exp = base % "cuda" + "experiments:\n  c: {kind: command, target: ct, venv: workstation, command: [python3, -V]}\n"
    with pytest.raises(InventoryError, match=r"experiments\.c\.venv: venv profile 'workstation'.*kind: system"):
        parse_inventory(exp)
    assert parse_inventory(exp.replace("venv: workstation", "venv: sys")).experiment("c").venv == "sys"
    shipped = load_inventory(REPO / "inventory.yaml")
    assert shipped.venv("system").kind == "system"


# ---------------------------------------------------------------- input that must not cost minutes


def test_a_nul_byte_is_one_error_line_naming_file_and_line_through_the_installed_script(tmp_path):
    """A control character in the file: one `FILE:LINE:` error and a fix that removes it when pasted, not a
    reader traceback."""
    import shutil
    import subprocess

    p = tmp_path / "inventory.yaml"
    p.write_bytes(BASE.replace("  cmd:\n", "  c\x00md:\n").encode())
    res = subprocess.run([shutil.which("dflashctl"), "--inventory", str(p), "status"], capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 2, out
    assert lines[0] == f"error: {p}:{line_of(BASE, '  cmd:')}: control character U+0000 (NUL) at column 4; " \
        "YAML text cannot hold it"
    fix = lines[1].removeprefix("fix: ")
    subprocess.run(["sh", "-c", fix], check=True, cwd=tmp_path, timeout=30)
    assert "cmd" in load_inventory(p).experiments


@pytest.mark.parametrize("char", ["\x07", "\x1b", "\x7f"])
def test_other_control_characters_name_their_line_and_column(tmp_path, char):
    """Any character YAML cannot hold is named with its code point, line and column."""
    text = BASE.replace("ssh: pve1.lan", f"ssh: pve1{char}.lan")
    msg = load_error(tmp_path, text)
    assert msg.splitlines() == [f"{tmp_path / 'inventory.yaml'}:{line_of(BASE, 'ssh: pve1.lan')}: control "
                                f"character U+{ord(char):04X} at column 14; YAML text cannot hold it"]


def test_yaml_aliases_are_refused_at_the_alias_line(tmp_path):
    """An alias (the stuff of a 300-byte alias bomb that expands to billions of entries) is refused with the
    alias's own line, before anything walks the document."""
    text = BASE.replace("    gpus: [0, 1]\n", "    gpus: &g [0, 1]\n") + "  cmd2:\n    kind: command\n" \
        "    target: ct200\n    command: [python]\n    gpus: *g\n"
    with pytest.raises(InventoryError) as info:
        load_inventory(write(tmp_path, text))
    msg = info.value.message
    assert msg == f"{tmp_path / 'inventory.yaml'}:{line_of(text, 'gpus: *g')}: YAML alias *g: anchors and " \
        "aliases are not accepted in an inventory (a few aliases can expand to billions of entries)"
    assert "*g" in info.value.fix


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    """The classic nine-level alias bomb is refused on its first alias (line 2), before any expansion."""
    bomb = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for level, prev in zip("bcdefghi", "abcdefgh"):
        bomb.append(f"{level}: &{level} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]")
    msg = load_error(tmp_path, "\n".join(bomb) + "\n")
    assert msg.startswith(f"{tmp_path / 'inventory.yaml'}:2: YAML alias *a:")


def test_the_loader_is_libyaml_and_keeps_lines(tmp_path):
    """The C parser (PyYAML's pure-Python composer took minutes on a 10 MB file; bench/inventory_load.py
    measures it) still gives every key its line."""
    import yaml

    from orchestrator import yamlload

    assert issubclass(yamlload.Loader, yaml.CSafeLoader)
    inv = load_inventory(write(tmp_path, BASE))
    assert inv.line_of("experiments", "cmd", "gpus") == line_of(BASE, "gpus: [0, 1]")
    assert inv.line_of("targets", "ct200", "ctid") == line_of(BASE, "ctid: 200")


@pytest.mark.parametrize("value", ["0", "7", "-12", "200", "123456789012345678901234567890", "010", "-0", "00",
                                   "+5", "1_000", "0x1f", "0b11", "0o17", "1:30", "1.5", ".inf", "1e3", "yes",
                                   "Off", "~", "null", "2026-01-01"])
def test_the_loaders_scalars_are_the_safe_loaders(value):
    """The first pass builds the common scalars itself (a plain decimal int without the constructor): each
    value and its type are exactly PyYAML's safe loader's, octal `010`, `+5`, `1_000` and `1:30` included."""
    import yaml

    from orchestrator import yamlload

    text = f"a: {value}\nb: [{value}, {value}]\n"
    loader = yamlload.Loader(text)
    try:
        ours = loader.get_single_data()
    finally:
        loader.dispose()
    want = yaml.load(text, Loader=yaml.SafeLoader)
    assert ours == want and [type(v) for v in (ours["a"], *ours["b"])] == [type(want["a"])] * 3


def big_inventory(n: int, ctid_of_last: int = 999) -> str:
    """An inventory over yamlload.CACHE_MIN_BYTES: n container targets, the last with `ctid_of_last`."""
    rows = [f"  ct{i}: {{kind: container, host: pve, ctid: {100 + i if i < n - 1 else ctid_of_last}}}"
            for i in range(n)]
    return "hosts:\n  pve: {ssh: pve.lan}\ntargets:\n" + "\n".join(rows) + "\nvenvs:\n  cuda: {kind: uv}\n"


def test_a_large_inventory_is_read_back_from_the_cache_and_a_changed_one_is_not(tmp_path, monkeypatch):
    """A large text's data is kept in the state dir, keyed by the text itself: the same text again is read
    back (no parse), one changed byte is parsed anew, and a duplicate key is still found at its line."""
    from orchestrator import yamlload

    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    text = big_inventory(6000)
    assert len(text) > yamlload.CACHE_MIN_BYTES
    path = write(tmp_path, text)
    assert load_inventory(str(path)).targets["ct5999"].ctid == 999
    cached = list((tmp_path / "state" / "yaml-cache").glob("*.marshal"))
    assert len(cached) == 1

    parsed = []
    real = yamlload.Loader.get_single_data
    monkeypatch.setattr(yamlload.Loader, "get_single_data", lambda self: parsed.append(1) or real(self))
    again = load_inventory(str(path))
    assert parsed == [] and again.targets["ct5999"].ctid == 999
    assert again.line_of("targets", "ct5999") == 6003  # the located pass, on demand

    path.write_text(big_inventory(6000, ctid_of_last=998))  # same size, one byte differs
    assert load_inventory(str(path)).targets["ct5999"].ctid == 998 and parsed == [1]

    dup = big_inventory(6000).replace("  ct5999:", "  ct17:")
    msg = load_error(tmp_path, dup)
    assert msg == f"{tmp_path / 'inventory.yaml'}:6003: targets.ct17: duplicate key (first at line 21)"


def test_a_merge_key_override_is_not_a_duplicate():
    """`<<:` merges (no alias needed) may be overridden by a key of their own mapping: the first pass sees
    fewer keys than entries, the second finds no duplicate, and the data is the merged mapping."""
    inv = parse_inventory("targets:\n  here: {<<: {kind: local, venv: workstation}, venv: workstation}\n")
    assert inv.targets["here"].venv == "workstation" and inv.line_of("targets", "here") == 2


def test_a_large_inventorys_models_are_out_of_the_gcs_way_once_loaded():
    """Made with the cyclic GC off, an inventory's models are all in its youngest generation: the command's
    next collection walked them all (0.17 s after a 10 MB inventory). Above the cache's size they are frozen."""
    import gc

    from orchestrator import yamlload

    gc.unfreeze()
    lines = ["targets:"] + [f"  t{i}: {{kind: local}}" for i in range(12000)]
    text = "\n".join(lines) + "\n"
    assert len(text) > yamlload.CACHE_MIN_BYTES
    inv = parse_inventory(text, "big.yaml", cache=False)
    walked = {id(o) for o in gc.get_objects()}  # what collections walk (every generation; a frozen object is in none)
    assert inv.targets["t11999"].kind == "local" and id(inv) not in walked and id(inv.targets["t5"]) not in walked
