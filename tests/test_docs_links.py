"""Every relative link in README.md and docs/**/*.md resolves (issue #32).

A markdown link `[text](path)` or `[text](path#anchor)` (images too) must name a file or
folder that exists, relative to the file that links; an `#anchor` into a markdown file
(or `(#anchor)` into the same one) must match one of its headings under GitHub's slug
rules: the heading's text lowercased, each space a '-', punctuation other than '-' and
'_' dropped, and a repeated slug numbered `-1`, `-2`, ... Links with a scheme (http,
https, mailto) are not checked; nor is anything inside code (fenced blocks, `inline`).
A negative control runs broken links through the same checker.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^ {0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")
# [text](target) or ![alt](target), target up to whitespace or ')', an optional "title".
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            # Indented code blocks are read as prose: links are rare there, and a list
            # item's continuation lines are indented too.
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link: its text
    text = text.replace("`", "").lower()
    return "".join("-" if c == " " else c for c in text if c.isalnum() or c in " -_")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(text: str):
    """(line number, target) of every markdown link outside code."""
    for number, line in prose_lines(text):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, m.group(1)


def check_link(source: Path, target: str) -> str | None:
    """Why `target`, linked from `source`, does not resolve; None when it does."""
    if not target or SCHEME.match(target) or target.startswith("//"):
        return None
    path, _, anchor = target.partition("#")
    dest = (source.parent / path).resolve() if path else source
    if not dest.exists():
        return f"{path} does not exist"
    if anchor and dest.is_file() and dest.suffix == ".md":
        if anchor not in anchors(dest):
            return f"{dest.relative_to(ROOT)} has no heading with anchor #{anchor}"
    return None


def broken_links(source: Path, text: str | None = None) -> list[str]:
    text = source.read_text(encoding="utf-8") if text is None else text
    out = []
    for number, target in links(text):
        why = check_link(source, target)
        if why:
            out.append(f"{source.relative_to(ROOT)}:{number}: ({target}): {why}")
    return out


def test_every_relative_link_resolves():
    files = markdown_files()
    assert ROOT / "docs" / "index.md" in files
    broken = [b for f in files for b in broken_links(f)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_checker_sees_links():
    # The files do link (a checker that finds nothing would pass the test above).
    found = sum(1 for f in markdown_files() for _ in links(f.read_text(encoding="utf-8")))
    assert found > 50
    readme = [t for _, t in links((ROOT / "README.md").read_text(encoding="utf-8"))]
    assert "docs/index.md" in readme


def test_slugs_follow_github():
    assert slug("Per-unit placement: RAM first, the disk for the rest") == \
        "per-unit-placement-ram-first-the-disk-for-the-rest"
    assert slug("`offload.init`") == "offloadinit"
    assert slug("Activation checkpoints in host memory (ZeRO-R)") == \
        "activation-checkpoints-in-host-memory-zero-r"
    assert slug("DeepSpeed configs from Hugging Face: auto values") == \
        "deepspeed-configs-from-hugging-face-auto-values"
    assert slug("Python API (`offload.optim`)") == "python-api-offloadoptim"
    assert slug("keep_bytes and [the trace](x.md)") == "keep_bytes-and-the-trace"


def test_negative_control_broken_links_fail():
    readme = ROOT / "README.md"
    text = ("[ok](docs/index.md) [gone](docs/no-such-page.md) "
            "[bad anchor](docs/engine.md#no-such-heading) [self](#no-such-section)\n"
            "`[in code](docs/also-missing.md)` [web](https://example.com/missing.md)\n"
            "```\n[fenced](docs/fenced-missing.md)\n```\n")
    broken = broken_links(readme, text)
    assert len(broken) == 3, broken
    assert "no-such-page.md does not exist" in broken[0]
    assert "#no-such-heading" in broken[1]
    assert "#no-such-section" in broken[2]
    # A good anchor passes through the same function.
    assert check_link(readme, "docs/engine.md#gradients") is None
    assert check_link(ROOT / "docs" / "engine.md", "#process-group") is None
