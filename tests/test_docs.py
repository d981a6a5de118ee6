"""The documentation: README.md and docs/**/*.md link only to files of this repository.

Every relative Markdown link (inline, image or reference definition) outside code must
name an existing file or directory inside the repository; a `#anchor` on a Markdown
target must be one of that file's headings (GitHub's slugs). README.md stays short
(≤ 200 lines) and no page refers to files outside the repository (`shared/...`).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); text may hold one level of brackets.
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, …


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; inline code spans blanked if asked."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, _CODE_SPAN.sub("", line) if blank_code else line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (repeated headings get -1, -2, …)."""
    seen: Counter[str] = Counter()
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8"), blank_code=False):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in the file's prose."""
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        found += [(number, m.group(1)) for m in _INLINE.finditer(line)]
        ref = _REFERENCE.match(line)
        if ref:
            found.append((number, ref.group(1)))
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: target (reason)' for each relative link that does not resolve."""
    problems = []
    for number, target in links(path):
        if _EXTERNAL.match(target):
            continue
        where = f"{path.relative_to(root)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.is_relative_to(root):
            problems.append(f"{where} (outside the repository)")
        elif not dest.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where} (no heading with anchor #{anchor})")
    return problems


def test_every_relative_link_resolves_inside_the_repository():
    problems = [p for path in doc_files() for p in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_reachable_from_readme_or_the_index():
    linked = {
        (path.parent / t.partition("#")[0]).resolve()
        for path in doc_files()
        for _, t in links(path)
        if not _EXTERNAL.match(t) and t.partition("#")[0]
    }
    orphans = [str(p.relative_to(ROOT)) for p in doc_files()[1:] if p.resolve() not in linked]
    assert not orphans, f"pages no other page links to: {orphans}"


def test_readme_is_at_most_200_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_no_page_refers_to_files_outside_the_repository():
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in doc_files()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "shared/" in line
    ]
    assert not offenders, f"references to shared/: {offenders}"


# ---- the checker itself, on pages written for the purpose ----------------------------


def test_the_checker_finds_exactly_the_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "src.py").write_text("")
    (tmp_path / "docs" / "b.md").write_text("# Top\n\n## The `run` directory (files)\n\n## Top\n")
    page = tmp_path / "docs" / "a.md"
    page.write_text(
        "# A\n"
        "[ok](b.md) [ok anchor](b.md#the-run-directory-files) [dup](b.md#top-1)\n"
        "![img](../src.py) [ext](https://example.org/x.md) [self](#a)\n"
        "[missing](c.md) [bad anchor](b.md#nope) [escape](../../outside.md)\n"
        "`[in code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[ref]: missing-ref.md\n"
    )
    found = broken_links(page, root=tmp_path)
    assert found == [
        "docs/a.md:4: c.md (no such file)",
        "docs/a.md:4: b.md#nope (no heading with anchor #nope)",
        "docs/a.md:4: ../../outside.md (outside the repository)",
        "docs/a.md:9: missing-ref.md (no such file)",
    ]


def test_slug_follows_githubs_rule():
    heading = "Calibrate new units (`fedcal calibrate`)"
    assert slug(heading) == "calibrate-new-units-fedcal-calibrate"
    assert slug("AFL-CSEM's claims (seed 004)") == "afl-csems-claims-seed-004"
    assert slug("Fleets of 20 to 10,000 sensors") == "fleets-of-20-to-10000-sensors"
