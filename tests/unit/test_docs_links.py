"""A figure cited from the benchmark pages names a section that is there: every
`docs/benchmarks.md, "TITLE"` (and `docs/benchmarks-history.md, "TITLE"`) in the docs, the code's
comments and docstrings is a heading of that page, so a renamed section cannot leave a reader
looking for it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("docs/benchmarks.md", "docs/benchmarks-history.md")
CITATION = re.compile(r"(docs/benchmarks(?:-history)?\.md),? \"([^\"]+)\"")


def _headings(page: str) -> set[str]:
    lines = (ROOT / page).read_text().splitlines()
    return {
        " ".join(line.lstrip("#").split()) for line in lines if line.startswith(("## ", "### "))
    }


def citations(text: str) -> list[tuple[str, str]]:
    """(page, title) of each citation; a title may wrap across lines of a comment."""
    text = re.sub(r"\n[ \t]*#+[ \t]?", "\n", text)  # a comment's continuation lines
    return [(m[1], m[2].rstrip(",.")) for m in CITATION.finditer(" ".join(text.split()))]


def _sources() -> list[Path]:
    """The project's Markdown, Python and YAML files (not the virtualenv or build output)."""
    skip = {"build", "dist", "node_modules"}
    return [
        p
        for p in ROOT.rglob("*")
        if p.suffix in (".md", ".py", ".yaml")
        and not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts)
        and "egg-info" not in str(p)
        and p.is_file()
        and p.name != "test_docs_links.py"  # its own examples
    ]


def test_every_cited_benchmark_section_exists():
    headings = {page: _headings(page) for page in PAGES}
    found, missing = 0, []
    for path in _sources():
        for page, title in citations(path.read_text()):
            found += 1
            if title not in headings[page]:
                missing.append(f"{path.relative_to(ROOT)}: {page}, {title!r}")
    assert found >= 30  # the docs and the code cite them this much today
    assert not missing, "no such section:\n" + "\n".join(missing)


def test_the_check_reads_a_wrapped_citation():
    text = '# measured (docs/benchmarks.md, "The engine\n    # alone: engine.py").'
    assert citations(text) == [("docs/benchmarks.md", "The engine alone: engine.py")]
