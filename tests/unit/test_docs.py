"""What README.md and docs/*.md say that the code knows: the counts they state (published rows,
topology files) match the repository, and every link to a section of a doc names a heading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ROWS = yaml.safe_load((REPO / "benchmarks" / "published" / "results.yaml").read_text())["rows"]

CHECK_ROWS = sum(r["split"] == "check" for r in ROWS)
# what the docs say (a phrase, group 1 the number) and the number the repository holds
COUNTS = [
    ("published rows", r"(\d+) published (?:GPU )?(?:runs|rows)", len(ROWS)),
    ("rows never fitted on", r"(\d+) (?:of them )?never fitted on", CHECK_ROWS),
    ("check rows", r"(\d+) `check` rows", CHECK_ROWS),
    ("fit rows", r"(\d+) `fit` rows", sum(r["split"] == "fit" for r in ROWS)),
    ("topology files", r"(\d+) machines and clusters", len(list((REPO / "topologies").glob("*.yaml")))),
]


@pytest.mark.parametrize("phrase, count", [c[1:] for c in COUNTS], ids=[c[0] for c in COUNTS])
def test_each_count_the_docs_state_is_the_repositorys(phrase: str, count: int):
    # a phrase may wrap across lines: the docs are read with their whitespace collapsed
    found = [(str(doc.relative_to(REPO)), int(m.group(1)))
             for doc in DOCS for m in re.finditer(phrase, " ".join(doc.read_text().split()))]
    assert found, f"no doc says {phrase!r} any more: drop it from COUNTS"
    assert [(doc, n) for doc, n in found if n != count] == [], f"the repository has {count}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)  # a `# comment` in code is no heading
    return {_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_every_link_to_a_section_names_a_heading():
    broken = []
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?#([\w-]+)\)", doc.read_text()):
            linked = (doc.parent / target).resolve() if target else doc
            if anchor not in _anchors(linked):
                broken.append(f"{doc.relative_to(REPO)}: {target}#{anchor}")
    assert broken == []
