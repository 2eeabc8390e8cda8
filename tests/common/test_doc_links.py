"""Every link from README.md, docs/*.md and heads/*/README.md to a file of this repository
exists, and every #anchor names a heading of its page (GitHub's anchor rules), so a page
renamed or a heading reworded cannot leave dead links behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("heads/*/README.md"))]


def _prose(path: Path):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, links and emphasis reduced to their text,
    punctuation other than - and _ dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", re.sub(r"[`*]", "", heading.strip().lower()))
    return "".join(ch for ch in text if ch.isalnum() or ch in "-_ ").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose(path):
        match = HEADING.match(line)
        if match:
            name = slug(match.group(2))
            out.add(name if name not in seen else f"{name}-{seen[name]}")
            seen[name] = seen.get(name, 0) + 1
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for number, line in _prose(page):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue  # a web address or mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such heading)")
    return broken


@pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="needs the source checkout's docs/")
def test_every_local_link_and_anchor_resolves():
    broken = [b for page in _pages() for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_anchor_rule_matches_githubs():
    assert slug("Stage tree: tree verification (`\"stage\": \"tree\"`)") == "stage-tree-tree-verification-stage-tree"
    assert slug("Head weights: int8 and int4") == "head-weights-int8-and-int4"
