"""Docstrings, comments, config headers and the docs say what IS: what the code does and why
it is built so. How it came to be (work sessions, issue numbers, review rounds, dates, "used
to") belongs in CHANGELOG.md and git; measurements belong in docs/PERFORMANCE.md and
docs/RESULTS.md, with their hardware, and nowhere else.

Scanned: the comments and docstrings of the Python sources (spopp_jax, rollout_bridge,
train.py, benchmarks, scripts, tests), the comments of configs/*.yaml, README.md and
docs/*.md (CHANGELOG.md and the raw records under docs/results/ are history by design)."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from test_docs import CHRONICLE as SESSION

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
PY_SOURCES = sorted(
    [ROOT / "train.py"]
    + [p for d in ("spopp_jax", "rollout_bridge", "benchmarks", "scripts", "tests") for p in (ROOT / d).rglob("*.py")])
# test_docs.py and this file hold the markers as their own test data
PY_SOURCES = [p for p in PY_SOURCES if p not in (THIS, ROOT / "tests" / "test_docs.py")]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# pages whose measurements carry the date they were taken, beside the hardware
DATED_PAGES = {"README.md", "docs/RESULTS.md", "docs/PERFORMANCE.md"}

# our own tracker's numbers; another project's cited pull request ("verl PR #906") is a reference
ISSUE = re.compile(r"\bissues?\s+#?\d+|\(#\d+\b", re.IGNORECASE)
ROUND = re.compile(r"\b(?:review|fix|audit|work)\s+rounds?\s+\d|\bround\s+\d+\s+(?:of\s+)?(?:review|fixes)\b",
                   re.IGNORECASE)
# an ISO date in prose; a date inside a path or a file name (docs/results/2026-12-05_x) is a name
DATE = re.compile(r"(?<![\w/.-])20\d\d-[01]\d-[0-3]\d(?![\w/-])")
# "X used to load as ..." is history; "is used to size", "Used to size" (= it is used to) are not
USED_TO = re.compile(r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bbeing )(?<!\bwas )(?<!\bwere )"
                     r"(?<![,;:(] )(?<!^)\bused to\b")
THEN_AND_NOW = re.compile(r"\bpreviously\b|\bbefore\s+(?:this|the)\s+(?:change|fix|branch|commit|redesign|rewrite)\b"
                          r"|\buntil\s+(?:now|recently)\b|\bthe\s+default\s+until\b"
                          r"|\b(?:this|that|the\s+previous|an\s+earlier)\s+(?:branch|PR|pull\s+request)\b", re.IGNORECASE)
# a measured time or ratio: "562 s", "97 µs", "135 -> 97 µs", "~13x slower"
TIMING = re.compile(r"\b\d[\d,]*(?:\.\d+)?\s?(?:s|ms|µs|us|min|tok/s)(?![\w/])")
MEASURE_WORD = re.compile(r"\bmeasured\b|\bmedian\b|\bload(?: average)?\s+[\d~]|\bper-round\b", re.IGNORECASE)
# a run log: "Measured 2026-12-01 (seed 0, ...): ...", "Measured on the shared 2-core box ..."
RUN_LOG = re.compile(r"\bMeasured\s+(?:\d|\(|on\b|in\b)")
SPEEDUP = re.compile(r"~?\b\d+(?:\.\d+)?x\s+(?:slower|faster)\b|\d\s?(?:s|ms|µs|us)?\s*(?:->|→)\s*\d[\d,.]*\s?(?:s|ms|µs|us)\b", re.IGNORECASE)


def chronicle_markers(text: str, dates: bool = True) -> list:
    """The history markers in one line of prose: which pattern matched, and what."""
    found = []
    for name, pattern in (("session", SESSION), ("issue", ISSUE), ("round", ROUND), ("date", DATE),
                          ("used to", USED_TO), ("then-and-now", THEN_AND_NOW)):
        if name == "date" and not dates:
            continue
        match = pattern.search(text)
        if match:
            found.append(f"{name} {match.group(0)!r}")
    return found


def measurement_markers(paragraph: str) -> list:
    """A measured time in a paragraph that should describe, not report: a timing beside
    "measured" / "median" / a load average, or a before -> after speed-up."""
    found = []
    for sentence in re.split(r"(?<=\.)\s+(?=[A-Z(*`])", paragraph):
        timing, word = TIMING.search(sentence), MEASURE_WORD.search(sentence)
        if timing and word:
            found.append(f"measurement {timing.group(0)!r} ({word.group(0)!r})")
    if RUN_LOG.search(paragraph):
        found.append(f"run log {RUN_LOG.search(paragraph).group(0)!r}")
    if SPEEDUP.search(paragraph):
        found.append(f"speed-up {SPEEDUP.search(paragraph).group(0)!r}")
    return found


def python_prose(path: Path):
    """(line, text, is_module_docstring) for each comment line and docstring line of a file."""
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    owners = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for owner in owners:
        body = owner.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node = body[0]  # the raw lines: a backslash-newline inside the string joins lines of the value
            for n in range(node.lineno, node.end_lineno + 1):
                yield n, lines[n - 1], owner is tree
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string, False


def yaml_comments(path: Path):
    """(line, comment text, in_header) for each comment of a config; the header is the
    comment block above the first key."""
    in_header = True
    for n, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            in_header = False
        if "#" in line:
            yield n, line[line.index("#"):], in_header and stripped.startswith("#")


def paragraphs(lines):
    """Group (line, text) pairs into blank-line-separated paragraphs: (first line, joined text)."""
    block = []
    for n, text in lines:
        if text.strip(" #"):
            block.append((n, text))
        elif block:
            yield block[0][0], " ".join(t.strip(" #") for _, t in block)
            block = []
    if block:
        yield block[0][0], " ".join(t.strip(" #") for _, t in block)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def python_hits(path: Path) -> list:
    hits, module_doc = [], []
    for n, text, in_module_doc in python_prose(path):
        hits += [f"{rel(path)}:{n}: {m}" for m in chronicle_markers(text)]
        if in_module_doc:
            module_doc.append((n, text))
    for n, text in paragraphs(module_doc):
        hits += [f"{rel(path)}:{n}: {m} (module docstring)" for m in measurement_markers(text)]
    return hits


def config_hits(path: Path) -> list:
    hits, header = [], []
    for n, text, in_header in yaml_comments(path):
        hits += [f"{rel(path)}:{n}: {m}" for m in chronicle_markers(text)]
        if in_header:
            header.append((n, text))
    for n, text in paragraphs(header):
        hits += [f"{rel(path)}:{n}: {m} (config header)" for m in measurement_markers(text)]
    return hits


def page_hits(path: Path) -> list:
    dates = rel(path) not in DATED_PAGES
    return [f"{rel(path)}:{n}: {m}" for n, line in enumerate(path.read_text().splitlines(), 1)
            for m in chronicle_markers(line, dates=dates)]


def test_the_markers_catch_history_and_spare_descriptions():
    for text in ("Math-TIR (issue #14, SPEC 6)", "(#15)", "issue 16's comparison", "the default job until 2026-12-01",
                 "observed 2026-12-02", "a null answer used to load as the string", "previously the step",
                 "the path before this change", "(session 50)", "review round 2",
                 "10m, BEFORE this branch"):
        assert chronicle_markers(text), text
    for text in ("Used to size the recipes' micro-batches", "it is used to size", "docs/results/2026-12-05_matched/",
                 "SPEC 6", "one aiohttp session per server", "--rounds 3", "round 2 is busy (the benchmark's rounds)",
                 "one JAX compilation cache per pytest session",
                 "a mean of per-micro-batch means (verl PR #906)"):
        assert not chronicle_markers(text), text
    assert measurement_markers("measured on 2 cores: 562 s, 577 s and 589 s")
    assert measurement_markers("decode at context 4096 was ~13x slower")
    assert measurement_markers("135 -> 97 µs per call")
    assert measurement_markers("Measured 2026-12-01 (seed 0): held-out success 0.102")
    assert not measurement_markers("a 30 s timeout per call; the step runs at most 120 s")
    assert not measurement_markers("A ~50 ms computation. Printed: the median per system.")
    assert not measurement_markers("2e-5 absolute (float32; measured ~3e-7 on the tiny model)")


@pytest.mark.parametrize("path", PY_SOURCES, ids=rel)
def test_python_comments_and_docstrings_carry_no_chronicle(path):
    hits = python_hits(path)
    assert not hits, "history goes to CHANGELOG.md / git, numbers to docs/PERFORMANCE.md / RESULTS.md:\n" + "\n".join(hits)


@pytest.mark.parametrize("path", CONFIGS, ids=rel)
def test_config_comments_carry_no_chronicle_or_run_log(path):
    hits = config_hits(path)
    assert not hits, "a config header says what the recipe trains, not its run log:\n" + "\n".join(hits)


@pytest.mark.parametrize("path", PAGES, ids=rel)
def test_pages_carry_no_chronicle(path):
    hits = page_hits(path)
    assert not hits, "history goes to CHANGELOG.md / git:\n" + "\n".join(hits)
