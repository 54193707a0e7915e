"""The links between README.md and the pages of docs/ resolve: every relative link (and image) names a
file that exists, and every #anchor a heading of its page; each long page's table of contents names
every section. The checker itself is shown to fail on planted broken links."""

from __future__ import annotations

import re

from tests.docs_pages import ROOT, anchors, broken_links, headings, pages, read, slug, without_code


def test_links_between_pages_resolve():
    bad = [problem for page in pages() for problem in broken_links(ROOT / page)]
    assert not bad, "\n".join(bad)


def test_the_pages_link_to_each_other():
    """The README's map names every page of docs/, and every page is reached from it."""
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", without_code(read("README.md"))))
    assert linked == set(pages()) - {"README.md"}, sorted(set(pages()) - {"README.md"} - linked)


def test_long_pages_list_every_section_in_their_contents():
    """A page of docs/ longer than 40 lines opens with a table of contents: links to each of its `##`
    sections, before the first of them."""
    for page in pages():
        text = read(page)
        if page == "README.md" or len(text.splitlines()) <= 40:
            continue
        sections = [(pos, title) for pos, level, title in headings(text) if level == 2]
        assert sections, page
        contents = text[:sections[0][0]]
        listed = set(re.findall(r"\]\(#([^)]+)\)", contents))
        missing = [title for _, title in sections if slug(title) not in listed]
        assert not missing, f"{page}: its contents lack {missing}"


def test_anchors_are_githubs():
    assert slug("Exit codes, `lmforge launch`, and slow or stuck ranks") == \
        "exit-codes-lmforge-launch-and-slow-or-stuck-ranks"
    assert slug("Tensor, pipeline, context, expert, 2-D/3-D, async SGD") == "tensor-pipeline-context-expert-2-d3-d-async-sgd"
    assert slug("Certifying a layout on the CPU: `--verify`") == "certifying-a-layout-on-the-cpu---verify"
    assert slug("Continue pre-training a Qwen2.5-style model on your own text") == \
        "continue-pre-training-a-qwen25-style-model-on-your-own-text"
    assert slug("μP learning-rate transfer across widths (CPU)") == "μp-learning-rate-transfer-across-widths-cpu"
    assert anchors("# A\n## B\n## B\n```bash\n# not a heading\n```\n") == {"a", "b", "b-1"}


def test_broken_links_are_caught(tmp_path):
    """Planted: a missing page, a missing anchor on another page, a missing anchor on this page, a
    missing picture, an anchor into a file that is not markdown. Each is reported; the good links,
    and link-like text inside code, are not."""
    (tmp_path / "other.md").write_text("# Other\n\n## A section, with `code`\n")
    (tmp_path / "pic.png").write_bytes(b"\x89PNG")
    page = tmp_path / "page.md"
    good = ("# Page\n\n## Here\n\n[ok](other.md) [ok](other.md#a-section-with-code) [ok](#here) ![p](pic.png) "
            "[web](https://example.com/x.md#nowhere)\n\n`[in code](nowhere.md)`\n\n```bash\n"
            "echo '[in a block](nowhere.md)'\n```\n")
    assert broken_links(page, good) == []
    planted = ["[gone](missing.md)", "[bad anchor](other.md#no-such-section)", "[bad local](#nowhere)",
               "![gone](missing.png)", "[not markdown](pic.png#top)"]
    bad = broken_links(page, good + "\n" + "\n".join(planted) + "\n")
    assert len(bad) == len(planted), bad
    for link, problem in zip(planted, bad):
        assert link[link.index("(") + 1:-1] in problem, (link, problem)
