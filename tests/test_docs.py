"""Every ```python block in README.md and docs/*.md runs, file by file, on 2 gloo ranks.

The blocks of one file share a namespace and run in order, as the code each rank of a
``torchrun --nproc-per-node 2`` job would run. A failure names the file and line.
"""

import pathlib
import re

import pytest

from tests.ranks import RankError

ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS = [p for p in PAGES if FENCE.search(p.read_text())]


def snippets(text: str) -> list:
    """(first line number, code) of each ```python block."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def run_snippets(path: str) -> int:
    text = pathlib.Path(path).read_text()
    namespace = {"__name__": "__main__"}
    for line, code in snippets(text):
        exec(compile("\n" * (line - 1) + code, path, "exec"), namespace)
    return len(snippets(text))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_snippet_runs(ranks2, path):
    ranks2.run(run_snippets, str(path))


def test_the_readme_and_the_guides_have_snippets_to_run():
    # Pages made of measured tables alone (performance.md) have none.
    assert {p.name for p in PAGES} - {p.name for p in DOCS} <= {"performance.md"}


def test_a_broken_snippet_fails_and_names_its_line(ranks2, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```python\nx = 1\n```\n\ntext\n\n```python\nassert x == 2\n```\n")
    with pytest.raises(RankError, match=r'page.md", line 10'):
        ranks2.run(run_snippets, str(page))
