"""[Note: streams and threads] in offload/devices.py stays true: every side stream the engine
makes is a `StreamPurpose` member, and every member is in the note with the file that uses it."""

from __future__ import annotations

import pathlib
import re

import offload
from offload.devices import StreamPurpose

ROOT = pathlib.Path(offload.__file__).parent


def test_every_side_stream_has_a_purpose_the_note_lists_with_its_file():
    note = (ROOT / "devices.py").read_text()
    note = note[note.index("# [Note: streams and threads]"): note.index("class StreamPurpose")]
    used: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        for m in re.finditer(r"(?<![\w.])side_stream\(\s*[^,()]+(?:\([^()]*\))?[^,()]*,\s*([^)]+)\)", path.read_text()):
            arg = m.group(1).strip()
            if path.name == "devices.py":
                continue
            assert arg.startswith("StreamPurpose."), f"{path}: side_stream(..., {arg}): name a StreamPurpose"
            used.setdefault(arg.split(".")[1], set()).add(str(path.relative_to(ROOT)))
    assert set(used) == {p.name for p in StreamPurpose}, "a purpose nothing uses, or one missing"
    for name, files in used.items():
        block = note[note.index(f"`StreamPurpose.{name}`"):]
        block = block[: block.index("\n# -") if "\n# -" in block else len(block)]
        for f in files:
            assert f in block, f"[Note: streams and threads]: StreamPurpose.{name} does not name {f}"
