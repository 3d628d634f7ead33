"""Comments stay short: measurements live in docs/design/, and pointers there resolve.

The rules, checked over every module of ``src/kvtier``:

* A *block* is a docstring (module, class or function) or a run of comment lines on
  consecutive source lines. A *figure* is a number with a time or rate unit (``12 ms``,
  ``0.4 s``, ``5 us``, ``2.6 GB/s``), a speed-up (``3x faster``), or the word ``measured``.
  A block of more than ``SHORT_BLOCK_LINES`` (3) lines may hold at most
  ``MAX_FIGURES_LONG`` (1) figure — one order of magnitude in a contract ("blocks for
  ~0.1-0.5 s") is fine, a measurement report is not; a shorter block at most
  ``MAX_FIGURES_SHORT`` (2). Before issue #24 the disk, worker and secret modules' docstrings
  held 2 to 8 figures each.
* No comment or docstring cites ``DESIGN.md`` or ``MACHINE.md`` (neither is in the repository),
  a "DESIGN section", or a section of the README (a landing page now: reference is in docs/).
* Every ``docs/<page>.md`` or ``docs/<page>.md#<anchor>`` named in the code is a page in
  ``docs/``, and the anchor is one of its headings.
"""

import ast
import io
import re
import tokenize
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "kvtier"
DOCS = ROOT / "docs"

SHORT_BLOCK_LINES = 3
MAX_FIGURES_LONG = 1
MAX_FIGURES_SHORT = 2

FIGURE = re.compile(
    r"\d(?:[\d.,]*\d)?\s*(?:GB/s|MB/s|GiB/s|MiB/s|ms|µs|us|ns|s)\b(?![-/])"
    r"|\d(?:\.\d+)?\s*x (?:faster|slower)"
    r"|\bmeasured\b"
    r"|\bwe tried\b",
    re.IGNORECASE,
)
STALE_CITATION = re.compile(r"\b(?:DESIGN|MACHINE)\.md\b|\bDESIGN section\b|\bREADME,? [\"']")
DOCS_POINTER = re.compile(r"\bdocs/([\w/.-]+?\.md)(?:#([\w-]+))?")


def blocks(source: str) -> list[tuple[int, list[str]]]:
    """(first line, lines) of each docstring and each run of consecutive comment lines."""
    found: list[tuple[int, list[str]]] = []
    run: list[str] = []
    start = last = -2
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        if run and line == last + 1:
            run.append(token.string)
        else:
            if run:
                found.append((start, run))
            run, start = [token.string], line
        last = line
    if run:
        found.append((start, run))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc.splitlines()))
    return sorted(found)


def figures(lines: list[str]) -> list[str]:
    return FIGURE.findall("\n".join(lines))


def slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[`*_]", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


MODULES = sorted(SRC.rglob("*.py"))


def test_the_rules_catch_what_they_are_for():
    """The checks below are only worth having if they fail on the comments they replaced."""
    report = """Why payloads live in a slab (measured on the reference machine):
LMDB put reaches 1.07-1.16 GB/s, writemap 0.08 GB/s,
and the slab 2.6 GB/s; reads ~1.95 GB/s.
So LMDB keeps the index."""
    lines = report.splitlines()
    assert len(lines) > SHORT_BLOCK_LINES and len(figures(lines)) > MAX_FIGURES_LONG
    assert figures(["# an fdatasync costs ~0.2 ms here, ~6 ms per job, 3x faster"]) == [
        "0.2 ms",
        "6 ms",
        "3x faster",
    ]
    assert figures(["# capacity of 64 GiB in 2 MiB rows, 16 threads, 4096-byte pages"]) == []
    for citation in ("(see DESIGN.md §4)", "(DESIGN section 2)", '(README, "The cascade")'):
        assert STALE_CITATION.search(citation), citation
    assert blocks("# a\n# b\nx = 1  # c\n\n# d\n") == [(1, ["# a", "# b", "# c"]), (5, ["# d"])]
    assert slug("Where the `files` tier's write time went") == "where-the-files-tiers-write-time-went"
    assert slug("Sixteen I/O threads") == "sixteen-io-threads"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_comments_hold_no_measurement_reports(path):
    too_many = []
    for line, lines in blocks(path.read_text()):
        found = figures(lines)
        limit = MAX_FIGURES_LONG if len(lines) > SHORT_BLOCK_LINES else MAX_FIGURES_SHORT
        if len(found) > limit:
            too_many.append(f"line {line}: {len(lines)} lines, figures {found}")
    assert not too_many, (
        f"{path.relative_to(ROOT)} keeps measurements in comments; move them to a page in "
        "docs/design/ (with the command and date) and leave a one-line pointer:\n" + "\n".join(too_many)
    )


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_comments_cite_only_docs_that_exist(path):
    text = path.read_text()
    missing = [m.group(0) for m in STALE_CITATION.finditer(text)]
    assert not missing, f"{path.relative_to(ROOT)} cites {missing}, not in the repository; point to docs/"
    broken = []
    for m in DOCS_POINTER.finditer(text):
        page = DOCS / m.group(1)
        if not page.is_file():
            broken.append(f"{m.group(0)}: no such page")
        elif m.group(2) and m.group(2) not in anchors(page):
            broken.append(f"{m.group(0)}: no heading with that anchor in {page.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)
