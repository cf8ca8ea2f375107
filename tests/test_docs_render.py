"""Every table in the built docs renders as written: a header row, and no empty cell
(a continuation line of a simple table renders as a row of its own with empty cells,
and a header with an empty first cell loses which column is which, while
``sphinx-build -W`` passes; a cell with nothing to say holds "-").

The HTML is parsed, not the sources: what is checked is what a reader sees. The docs
tox environment passes its build in ``OVERLAPKIT_DOCS_HTML``; elsewhere the test builds
the docs itself when Sphinx is installed, and is skipped when it is not.
"""

from __future__ import annotations

import html
import os
from html.parser import HTMLParser
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
GENERATED = {"genindex.html", "search.html", "py-modindex.html"}  # Sphinx's own pages


class _Tables(HTMLParser):
    """Collects each ``<table>``: its header rows and body rows, as cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[dict[str, list[list[str]]]] = []
        self._section = "body"
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.tables.append({"head": [], "body": []})
        elif tag == "thead":
            self._section = "head"
        elif tag == "tbody":
            self._section = "body"
        elif tag == "tr" and self.tables:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._row is not None and self._cell is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[-1][self._section].append(self._row)
            self._row = None
        elif tag == "thead":
            self._section = "body"

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def html_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("OVERLAPKIT_DOCS_HTML")
    if given:
        assert (Path(given) / "index.html").is_file(), f"no built docs in {given}"
        return Path(given)
    elsewhere = "Sphinx is not installed here; tox's checks and docs environments run this"
    pytest.importorskip("sphinx", reason=elsewhere)
    pytest.importorskip("myst_parser", reason=elsewhere)
    from sphinx.cmd.build import build_main

    out = tmp_path_factory.mktemp("html")
    assert build_main(["-W", "-q", "-b", "html", str(DOCS), str(out)]) == 0
    return out


def _pages(html_dir: Path) -> list[Path]:
    return sorted(p for p in html_dir.glob("*.html") if p.name not in GENERATED)


def test_every_page_is_built(html_dir: Path) -> None:
    sources = {p.stem for p in DOCS.iterdir() if p.suffix in (".rst", ".md")}
    assert sources <= {p.stem for p in _pages(html_dir)}


def test_every_table_has_a_header_and_no_empty_cell(html_dir: Path) -> None:
    problems = []
    for page in _pages(html_dir):
        parser = _Tables()
        parser.feed(page.read_text(encoding="utf-8"))
        for number, table in enumerate(parser.tables, 1):
            where = f"{page.name} table {number}"
            head = table["head"]
            if not head or not all(cell for cell in head[0]):
                problems.append(f"{where}: no header row, or an empty header cell: {head}")
            for row in table["body"]:
                if not row or not all(row):
                    problems.append(f"{where}: a row with an empty cell: {row}")
    assert problems == []


def test_the_footer_names_the_authors(html_dir: Path) -> None:
    page = html.unescape((html_dir / "index.html").read_text(encoding="utf-8"))
    footer = " ".join(page.split('class="footer"')[1].split())
    assert "©." not in footer and "©2026, overlapkit maintainers." in footer
