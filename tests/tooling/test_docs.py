"""The docs hold together: README links every page of docs/, and every relative link in the
README, CONTRIBUTING.md and docs/ names a file that exists and, with an anchor, a heading of it
(GitHub's anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.DOTALL | re.MULTILINE)


@functools.cache  # a page is read once, however many links name it
def anchors(page: Path) -> frozenset[str]:
    """The anchors GitHub gives the headings of ``page``."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_the_readme_links_every_page_of_docs():
    linked = {(ROOT / target.split("#")[0]).resolve() for target in links(ROOT / "README.md")
              if not target.startswith(("http://", "https://", "#"))}
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert unlinked == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(page):
    broken = []
    for target in links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no such heading")
    assert broken == []


def test_a_broken_anchor_is_found(tmp_path):
    """The check can fail: a link to a heading that is not there."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A `code` heading, with punctuation!\n\n## Title\n")
    assert anchors(page) == {"title", "a-code-heading-with-punctuation", "title-1"}
    assert "a-missing-heading" not in anchors(page)
