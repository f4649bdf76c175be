"""located's first pass builds the data itself for plain str/map/seq nodes and hands every other node to
PyYAML's safe constructor: the data must be exactly the safe loader's, and its errors still name their line."""

from __future__ import annotations

import pytest
import yaml

from orchestrator import located
from orchestrator.errors import InventoryError

DOCS = [
    "hosts:\n  pve: {ssh: pve.lan, port: 22, sudo: yes}\ntargets:\n  ct1: {kind: container, host: pve, ctid: 101}\n",
    "a: [1, 2.5, .inf, -.5, 1e3, ~, null, '', yes, no, on, Off, 0x1f, 0o17, 017, 1_000, '1', \"x\", 2001-12-14]\n",
    "t: !!str 3\ni: !!int '4'\nf: !!float '1'\nb: !!binary aGVsbG8=\nd: 2001-12-14 21:59:43.10 -5\n",
    "merged: {<<: {a: 1, b: 2}, b: 3}\nlist: {<<: [{x: 1}, {y: 2}], z: 3}\n",
    "1: int key\n2.5: float key\nnull: null key\ntrue: bool key\n=: value key\n",
    "s: !!set {a, b}\no: !!omap [a: 1, b: 2]\np: !!pairs [a: 1, a: 2]\n",
    "- [[[[1]]]]\n- {a: {b: {c: [x, {d: e}]}}}\n- []\n- {}\n",
    "block: |\n  text\n  more\nfolded: >\n  fold\n  ed\n'quoted key': v\n\"dq key\": 1\nempty:\n",
    "top level scalar\n",
    "- a list\n- at the top\n",
    # Implicit tags by first character and style: `target`, `true_x`, `no_x`, `-x`, `.x`, `~x` start like a
    # bool, an int, a float or a null and are text; a quoted `'12'` is text where a plain 12 is an int; a
    # non-specific `!` is what libyaml's flags make it (`! 12`: an int, as the C safe loader reads it); on a
    # collection, its default tag; the same inside a `<<` merge, which PyYAML's constructor builds.
    "a: ! 12\nb: ! yes\nc: ! ~\nd: !!str 5\ne: !<tag:yaml.org,2002:str> 6\nf: ! {x: 1}\ng: ! [1, 2]\n",
    "m: {<<: {a: 1}, b: ! 12, c: 12, d: [! 13, 13], e: '12', f: \"13\"}\n",
    "! 12\n",
    "target: t\ntrue_x: tx\nno_x: nx\n-x: -1\n+x: +1\n.x: .5\n~x: ~\n'1': '2'\n\"yes\": \"no\"\n",
    "- 012\n- 0b101\n- 1:30\n- 190:20:30\n- 1_0\n- -0\n- 0.0\n- .NaN\n- -.inf\n- Null\n- NULL\n- TRUE\n- Y\n- n\n",
    "k: |-\n  12\nj: >\n  yes\nl: ''\nm:\nn: '-'\no: [-, ~, '']\n",
]


@pytest.mark.parametrize("text", DOCS)
def test_the_data_is_the_safe_loaders(text):
    """Every value, type and key as PyYAML's own safe loader builds them (repr compares types: 1 vs '1')."""
    expected = yaml.load(text, Loader=yaml.CSafeLoader)
    got = located.load_data(text, "inventory.yaml")
    assert repr(got) == repr(expected)
    assert got == expected


def test_an_empty_document_is_none():
    assert located.load_data("", "inventory.yaml") is None
    assert located.load_data("# only a comment\n", "inventory.yaml") is None


@pytest.mark.parametrize(("text", "line", "what"), [
    ("a: 1\nb: !!int x\n", 2, "int value 'x' is not valid"),
    ("a:\n  - 1\n  - !!float abc\n", 3, "float value 'abc' is not valid"),
    ("a: 1\n\nb: 2001-13-45\n", 3, "timestamp value '2001-13-45' is not valid (month must be in 1..12)"),
])
def test_a_value_its_tag_cannot_hold_is_one_error_at_its_line(text, line, what):
    """PyYAML's constructor raises a bare ValueError for these (no mark); the loader names the line."""
    with pytest.raises(InventoryError) as err:
        located.load_data(text, "inventory.yaml")
    assert str(err.value).startswith(f"inventory.yaml:{line}: ") and what in str(err.value)


@pytest.mark.parametrize(("text", "message"), [
    ("a: 1\nb:\n  c: 1\n  c: 2\n", "inventory.yaml:4: b.c: duplicate key (first at line 3)"),
    ("- x\n- {k: 1, k: 2}\n", "inventory.yaml:2: 1.k: duplicate key (first at line 2)"),
    ("m: {<<: {a: 1}, a: 2, a: 3}\n", "inventory.yaml:1: m.a: duplicate key (first at line 1)"),
])
def test_a_duplicate_key_is_found_at_its_line_however_deep(text, message):
    with pytest.raises(InventoryError) as err:
        located.load_data(text, "inventory.yaml")
    assert str(err.value).splitlines()[0] == message


def test_an_unknown_tag_and_an_unhashable_key_are_yaml_errors_at_their_line():
    for text, what in (("a: 1\nb: !foo 1\n", "could not determine a constructor for the tag '!foo'"),
                       ("a: 1\n? [1]\n: x\n", "found unhashable key")):
        with pytest.raises(InventoryError) as err:
            located.load_data(text, "inventory.yaml")
        assert str(err.value).startswith("inventory.yaml:") and what in str(err.value)
