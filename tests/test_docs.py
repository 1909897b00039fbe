"""The docs a newcomer reads: README.md stays one page, README.md and docs/*.md describe what
is (no work-session chronicle; CHANGELOG.md is where history goes), and every file, figure
and heading they link exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# "session 50", "sessions 49-50", "(session", "this session", "an earlier session": the
# chronicle of who ran what when; the word alone ("a pytest session") is not
CHRONICLE = re.compile(
    r"\bsessions?\s+\d|\(sessions?\b|\b(?:this|that|earlier|previous|last|next|same|later|each|every|"
    r"another|other|one|second|first)\s+sessions?\b", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FIGURE_MENTION = re.compile(r"[\w./-]+/[\w.-]+\.png\b")


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def heading_anchors(path: Path) -> set:
    """GitHub's anchors of a markdown file's headings (lowercase, punctuation dropped,
    spaces to hyphens, repeats numbered)."""
    anchors, seen = set(), {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = re.match(r"#{1,6}\s+(.*)", line)
        if in_code or not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_readme_is_one_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_opens_with_the_install_and_run_commands():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:8])
    assert re.search(r"pip install -e '\.\[train\]' && python train\.py", head)
    assert re.search(r"pip install -e '\.\[test\]' && python -m pytest", head)


def test_the_chronicle_pattern_catches_session_logs():
    for text in ("measured in session 50", "sessions 49-50's runs", "(session 28)", "this session's CI",
                 "an earlier session measured"):
        assert CHRONICLE.search(text), text
    for text in ("one JAX compilation cache per pytest session (conftest)", "a requests.Session"):
        assert not CHRONICLE.search(text), text


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_pages_carry_no_session_chronicle(page):
    hits = [f"{page_id(page)}:{n}: {line.strip()[:120]}" for n, line in enumerate(page.read_text().splitlines(), 1)
            if CHRONICLE.search(line)]
    assert not hits, "a session chronicle (history goes to CHANGELOG.md / git):\n" + "\n".join(hits)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_linked_file_figure_and_heading_exists(page):
    text = page.read_text()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            missing.append(target)
        elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
            missing.append(f"{target} (no such heading)")
    for figure in FIGURE_MENTION.findall(text):  # figures named in text or code, not only linked
        if figure.startswith(("runs/", "/tmp/", "output_dir/")) or "<" in figure:
            continue  # made by a run
        if not ((page.parent / figure).exists() or (ROOT / figure).exists()):
            missing.append(figure)
    assert not missing, f"{page_id(page)} links what does not exist: {missing}"
