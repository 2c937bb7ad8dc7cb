"""Progress of a training loop, as the examples print it: a tqdm bar on a terminal, plain
lines everywhere else.

On a terminal (stdout is a tty) one bar shows the step, elapsed and remaining time, and the
loop's fields (loss, tokens/s, memory, ...). tqdm cuts a bar that is wider than the terminal
mid-text, so the bar carries as many *whole* fields as fit, in the order given (the most
important first), and every `every` steps the full line is written above the bar when some
field did not fit: nothing is ever cut off.

Anywhere else (a file, a pipe, a job log) a bar would be a stream of carriage returns
(tqdm's `disable=None` hides it altogether, so nothing would be printed): the same fields
come out as one readable line every `every` steps and at the last step:

    step 20/100 loss 4.1234 tok/s 12,345 mem device 0.0MiB host 18.2MiB nvme 0.0MiB lr 3.00e-04
"""

from __future__ import annotations

import shutil
import sys
from typing import Optional, Sequence, TextIO

from tqdm import tqdm

_BAR_FORMAT = "step {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}"
_BAR_MIN = 10
"""Columns kept for the bar itself; the rest of the line is text."""


def _isatty(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # a closed or file-like object without a terminal
        return False


class Progress:
    """`update(step, fields)` after each optimizer step; `close()` at the end.

    `fields` are short strings ("loss 4.1234"), most important first. `terminal`
    overrides the tty check and `ncols` the terminal's width (both for tests)."""

    def __init__(self, total: int, initial: int = 0, every: int = 1, file: Optional[TextIO] = None,
                 terminal: Optional[bool] = None, ncols: Optional[int] = None) -> None:
        self.file = file if file is not None else sys.stdout
        self.total, self.every = total, max(1, every)
        self._ncols = ncols
        self.bar: Optional[tqdm] = None
        if terminal if terminal is not None else _isatty(self.file):
            self.bar = tqdm(total=total, initial=initial, file=self.file, bar_format=_BAR_FORMAT,
                            ncols=ncols, dynamic_ncols=ncols is None, leave=True)

    def line(self, step: int, fields: Sequence[str]) -> str:
        return " ".join([f"step {step}/{self.total}", *fields])

    def update(self, step: int, fields: Sequence[str]) -> None:
        due = step % self.every == 0 or step == self.total
        if self.bar is None:
            if due:
                print(self.line(step, fields), file=self.file, flush=True)
            return
        width = self._ncols or shutil.get_terminal_size().columns
        # What the bar's text takes besides the fields: "step n/total || h:mm:ss<h:mm:ss, "
        # (times of a day or more are wider: "1d, ..." is rare enough to risk).
        fixed = len(f"step {step}/{self.total} || 00:00:00<00:00:00, ") + _BAR_MIN
        shown = list(fields)
        while shown and fixed + len(" ".join(shown)) > width:
            shown.pop()  # drop whole fields from the least important end
        if len(shown) < len(fields) and due:
            self.bar.write(self.line(step, fields), file=self.file)
        self.bar.set_postfix_str(" ".join(shown), refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
