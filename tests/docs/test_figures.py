"""One source for each figure: every results page opens with a table of its current figures
(card, date, torch, commit, command), and the README's headlines and the results index quote
those tables, so a figure that changes on its page and not where it is quoted fails here."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
COLUMNS = ["figure", "value", "card", "date", "torch", "commit", "command"]
# The index, and the page of how the recipe got where it is: history, with no current figure.
NO_TABLE = {"README.md", "time-to-loss-history.md"}
PAGES = sorted(p.name for p in RESULTS.glob("*.md") if p.name not in NO_TABLE)
LINK = re.compile(r"\[([^\]]*)\]\((?:docs/results/)?([a-z0-9-]+\.md)[^)]*\)")
BOLD = re.compile(r"\*\*(.+?)\*\*")
FIGURE = re.compile(r"\d[\d,.]*(?:–\d[\d,.]*)?(?:×|%| GiB| MB/s| s\b)")


def rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not set(line) <= set("|- ")]


def current_table(page: str) -> str:
    """The text of the page's first section, which must be its current-figures table."""
    text = (RESULTS / page).read_text()
    sections = text.split("\n## ")
    assert len(sections) > 1 and sections[1].startswith("Current figures\n"), \
        f"{page}: the first section must be '## Current figures'"
    return sections[1]


@pytest.mark.parametrize("page", PAGES)
def test_each_results_page_opens_with_its_current_figures(page):
    table = rows(current_table(page))
    assert table[0] == COLUMNS, f"{page}: columns {table[0]}"
    assert len(table) > 1, f"{page}: no figure"
    for r in table[1:]:
        assert len(r) == len(COLUMNS) and all(r), f"{page}: a row with an empty cell: {r}"


def quoted(cell: str, default_page: str | None):
    """(figure, page) for every bold figure of a cell, each with the page its link names."""
    for text, page in LINK.findall(cell):
        for bold in BOLD.findall(text):
            yield bold, page
    if default_page:
        for bold in BOLD.findall(LINK.sub("", cell)):
            yield bold, default_page


def test_the_readme_headlines_are_the_pages_current_figures():
    readme = (ROOT / "README.md").read_text()
    headlines = readme[readme.index("| what | figure | card | date |"):]
    headlines = headlines[:headlines.index("\n\n")]
    seen = []
    for r in rows(headlines)[1:]:
        links = LINK.findall(r[1])
        for figure, page in quoted(r[1], links[0][1] if links else None):
            if page in NO_TABLE:
                continue
            seen.append(figure)
            assert figure in current_table(page), f"README quotes {figure!r}; {page}'s current figures do not hold it"
    assert len(seen) > 10


def test_the_readme_opening_quotes_the_demo_page_and_leaves_the_test_count_to_testing_md():
    readme = (ROOT / "README.md").read_text()
    opening = readme[:readme.index("## ")]
    demo = [b for b in BOLD.findall(opening)]
    assert demo and all(b in current_table("time-to-loss-cpu.md") for b in demo), demo
    assert "passed" not in opening, "the test count lives in docs/testing.md only"
    assert re.search(r"\d[\d,]* passed", (ROOT / "docs" / "testing.md").read_text())


def test_the_index_headlines_are_the_pages_current_figures():
    index = (RESULTS / "README.md").read_text()
    checked = 0
    for r in rows(index)[1:]:
        (_, page), = LINK.findall(r[0])
        if page in NO_TABLE:
            continue
        for figure in FIGURE.findall(r[2]):
            checked += 1
            assert figure in current_table(page), f"the index quotes {figure!r}; {page}'s current figures do not hold it"
    assert checked > 10
