"""Every command block in docs/ that says it runs as printed does: each is marked
`<!-- runs as printed -->` on the line before its fence, and this test runs its `$ python ...`
commands in order, in one empty directory (as a user in a scratch folder, with the
repository's `examples/` and `benchmarks/` named from its root), and checks that each
command exits 0 and prints the lines shown under it, in order (`...` stands for any text).

A negative control runs blocks that fail (a command that exits non-zero, a line that is
not printed) through the same harness.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.scripts import run_python

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- runs as printed -->"


@dataclass
class Command:
    argv: list[str]
    expect: list[str] = field(default_factory=list)


def marked_blocks() -> list[tuple[str, str]]:
    """(where, block text) for each fenced block right after the mark."""
    out = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARK:
                continue
            assert i + 1 < len(lines) and lines[i + 1].startswith("```"), (
                f"{page.relative_to(ROOT)}:{i + 1}: '{MARK}' must be right before a fenced block")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            out.append((f"{page.relative_to(ROOT)}:{i + 2}", "\n".join(lines[i + 2:end])))
    return out


def parse(block: str) -> list[Command]:
    commands: list[Command] = []
    lines = iter(block.splitlines())
    for line in lines:
        if line.startswith("$ "):
            text = line[2:]
            while text.endswith("\\"):
                text = text[:-1] + next(lines).strip()
            commands.append(Command(shlex.split(text)))
        elif line.strip():
            assert commands, f"output before any command: {line!r}"
            commands[-1].expect.append(line.strip())
    return commands


def line_pattern(expected: str) -> re.Pattern:
    return re.compile("^" + ".*".join(re.escape(part) for part in expected.split("...")) + "$")


def run_block(block: str, cwd: Path, timeout_s: float = 300) -> None:
    """Runs the block's commands in `cwd`; raises AssertionError naming what differs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    for command in parse(block):
        assert command.argv[0] == "python", f"only `python ...` commands are run here: {command.argv}"
        args = [str(ROOT / a) if a.startswith(("examples/", "benchmarks/")) else a for a in command.argv[1:]]
        out = run_python(args, env=env, cwd=str(cwd), timeout=timeout_s)
        printed = (out.stdout + out.stderr).splitlines()
        shown = " ".join(command.argv)
        assert out.returncode == 0, f"`{shown}` exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
        at = 0
        for expected in command.expect:
            rx = line_pattern(expected)
            hit = next((k for k in range(at, len(printed)) if rx.match(printed[k].strip())), None)
            assert hit is not None, (f"`{shown}` did not print {expected!r} (after line {at}):\n"
                                     + "\n".join(printed))
            at = hit + 1


BLOCKS = marked_blocks()


def test_docs_have_blocks_that_run_as_printed():
    assert any("examples.md" in where for where, _ in BLOCKS), "the resume transcript lost its mark"


@pytest.mark.parametrize("where,block", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_docs_block_runs_as_printed(where, block, tmp_path):
    run_block(block, tmp_path)


@pytest.mark.parametrize("script,block,says", [
    ("import sys; sys.exit(3)", "$ python s.py", "exited 3"),
    ("print('step 8/8 loss 9.1')", "$ python s.py\nstep 8/8 loss 9.2...", "did not print"),
    ("print(1); print(2)", "$ python s.py\n2\n1", "did not print"),   # order matters
    ("print(1)", "$ ls\n1", "only `python ...`"),
])
def test_harness_sees_a_failing_block(script, block, says, tmp_path):
    # Negative control: each block fails the harness, saying why.
    (tmp_path / "s.py").write_text(script + "\n")
    with pytest.raises(AssertionError, match=says):
        run_block(block, tmp_path, timeout_s=60)


def test_harness_reads_continuations_and_wildcards():
    (command,) = parse("$ python examples/train_gpt.py --size tiny \\\n    --steps 8\nstep 8/8 loss ...")
    assert command.argv == ["python", "examples/train_gpt.py", "--size", "tiny", "--steps", "8"]
    assert line_pattern(command.expect[0]).match("step 8/8 loss 9.0200 tok/s 2,630")
