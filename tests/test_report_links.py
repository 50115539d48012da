"""Every relative link in the committed markdown (README.md, results/, docs/, experiments/) points to
a file or folder that exists, so a reader who follows the reports never lands on nothing.

Links are markdown's inline links and images, reference definitions and HTML href/src attributes,
outside code blocks and code spans; URLs with a scheme (https:, mailto:) and in-page anchors are
not checked. A link is resolved against the folder of the file it is in, without its #anchor.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("results", "docs", "experiments")

TEMPLATES = ROOT / "experiments" / "pages"
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_HTML = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)


def markdown_files() -> list[Path]:
    """The committed markdown files of README.md and the checked folders (a glob outside git), less
    the page templates of experiments/pages/: their links are relative to the page they render,
    which is checked instead."""
    try:
        listed = subprocess.run(["git", "ls-files", "--", "README.md", *(f"{d}/*.md" for d in FOLDERS)],
                                cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
        found = [ROOT / name for name in listed if (ROOT / name).exists()]
    except (OSError, subprocess.CalledProcessError):
        found = [ROOT / "README.md"] if (ROOT / "README.md").exists() else []
        found += [p for d in FOLDERS for p in sorted((ROOT / d).rglob("*.md"))]
    return [p for p in found if TEMPLATES not in p.parents]


def relative_links(text: str) -> list[str]:
    """The relative link targets in a markdown text (code blocks and code spans removed)."""
    text = _CODE.sub("", _FENCE.sub("", text))
    targets = [m.group(1) for pattern in (_INLINE, _REFERENCE, _HTML) for m in pattern.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")]


def broken_links(path: Path) -> list[str]:
    """The links in ``path`` whose target does not exist."""
    broken = []
    for target in relative_links(path.read_text(encoding="utf-8")):
        file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if file_part and not (path.parent / file_part).exists():
            broken.append(target)
    return broken


def test_the_checker_finds_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [anchor](there.md#top) [web](https://example.org/x) [in page](#y)\n"
                    "![missing](img/none.png) [gone](kernels/REPORT.md) `[code](not/a/link.md)`\n"
                    "```\n[fenced](not/a/link/either.md)\n```\n[ref]: missing/ref.csv\n<a href=\"nope.html\">n</a>\n")
    assert broken_links(page) == ["img/none.png", "kernels/REPORT.md", "missing/ref.csv", "nope.html"]


def test_every_relative_link_in_the_committed_markdown_exists():
    files = markdown_files()
    assert any(f.name == "REPORT.md" and f.parent.name == "results" for f in files), "results/REPORT.md not found"
    problems = {str(f.relative_to(ROOT)): links for f in files if (links := broken_links(f))}
    assert not problems, f"broken relative links: {problems}"
