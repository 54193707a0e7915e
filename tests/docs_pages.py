"""The documentation's pages, and what tests read out of them: bash blocks under their headings, the
headings' anchors, and the links between pages.

README.md and every page of docs/ are listed in PAGES, in the order tests/test_readme_commands.py runs
their commands (a later page may use what an earlier one made: the README's `runs/tiny`, for one).
A page not listed fails `pages()`, so a new page cannot escape the command and link tests.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/training.md", "docs/planning.md", "docs/parallel.md", "docs/checkpoints.md",
         "docs/evaluation.md", "docs/operations.md", "docs/data.md", "docs/gpu.md", "docs/tests.md",
         "docs/code.md")

FENCE = re.compile(r"^( *)```[^\n]*\n.*?\n\1```", flags=re.S | re.M)  # a fenced block (indented in a list item too)
BASH = re.compile(r"^( *)```bash\n(.*?)\n\1```", flags=re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def pages() -> list[str]:
    """PAGES, checked against the files: README.md and every docs/*.md, none left out."""
    found = {"README.md"} | {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert found == set(PAGES), f"tests/docs_pages.py PAGES lacks {sorted(found - set(PAGES))} " \
                                f"or names missing pages {sorted(set(PAGES) - found)}"
    return list(PAGES)


def read(page: str) -> str:
    return (ROOT / page).read_text()


def without_code(text: str) -> str:
    """The text with every fenced block blanked (same length, so positions stay) and inline code
    removed from lines: a `# comment` in a bash block is no heading, a `[x](y)` in code no link."""
    text = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), text)


def headings(text: str) -> list[tuple[int, int, str]]:
    """(position, level, title) of every markdown heading outside code blocks. The title keeps its
    inline code (an anchor is made from it), so it is read from the text itself."""
    blank = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return [(m.start(), len(m.group(1)), text[m.start(2):m.end(2)].strip())
            for m in re.finditer(r"^(#{1,6}) +(.*)$", blank, flags=re.M)]


def slug(title: str) -> str:
    """GitHub's anchor of a heading: its text without markup, lower case, punctuation dropped, spaces
    to hyphens ("Exit codes, `lmforge launch`, ..." -> "exit-codes-lmforge-launch-...")."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link's text
    title = title.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, _, title in headings(text):
        base = slug(title)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """Every relative link of the markdown file `path` (its `text`, if given) whose file does not
    exist, or whose #anchor is no heading of that page (or of this one, for a bare #anchor)."""
    text = path.read_text() if text is None else text
    bad = []
    for m in LINK.finditer(without_code(text)):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not between pages
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path  # a bare #anchor: this page
        if file and not dest.exists():
            bad.append(f"{path.name}: {target}: no file {dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text() if file else text)):
            bad.append(f"{path.name}: {target}: no heading with the anchor #{anchor} in {dest.name}")
    return bad


def bash_blocks(page: str) -> list[tuple[str, str]]:
    """(heading, body) of every bash block of a page, in order: the heading is the last one above the
    block (outside code), the body dedented (a block inside a list item is indented)."""
    text = read(page)
    heads = headings(text)
    out = []
    for m in BASH.finditer(text):
        above = [title for pos, _, title in heads if pos < m.start()]
        out.append((above[-1] if above else "", textwrap.dedent(m.group(2))))
    return out
