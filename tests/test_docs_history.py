"""User docs say what the software does and how to use it, not how it got there.

docs/ is read by users; the project's development history (what was built when, by which
issue, in which branch or working session, what was noticed and left for later) belongs in
CHANGELOG.md, by release. This test greps every page of docs/ and the README for the
markers such history leaves: a "Closing note" or "Noticed, left alone" section, an issue
number, a working session, a branch or a scratch merge, a design file that is not part of
the repository, a developer's machine path. A negative control runs text carrying each
marker through the same check.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (what it is, pattern); matched case-insensitively against each line.
MARKERS: list[tuple[str, str]] = [
    ("a closing note", r"\bclosing note\b"),
    ("a 'noticed, left alone' list", r"\bnoticed,? (and )?left alone\b|\bleft for later issues\b"),
    ("an issue number", r"\bissues? #?\d+\b|\(#\d+\)|\bissue #\d+'s\b"),
    ("a working session", r"\b(this|that|earlier|other|later|previous|first|second|third|fourth|\w+ other) sessions?\b"
                          r"|\bsessions?\)"),
    ("a branch or merge of the development", r"\bthis branch\b|\bscratch (merge|copy)\b|\bbranch's\b"
                                             r"|\bthe (nvme|ckpt|checkpoint|config|adam|engine) branch\b"
                                             r"|\bat merge\b|\bis merged\b|\bwhen it merges\b|\bmerged into a\b"),
    ("a development pass", r"\b(first|second|third|fourth) pass\)"),
    ("a design file not in the repository", r"\b(DESIGN|STYLE|HELPERS)\.md\b"),
    ("a development machine's path", r"(?<![\w.])/work/"),
]
PATTERNS = [(what, re.compile(rx, re.I)) for what, rx in MARKERS]


def user_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def history_markers(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) for each line carrying a marker."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, rx in PATTERNS:
            if rx.search(line):
                found.append((number, what, line.strip()))
    return found


def test_user_docs_carry_no_development_history():
    found = [f"{p.relative_to(ROOT)}:{n}: {what}: {line[:120]}"
             for p in user_pages() for n, what, line in history_markers(p.read_text(encoding="utf-8"))]
    assert not found, ("development history in user docs (say what the software does and how; "
                       "move history to CHANGELOG.md):\n" + "\n".join(found))


@pytest.mark.parametrize("line,what", [
    ("## Closing note", "a closing note"),
    ("**Noticed, left alone.**", "a 'noticed, left alone' list"),
    ("## Limits (known, left for later issues)", "a 'noticed, left alone' list"),
    ("train as in plain PyTorch (issue #29):", "an issue number"),
    ("Issue #36's checks: every plot's legend", "an issue number"),
    ("## For issue 7 (prefetch and overlap)", "an issue number"),
    ("shared with three other sessions, so tokens/s", "a working session"),
    ("No GPU in this session: the CUDA paths", "a working session"),
    ("(third session; `python -m", "a working session"),
    ("on a scratch merge of this branch with the NVMe branch:", "a branch or merge of the development"),
    ("(renamed from `init.py` at merge)", "a branch or merge of the development"),
    ("### Speed (issue #8, second pass)", "a development pass"),
    ('decides (DESIGN.md "Numbers to design for")', "a design file not in the repository"),
    ("--nvme-path /work/bigrun/swap", "a development machine's path"),
])
def test_history_markers_are_found(line, what):
    # Negative control: lines of the kind the docs carried, each found by the check above.
    assert what in [w for _, w, _ in history_markers(line)], line


def test_user_text_is_not_taken_for_history():
    # What user docs legitimately say: branch-free code, a kernel that merges writes, a
    # second pass of backward, a path under a user's folder.
    text = ("A branch-free binary search.\nThe kernel merges writes to one page.\n"
            "a second pass raises, with the fix\n--nvme-path ./bigrun/swap\n"
            "the NCCL path has not been run across nodes")
    assert history_markers(text) == []
