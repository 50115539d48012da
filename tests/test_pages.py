"""The pages that quote measured numbers are their render from the committed results: README.md,
docs/*.md (templates in experiments/pages/) and results/REPORT.md (from the studies' headline rows
and keys). A page edited by hand, or left behind by a change to its results or to a study's code,
fails here; `python -m experiments.pages` renders them again."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from experiments import pages
from experiments.provenance import ROOT



@pytest.fixture(scope="module")
def keys():
    return pages.current_keys(ROOT / "results")


def test_committed_pages_are_their_render(keys):
    assert pages.differing(keys=keys) == [], "run `python -m experiments.pages` and commit what it writes"


def _copy_pages(tmp: Path) -> Path:
    for path in [*pages.templates(), "results/REPORT.md"]:
        (tmp / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp / path)
    return tmp


@pytest.mark.parametrize("page, number", [("docs/stage3.md", r"\d{1,3}(,\d{3})+"),
                                          ("results/REPORT.md", r"\d+/\d+ within 1 GB")])
def test_a_number_edited_by_hand_is_caught(tmp_path, keys, page, number):
    root = _copy_pages(tmp_path)
    assert pages.differing(ROOT / "results", root, keys) == []
    text = (root / page).read_text()
    match = re.search(number, text)
    assert match, f"{page} quotes no number like {number}"
    (root / page).write_text(text[:match.start()] + "7" + text[match.start() + 1:])
    assert pages.differing(ROOT / "results", root, keys) == [page]


def test_templates_type_no_measured_number():
    """Outside `{{ ... }}`, no template holds a number with thousands separators or a decimal
    percentage: such numbers are measurements and come from results/."""
    measured = re.compile(r"\b\d{1,3}(,\d{3})+\b|\b\d+\.\d+ ?%")
    for path in pages.templates():
        prose = re.sub(r"\{\{.*?\}\}", "", (pages.TEMPLATES / path).read_text(), flags=re.S)
        assert not measured.search(prose), (path, measured.search(prose).group())


def test_a_template_naming_a_missing_value_fails(tmp_path, monkeypatch):
    (tmp_path / "page.md").write_text("{{ wt.no_such_value }}\n")
    monkeypatch.setattr(pages, "TEMPLATES", tmp_path)
    with pytest.raises(Exception, match="no_such_value"):
        pages.rendered(ROOT / "results")
