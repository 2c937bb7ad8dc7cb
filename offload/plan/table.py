"""How the planner's comparisons print (`compare_stages`, `compare_sharding`): a title, a table
of left-aligned columns, and the recommendation with the config that runs it."""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

__all__ = ["choice_text"]


def choice_text(title: str, head: Sequence[str], rows: Sequence[Sequence[str]], chosen: Optional[str],
                what: str, reason: str, config: dict[str, Any]) -> str:
    """The comparison as text: `title`, the table, then 'recommended: <chosen> -- <reason>'
    and its config, or 'no <what> fits: <reason>' when `chosen` is None."""
    table = [list(head)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = [title, ""]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    lines.append("")
    if chosen is None:
        lines.append(f"no {what} fits: {reason}")
    else:
        lines.append(f"recommended: {chosen} -- {reason}")
        lines.append(f"config: {json.dumps(config)}")
    return "\n".join(lines)
