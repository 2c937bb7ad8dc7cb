"""The examples' command line: one reading of sizes, and the engine's errors as one line.

- `size_arg` is the argparse `type` of every size flag (`--pinned-budget 1GiB`,
  `--rss-budget 4GiB`, `--pinned-budget 1200000000`): `offload.sizes.parse_bytes`, so every
  flag takes the same forms (GB = 10**9 bytes, GiB = 2**30) and a bad one is argparse's
  usage error with parse_bytes' message.
- `interruptions(on_interrupt)` turns SIGINT and SIGTERM into one line (`on_interrupt()`
  cleans up and says what: the step, what was cleaned, the last complete checkpoint and how
  to resume) and the signal's exit status (130, 143), with no traceback unless
  `OFFLOAD_DEBUG=1` (or the script's `--debug`) asks for it.
- `engine_errors()` wraps what the engine checks at the door (config, swap directory,
  `initialize`, `load_checkpoint`): a ValueError/TypeError/OSError/NotImplementedError raised
  there already says what was wrong and the fix, so the script prints it as one line,
  `error: ...`, and exits 2 (argparse's status for bad usage) instead of a traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator

from offload.sizes import parse_bytes
from offload.storage.swap import make_swap_dir

__all__ = ["size_arg", "add_tier_flags", "engine_errors", "interruptions", "one_line", "make_swap_dir",
           "EXIT_USAGE"]

EXIT_USAGE = 2


def size_arg(text: str) -> int:
    """Bytes from '1GiB', '512MB', '1.2e9' or a plain number (argparse `type`)."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


size_arg.__name__ = "size"  # argparse names the type in its message: "invalid size value"


def add_tier_flags(group: "argparse._ActionsContainer", placement: bool = False) -> None:
    """The flags every example shares for where training state lives: --param-tier,
    --optimizer-tier (--placement with `placement`), --nvme-path, --pinned-budget,
    --ram-budget."""
    group.add_argument("--param-tier", choices=["device", "cpu", "nvme"], default="cpu",
                       help="where each rank's parameter shard lives")
    group.add_argument("--optimizer-tier", choices=["cpu", "nvme"], default="cpu",
                       help="where the fp32 master and Adam moments live")
    if placement:
        group.add_argument("--placement", choices=["manual", "auto"], default="manual",
                           help="auto: the memory planner picks the tiers for this machine")
    group.add_argument("--nvme-path", default=None,
                       help="directory for swap files (nvme tiers); created if missing")
    group.add_argument("--pinned-budget", type=size_arg, default="1GiB",
                       help="pinned staging budget (nvme tiers), e.g. 1GiB, 512MB or bytes")
    group.add_argument("--ram-budget", type=size_arg, default=None,
                       help="host memory (per rank) for units kept in RAM instead of on an nvme "
                            "tier, the bytes that save the most disk traffic first, e.g. 12GiB")


def one_line(exc: BaseException) -> str:
    """The exception's message on one line: an OSError's own text without "[Errno N]"."""
    text = str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
        if exc.filename is not None and str(exc.filename) not in text:
            text += f": {exc.filename}"
    return " ".join(text.split())


@contextmanager
def engine_errors() -> Iterator[None]:
    """Run the engine's checks; their exceptions become `error: <message>` and exit 2."""
    try:
        yield
    except (ValueError, TypeError, OSError, NotImplementedError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE) from None


@contextmanager
def interruptions(on_interrupt: Callable[[str], str], debug: bool = False) -> Iterator[None]:
    """SIGINT (Ctrl-C) or SIGTERM inside: `on_interrupt(signal_name)` cleans up and returns
    the line to print; the process exits with 128 + the signal's number (130, 143), as a
    shell reports a signalled process. A traceback only with `debug` or OFFLOAD_DEBUG=1."""
    received = [signal.SIGINT]

    def on_term(signum: int, frame: object) -> None:
        received[0] = signal.Signals(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if debug or os.environ.get("OFFLOAD_DEBUG", "") not in ("", "0"):
            traceback.print_exc()
        line = on_interrupt(received[0].name)
        if line:
            print(line, file=sys.stderr, flush=True)
        raise SystemExit(128 + int(received[0])) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
