"""The README stays short and every relative link in it and in docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target) with a target that is not a URL or a pure anchor
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The link targets of a Markdown text that point into the repository."""
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:|^#", t)]


def test_relative_links_are_found() -> None:
    text = "see [a](docs/a.md), [b](https://x.org), [c](#top) and [d](../x.py#L3)"
    assert relative_links(text) == ["docs/a.md", "../x.py#L3"]


def test_readme_is_at_most_10_kib() -> None:
    size = (REPO / "README.md").stat().st_size
    assert size <= 10 * 1024, f"README.md is {size} bytes; move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page: Path) -> None:
    missing = []
    for target in relative_links(page.read_text()):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(REPO)}: links to nothing: {missing}"
