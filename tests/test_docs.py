"""What the repository cites lives in the repository: every `docs/….md` path cited in code, tests or README
exists (and so does every section `§N` cited with it), nothing cites the notes beside the checkout
(../shared, reference/dflash.md, remote-stack.md outside docs/, DESIGN.md, STYLE.md), and the README links
every page under docs/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()

CITATION = re.compile(r"(?<![\w./-])docs/([\w./-]+?\.md)((?:,?\s*§[0-9][0-9.]*(?:[–-][0-9][0-9.]*)?)*)")
SECTION = re.compile(r"§([0-9][0-9.]*?)\.?(?=[^0-9.]|$)|[–-]([0-9][0-9.]*?)\.?(?=[^0-9.]|$)")
OUTSIDE = re.compile(
    r"\.\./shared|/work/shared|reference/dflash\.md|(?<!docs/)remote-stack\.md|(?<![\w/])DESIGN\.md|(?<![\w/])STYLE\.md"
)


def repo_text_files() -> list[Path]:
    """Tracked and new (not ignored) files, text only, this test excluded (it names what it forbids)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    files = []
    for rel in filter(None, out):
        p = REPO / rel
        if p.resolve() == SELF or not p.is_file() or p.suffix not in {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".in"}:
            continue
        files.append(p)
    return files


def citations(text: str) -> list[tuple[str, list[str]]]:
    """(docs page, [section numbers]) for every `docs/X.md [§N[, §M][–K]]` in text."""
    found = []
    for m in CITATION.finditer(text):
        sections = [a or b for a, b in SECTION.findall(m.group(2))]
        found.append((m.group(1), sections))
    return found


def headings(page: Path) -> set[str]:
    """Section numbers of a docs page: '## 2. Title' -> '2', '### 1.6 Title' -> '1.6'."""
    return {m.group(1) for m in re.finditer(r"(?m)^#{2,4} ([0-9]+(?:\.[0-9]+)*)\.? ", page.read_text())}


def test_citation_parser_reads_pages_and_sections():
    text = "see docs/dflash.md §1.1–1.4, and (docs/remote-stack.md §3). Also docs/scaling.md."
    assert citations(text) == [("dflash.md", ["1.1", "1.4"]), ("remote-stack.md", ["3"]), ("scaling.md", [])]
    assert citations("docs/dflash.md §1.5, §3, §5)") == [("dflash.md", ["1.5", "3", "5"])]
    assert citations("[docs/dflash.md](docs/dflash.md) and ../../docs/remote-stack.md") == [
        ("dflash.md", []), ("dflash.md", [])
    ]  # fmt: skip


def test_every_cited_docs_page_and_section_exists():
    missing = []
    for path in repo_text_files():
        for page, sections in citations(path.read_text(errors="replace")):
            target = REPO / "docs" / page
            if not target.is_file():
                missing.append(f"{path.relative_to(REPO)}: docs/{page} does not exist")
                continue
            for sec in sections:
                if sec not in headings(target):
                    missing.append(f"{path.relative_to(REPO)}: docs/{page} has no section {sec}")
    assert not missing, "\n".join(missing)


def test_nothing_cites_notes_outside_the_repository():
    bad = []
    for path in repo_text_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                bad.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    assert not bad, "cite docs/ pages instead:\n" + "\n".join(bad)


def test_the_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    unlinked = [p for p in pages if f"](docs/{p})" not in readme]
    assert not unlinked, f"README.md does not link {unlinked}"


def _readme_block_after(heading: str) -> str:
    readme = (REPO / "README.md").read_text()
    m = re.search(re.escape(heading) + r".*?```sh\n(.*?)\n```", readme, re.S)
    assert m, f"README.md has no sh block after {heading!r}"
    return m.group(1)


def test_the_readme_test_command_installs_pytest_before_it_runs_it():
    """The README's test command passes on a fresh clone after its first command (which installs only the
    `trainer` extra): it installs the `test` extra, which must hold pytest, into the same interpreter first."""
    import tomllib

    first = _readme_block_after("## The two commands")
    test_cmd = _readme_block_after("Run the tests")
    assert "'.[trainer]'" in first and "python3 -m venv .venv" in first
    install, sep, run = test_cmd.partition(" && ")
    assert sep and run == "python3 -m pytest -q -p no:cacheprovider tests"
    assert install.startswith("python3 -m pip install ") and "test" in re.search(r"'\.\[([\w,]+)\]'", install)[1].split(",")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.match(r"pytest\b(?!-)", dep) for dep in extras["test"])


def test_ci_runs_exactly_the_readme_test_command():
    """.ci/run runs the README's test command as the README prints it, on a line of its own."""
    test_cmd = _readme_block_after("Run the tests")
    assert test_cmd in (REPO / ".ci" / "run").read_text().splitlines()
