"""A large inventory's first pass in two processes (orchestrator.yamlsplit, yamlload's second half): it must
give exactly what the whole text gives in one process, data or error, wherever the cut falls: inside quoted
and block scalars, multi-line flow collections, comments, sections after the cut, keys in both halves. The
split is forced on small texts here (SPLIT_MIN_BYTES 0), so each example runs a real second interpreter."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pytest

from orchestrator import located, yamlload, yamlsplit
from orchestrator.errors import InventoryError


def whole(text: str):
    """located.load_data in one process: the data, or the InventoryError's text."""
    return _load(text, split=False)


def split(text: str):
    return _load(text, split=True)


def _load(text: str, split: bool):
    old = yamlsplit.SPLIT_MIN_BYTES
    yamlsplit.SPLIT_MIN_BYTES = 0 if split else 1 << 62
    try:
        return located.load_data(text, "inv.yaml")
    except InventoryError as exc:
        return ("error", str(exc), exc.fix)
    finally:
        yamlsplit.SPLIT_MIN_BYTES = old


def entries(n: int, start: int = 0) -> str:
    return "".join(f"  exp-{i}:\n    kind: command\n    gpus: [{i % 8}, 1]\n    env: {{A: '{i}'}}\n"
                   for i in range(start, start + n))


PLAIN = "hosts:\n  pve: {ssh: pve.lan}\nexperiments:\n" + entries(40) + "venvs:\n  v: {kind: uv}\n"


def test_the_cut_starts_an_entry_of_the_largest_block_mapping_and_the_halves_merge_to_the_whole():
    key, header, at = yamlsplit.split_point(PLAIN)
    assert (key, header) == ("experiments", "experiments:")
    assert PLAIN[at:].startswith("  exp-") and PLAIN[at - 1] == "\n"
    first, second = yamlsplit.halves(PLAIN, (key, header, at))
    assert second.startswith("experiments:\n  exp-")
    merged = yamlsplit.merge(yaml.safe_load(first), yaml.safe_load(second), key)
    assert merged == yaml.safe_load(PLAIN) and list(merged) == ["hosts", "experiments", "venvs"]
    assert list(merged["experiments"]) == [f"exp-{i}" for i in range(40)]  # the order of the whole text


def test_the_second_half_really_parses_in_another_process_and_the_result_is_the_whole_texts(monkeypatch):
    monkeypatch.setattr(yamlsplit, "SPLIT_MIN_BYTES", 0)
    started = yamlload._start_second_half(PLAIN)
    assert started is not None
    cut, child = started
    assert child.pid and child.args[1:] == ["-m", "orchestrator.yamlload"]
    data, kept = yamlload._first_half_and_merge(PLAIN, "inv.yaml", cut, child, True)
    assert data == yaml.safe_load(PLAIN) and child.returncode == 0
    assert kept[:2] == ("halves", "experiments")


@pytest.mark.parametrize("text", [
    "%YAML 1.1\n---\nexperiments:\n" + entries(6),                      # a directive, a document marker
    "experiments:\n" + entries(6) + "...\n",                             # a document end
    "experiments:\n" + entries(3) + "\tbad: tab\n" + entries(3, 3),      # a tab at a line's start
    "experiments: {}\n" + "x:\n" + entries(1),                           # the largest section is not a block
    "experiments:\n" + "".join(f"  - item {i}\n" for i in range(20)),    # a sequence
    "experiments:\n# only comments\n",                                   # no entry
    "---\nexperiments:\n" + entries(6),                                  # a marker on the very first line
])
def test_no_cut_where_the_text_could_be_read_another_way(text):
    assert yamlsplit.split_point(text) is None


TRICKY = [
    # A double-quoted scalar whose continuation line, at the entries' indentation, looks like an entry.
    'experiments:\n' + entries(10) + '  odd: "first\n  exp-x: not a key"\n' + entries(10, 10),
    # A multi-line flow mapping whose second line looks like an entry.
    'experiments:\n' + entries(10) + '  flow: {a: 1,\n  exp-y: 2}\n' + entries(10, 10),
    # A block scalar whose lines look like entries one level deeper.
    'experiments:\n' + entries(10) + '  text: |\n    exp-z: 1\n     indented\n' + entries(10, 10),
    # Comments at every indentation, blank lines, a key with a comment after it.
    'experiments:   # the runs\n' + entries(10) + '\n# between\n  # indented\n\n' + entries(10, 10)
    + 'venvs:\n  v: {kind: uv}\n',
    # The same experiment in both halves: one duplicate, named at both lines by the whole parse.
    'experiments:\n' + entries(12) + entries(12, 12) + '  exp-1:\n    kind: command\n',
    # A top-level key of the first half repeated after the section.
    'hosts:\n  a: {ssh: a}\nexperiments:\n' + entries(20) + 'hosts:\n  b: {ssh: b}\n',
    # A YAML error in the second half: its line is the whole text's.
    'experiments:\n' + entries(15) + '  broken: [1, 2\n' + entries(5, 15),
    # A value the safe loader refuses in the second half.
    'experiments:\n' + entries(15) + '  bad: !!python/object:os.system x\n',
    # The section's last entry holds the middle (a long block scalar) and a section with the same indentation
    # follows: no cut there (its entries belong to another mapping).
    'experiments:\n' + entries(3) + '  notes: |\n' + "".join(f"    line {i}: text\n" for i in range(400))
    + 'venvs:\n  v: {kind: uv}\n  w: {kind: uv}\n',
    # A date in the second half: marshal cannot hold it, so the child says no and the whole text is parsed.
    'experiments:\n' + entries(15) + '  when: 2026-12-03\n',
]


@pytest.mark.parametrize("text", TRICKY)
def test_a_cut_anywhere_gives_what_the_whole_text_gives(text):
    assert split(text) == whole(text)


@st.composite
def inventories(draw):
    """Inventory-like texts: a few top-level sections, one large block mapping whose entries take every shape
    a cut could fall inside."""
    def value(i: int) -> str:
        return draw(st.sampled_from([
            f"{{kind: command, gpus: [{i}]}}\n",
            f"'quoted: {i}'\n",
            f'"two\n  exp-{i}x: lines"\n',
            f"{{a: {i},\n  exp-{i}y: 2}}\n",
            f"|\n    exp-{i}z: block\n    more\n",
            f">\n    folded {i}\n\n    para\n",
            f"plain {i}\n    continued\n",
            f"\n    kind: command\n    env: {{K: '{i}'}}\n",
            "[1, 2,\n    3]\n",
            "\n    - a\n    - b\n",
        ]))

    n = draw(st.integers(2, 24))
    names = draw(st.lists(st.sampled_from([f"exp-{i}" for i in range(30)]), min_size=n, max_size=n, unique=True))
    body = "".join(f"  {name}: {value(i)}" + draw(st.sampled_from(["", "# c\n", "  # c\n", "\n"]))
                   for i, name in enumerate(names))
    before = draw(st.sampled_from(["", "hosts:\n  pve: {ssh: pve.lan}\n"]))
    after = draw(st.sampled_from(["", "venvs:\n  v: {kind: uv}\n", "hosts:\n  x: {ssh: x}\n"]))
    return before + "experiments:\n" + body + after


@pytest.mark.slow  # a second interpreter per example: over ~4 s
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=inventories())
def test_split_and_whole_agree_on_generated_inventories(text):
    got = split(text)
    assert got == whole(text)
    if not isinstance(got, tuple):  # parsed: and as PyYAML's own safe loader reads it
        assert got == yaml.safe_load(text)


def test_a_large_inventory_is_cut_and_merged_exactly(tmp_path):
    """Above SPLIT_MIN_BYTES for real (no forcing): the cut is found, and the data is the whole parse's."""
    text = "hosts:\n  pve: {ssh: pve.lan}\nexperiments:\n" + entries(32000) + "venvs:\n  v: {kind: uv}\n"
    assert len(text) > yamlsplit.SPLIT_MIN_BYTES
    cut = yamlsplit.split_point(text)
    assert cut is not None and 0.3 < cut[2] / len(text) < 0.7
    assert located.load_data(text, "inv.yaml") == whole(text)


def test_a_split_load_is_cached_as_its_halves_and_read_back_without_a_parse(tmp_path, monkeypatch):
    import marshal

    text = "hosts:\n  pve: {ssh: pve.lan}\nexperiments:\n" + entries(4000) + "venvs:\n  v: {kind: uv}\n"
    assert len(text) > yamlload.CACHE_MIN_BYTES
    monkeypatch.setattr(yamlsplit, "SPLIT_MIN_BYTES", 0)
    first = yamlload.load_plain(text, "inv.yaml", cache_dir=tmp_path)
    assert first == whole(text)
    [entry] = tmp_path.glob("*.marshal")
    kept = marshal.loads(entry.read_bytes())
    assert isinstance(kept, tuple) and kept[:2] == ("halves", "experiments")  # the child's bytes, not re-made
    parsed = []
    real = yamlload.Loader.get_single_node  # what every parse composes with (the halves' and the whole text's)
    monkeypatch.setattr(yamlload.Loader, "get_single_node", lambda self: parsed.append(1) or real(self))
    assert yamlload.load_plain(text, "inv.yaml", cache_dir=tmp_path) == first and parsed == []
    entry.write_bytes(marshal.dumps(("halves", "experiments", marshal.dumps({}), marshal.dumps([]))))
    assert yamlload.load_plain(text, "inv.yaml", cache_dir=tmp_path) == first and parsed  # a bad entry: parsed again


def test_the_cut_balances_the_nodes_not_the_bytes():
    """Dense one-line entries first (many nodes a byte), long sparse ones after: the cut falls where the
    separators (`:`, `,`, line ends: about one node each) are FIRST_SHARE counted, far from the byte middle."""
    dense = "".join(f"  d{i}: {{a: 1, b: 2, c: 3, d: 4, e: 5}}\n" for i in range(3000))
    sparse = "".join(f"  s{i}: {'X' * 120}\n" for i in range(3000))  # (capitals: a letter no separator)
    text = "experiments:\n" + dense + sparse
    seps = [i for i, ch in enumerate(text) if ch in ":,\n"]
    want = seps[int(len(seps) * yamlsplit.FIRST_SHARE)]  # the offset with that share of the separators before it
    got = yamlsplit._middle(text)
    assert abs(got - want) < 4096, (got, want, len(text))
    assert got < len(text) * 0.4  # the byte middle would give the first half twice the nodes
    cut = yamlsplit.split_point(text)
    assert 0 <= cut[2] - got < 200 and text[cut[2]:cut[2] + 3] == "  d"  # the next entry after the middle
    first, second = yamlsplit.halves(text, cut)
    weight = [sum(half.count(c) for c in ":,\n") for half in (first, second)]
    assert abs(weight[0] / sum(weight) - yamlsplit.FIRST_SHARE) < 0.025, weight


def test_no_second_process_to_be_had_is_the_one_process_parse(monkeypatch):
    """A second interpreter that cannot start (no process or file to spare) costs the split, not the load."""
    import subprocess

    def refuse(*args, **kw):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(yamlsplit, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    assert located.load_data(PLAIN, "inv.yaml") == yaml.safe_load(PLAIN)


def test_the_middle_is_interpolated_inside_the_block_that_crosses_the_half():
    """Blocks of 1000 characters, the separators all in the last, partial one: the middle is inside it,
    where half of them are behind (not at the block's start, nor past the text's end)."""
    text = "a" * 2000 + "b:c\n" * 125  # 2500 characters; 375 separators from offset 2000
    got = yamlsplit._middle(text, block=1000, share=0.5)
    assert 2240 <= got <= 2260, got


def test_the_cut_takes_the_indentation_of_the_largest_sections_own_entries():
    """A section indented by four just before the largest one (indented by two): the cut is one of the
    largest section's entries, at two."""
    text = "hosts:\n    pve: {ssh: pve.lan}\n    p: 1\nexperiments:\n" + entries(40)  # (a short line just before)
    _key, header, at = yamlsplit.split_point(text)
    assert header == "experiments:" and text[at:].startswith("  exp-")


@pytest.mark.parametrize(("first", "second"), [
    (["a"], {"experiments": {"b": 1}}),                                  # the first half is not a mapping
    ({"experiments": {"a": 1}}, ["b"]),                                  # nor the second
    ({"experiments": "text"}, {"experiments": {"b": 1}}),                # the section is not a mapping first
    ({"experiments": {"a": 1}}, {"experiments": "text"}),                # nor second
    ({"experiments": {"a": 1}}, {"other": 1, "experiments": {"b": 1}}),  # the second does not start with it
    ({"experiments": {"a": 1}}, {}),                                     # an empty second half
    ({"experiments": {"a": 1}}, {"experiments": {"a": 2}}),              # an entry in both halves
    ({"hosts": {}, "experiments": {"a": 1}}, {"experiments": {"b": 1}, "hosts": {}}),  # a top-level key twice
])
def test_halves_that_do_not_fit_together_are_not_merged(first, second):
    assert yamlsplit.merge(first, second, "experiments") is None


def _children() -> set[int]:
    import os

    kids = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as fh:
            kids |= {int(p) for p in fh.read().split()}
    return kids


def test_a_text_refused_before_its_parse_leaves_no_second_half_running(monkeypatch):
    """A text with a control character gets the same error as a one-process load, and the second half's
    interpreter is gone when the error arrives."""
    monkeypatch.setattr(yamlsplit, "SPLIT_MIN_BYTES", 0)
    text = PLAIN.replace("kind: command", "kind: com\x07mand", 1)
    before = _children()
    assert split(text) == whole(text) and split(text)[0] == "error" and "U+0007" in split(text)[1]
    assert _children() - before == set()


SAMPLE_CODEPOINTS = [*range(0x2000), 0xD7FF, 0xD800, 0xDBFF, 0xDC00, 0xDFFF, 0xE000, 0xFEFF, 0xFFFD, 0xFFFE, 0xFFFF,
                     0x10000, 0x10FFFF]


def test_libyamls_reader_refuses_exactly_what_the_control_character_scan_names():
    """Why halves that parse need no scan: the reader refuses a character (a ReaderError; a lone surrogate
    cannot even be encoded for it) exactly where refuse_unprintable would name one."""
    for cp in SAMPLE_CODEPOINTS:
        text = f"k: 'a{chr(cp)}b'\n"
        try:
            yaml.load(text, Loader=yaml.CSafeLoader)
            refused = False
        except (yaml.reader.ReaderError, UnicodeEncodeError):
            refused = True
        except yaml.YAMLError:
            refused = False  # a quote or a break inside the scalar: a syntax error, not the reader's
        assert refused == bool(yamlload._UNPRINTABLE.search(text)), hex(cp)


@pytest.mark.parametrize("char", ["\x00", "\x07", "\x7f", "\x86", "\ud800", "\ufffe"])
@pytest.mark.parametrize("where", ["first", "second"])
def test_a_control_character_in_either_half_is_the_one_process_error(monkeypatch, char, where):
    """The split load skips the scan while both halves parse: a character in either half fails that half's
    parse, and the error is the one-process load's (line, column, fix)."""
    monkeypatch.setattr(yamlsplit, "SPLIT_MIN_BYTES", 0)
    _key, _header, at = yamlsplit.split_point(PLAIN)
    line = PLAIN.index("kind: command", 0 if where == "first" else at)
    text = PLAIN[:line] + "kind: com" + char + PLAIN[line + len("kind: com"):]
    got = split(text)
    assert got == whole(text) and got[0] == "error" and f"U+{ord(char):04X}" in got[1]


def test_an_alias_in_a_split_text_is_refused_before_either_half_composes_it(monkeypatch):
    """The halves would expand an anchor and its alias in the same half (an alias bomb in one of them); a text
    with an `&` is scanned for aliases first, and the error is the one-process load's."""
    monkeypatch.setattr(yamlsplit, "SPLIT_MIN_BYTES", 0)
    _key, _header, at = yamlsplit.split_point(PLAIN)
    line = PLAIN.index("    env:", at)
    text = PLAIN[:line] + "    tags: &t [a, b]\n    more: *t\n" + PLAIN[line:]
    assert yamlsplit.split_point(text) is not None
    got = split(text)
    assert got == whole(text) and got[0] == "error" and "YAML alias *t" in got[1]


def collections_during(fn):
    """(fn's result, the generations of the cyclic GC's collections that started while fn ran), the GC on."""
    import gc

    started: list[int] = []

    def seen(phase, info):
        if phase == "start":
            started.append(info["generation"])

    was_on = gc.isenabled()
    gc.enable()
    gc.callbacks.append(seen)
    try:
        return fn(), started
    finally:
        gc.callbacks.remove(seen)
        if not was_on:
            gc.disable()


def test_a_large_load_runs_no_collection_and_its_data_is_out_of_the_gcs_way_after(monkeypatch):
    """A 2 MB text, in two processes. Every object the load makes is in the GC's youngest generation until a
    collection runs: one that ran while a half's node graph was alive walked all of it (~1 s of a 10 MB
    inventory's early read, 2026-12-07). None runs now; the data is frozen (gc.freeze) when the GC is back on,
    so the next collection does not walk it either."""
    import gc

    text = "hosts:\n  pve: {ssh: pve.lan}\nexperiments:\n" + entries(31000) + "venvs:\n  v: {kind: uv}\n"
    assert len(text) > yamlsplit.SPLIT_MIN_BYTES and yamlsplit.split_point(text) is not None
    data, started = collections_during(lambda: yamlload.load_plain(text, "inv.yaml"))
    assert started == [] and data["experiments"]["exp-30999"]["env"] == {"A": "30999"}
    walked = {id(o) for o in gc.get_objects()}  # what collections walk (every generation; a frozen object is in none)
    assert id(data) not in walked and id(data["experiments"]["exp-7"]) not in walked


def test_a_small_load_freezes_nothing():
    """Below CACHE_MIN_BYTES the GC's own pace is fine; freezing would keep a test's or a command's garbage
    cycles of the moment forever."""
    import gc

    gc.unfreeze()
    data, _ = collections_during(lambda: yamlload.load_plain(PLAIN, "inv.yaml"))
    assert data["venvs"] == {"v": {"kind": "uv"}} and gc.get_freeze_count() == 0
