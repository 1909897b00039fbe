"""docs/RELIABILITY.md is exactly the rendering of the rows attached to this suite's tests,
so the table cannot drift from what CI checks."""

from reliability_table import APPENDED, CATEGORIES, DOC, collect_rows, render


def test_reliability_doc_matches_suite():
    entries = collect_rows()
    assert entries, "no @covers rows found in tests/reliability"
    expected = render(entries)
    actual = DOC.read_text().split(APPENDED)[0] if DOC.exists() else "<missing>"
    assert actual == expected, (
        f"{DOC} is stale: run `python tests/reliability/reliability_table.py --write`"
    )


def test_every_row_names_a_test_and_a_known_category():
    for entry in collect_rows():
        assert entry.row.category in CATEGORIES
        assert entry.row.fault and entry.row.behaviour and entry.row.evidence, entry.test
