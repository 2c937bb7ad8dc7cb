"""The suite's Markdown report and its PNG plots, from the benchmarks' JSON results.

Each benchmark writes `{"machine": ..., "rows": [...], ...}`; this module turns a suite of
them into one report: the machine, then per benchmark its table and the plot that answers
its question at a glance:

- bench_io          sequential bandwidth vs block size, one line per contender and direction
- bench_adam        Adam parameters/s vs threads, one line per contender (largest size run)
- bench_optimizers  Lion and Adagrad parameters/s per contender against the roofline
- bench_train       step time by tier (the engine's placements next to the peers)
- bench_checkpoint  save / load GB/s by optimizer tier, next to the disk (and the disk copy an
                    NVMe-tier save is judged against) and torch.save/load

Plots need matplotlib (`pip install 'offload[bench]'`). Without it, or when one plot fails,
the report says so in place of the image and the tables are written all the same: a report
without pictures is still a report, a crash is not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks._common import RATIO_LEGEND, na_reasons

Result = dict[str, Any]


def render(suite: dict[str, Any], out: Path) -> tuple[str, dict[str, str]]:
    """The report's Markdown, and {plot file name: caption} of the PNGs written into `out`."""
    plt, why_no_plots = _pyplot()
    lines = ["# offload benchmark report", ""]
    if why_no_plots:  # first thing read: a report without its pictures must say why at once
        lines += [f"**Plots skipped: {why_no_plots}.** No PNG was written; install the extra "
                  f"(from a checkout: `pip install -e \".[bench]\"`) and rerun.", ""]
    lines += _load_summary(suite)
    machine = next((r.get("machine") for r in suite["results"].values() if r.get("machine")), None)
    if machine:
        lines += ["Machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()), ""]
    mode = "quick" if suite.get("quick") else "full"
    lines += [f"Mode: {mode}. Command: `{suite.get('command', 'python -m benchmarks')}`", ""]
    plots: dict[str, str] = {}
    for name, result in suite["results"].items():
        wall = result.get("_wall_s")
        lines += [f"## {name}" + (f" ({wall:g} s)" if wall is not None else ""), ""]
        missing = result.get("peers_missing") or {}
        why_na = result.get("na_reasons") or {}
        na = set(na_reasons(result.get("ratio_peers") or {}, missing)) | set(why_na)
        lines += _tables(result, na)
        lines += _not_run(missing, why_na)
        if plt is None:
            continue
        try:
            made = _plot(name, result, out, plt)
        except Exception as exc:  # a plot must never cost the report its tables
            lines += [f"Plot skipped: {type(exc).__name__}: {exc}", ""]
            continue
        if made:
            file_name, caption = made
            plots[file_name] = caption
            lines += [f"![{caption}]({file_name})", ""]
    for name, why in suite["failures"].items():
        lines += [f"## {name}: failed", "", f"    {why}", ""]
    if suite.get("pending"):  # written after each benchmark: a killed run says what it did not reach
        lines += [f"Not run yet: {', '.join(suite['pending'])} (the report is rewritten after each benchmark).", ""]
    return "\n".join(lines), plots


def _pyplot() -> tuple[Any, Optional[str]]:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a server
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed (pip install 'offload[bench]')"
    return plt, None


def _load_summary(suite: dict[str, Any]) -> list[str]:
    """Load averages before and after each benchmark, and a warning when one started on a busy
    machine (1-min load > 0.5 x cores): two runs back to back once differed 3x."""
    loads = {n: r["_load"] for n, r in suite["results"].items() if r.get("_load")}
    if not loads:
        return []
    cores = next(iter(loads.values()))["before"]["cores"]
    out = []
    busy = [n for n, ld in loads.items() if ld.get("busy_before")]
    if busy:
        out += [f"**Warning: the machine was busy** before {', '.join(busy)} (1-min load average "
                f"above 0.5 x {cores} cores): those figures may be off; rerun on a quiet machine.", ""]
    out += [f"Load average (1, 5, 15 min) on {cores} cores:", "",
            "| benchmark | before | after | busy before |", "|---|---|---|---|"]
    for n, ld in loads.items():
        out.append(f"| {n} | {_triple(ld['before'])} | {_triple(ld['after'])} | "
                   f"{'yes' if ld.get('busy_before') else 'no'} |")
    return out + [""]


def _triple(load: dict[str, Any]) -> str:
    return " / ".join(f"{x:.2f}" for x in load["load_avg"])


def _tables(result: Result, na: set[str]) -> list[str]:
    """A benchmark's rows as the script prints them: its `tables` ({"title", "columns", and
    "rows_with": a column only some rows fill}) when it names them, each without the columns
    no row fills, else one table of every column."""
    rows = result.get("rows") or []
    specs = result.get("tables")
    if not specs:
        return _table(rows, na)
    out: list[str] = []
    for spec in specs:
        picked = [r for r in rows if spec.get("rows_with") is None or r.get(spec["rows_with"]) is not None]
        if not picked:
            continue
        columns = [c for c in spec["columns"] if any(_filled(r.get(c)) for r in picked)]
        out += [f"**{spec['title']}**", ""]
        out += _table([{c: r.get(c) for c in columns} for r in picked], na)
    return out


def _filled(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and value != value)


def _table(rows: list[dict[str, Any]], na: Optional[set[str]] = None) -> list[str]:
    """A Markdown table; an empty cell of a column in `na` reads "n/a", its reason said once
    under the table (`_not_run`). Tables with ratio columns get the legend above them."""
    if not rows:
        return ["(no rows)", ""]
    cols: list[str] = []
    for r in rows:  # the union of the rows' columns, in first-seen order
        cols += [c for c in r if c not in cols]
    na = na or set()
    out = [RATIO_LEGEND + ".", ""] if any(c.startswith("vs") for c in cols) else []
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_cell(r.get(c), c in na) for c in cols) + " |" for r in rows]
    return out + [""]


def _not_run(missing: dict[str, str], why_na: dict[str, str]) -> list[str]:
    """One line under a table: each peer that did not run, with why, peers sharing a reason
    named together, then why any other column has n/a cells. Once per table, not in every
    cell: bench_train's table once repeated "n/a (deepspeed not installed ...)" 44 times."""
    parts = []
    if missing:
        by_reason: dict[str, list[str]] = {}
        for peer, why in missing.items():
            by_reason.setdefault(why, []).append(peer)
        parts.append("Peers missing: "
                     + "; ".join(f"{', '.join(peers)}: {why}" for why, peers in by_reason.items()) + ".")
    parts += [f"n/a in {col}: {why}." for col, why in why_na.items()]
    return [" ".join(parts), ""] if parts else []


def _cell(v: Any, na: bool = False) -> str:
    empty = "n/a" if na else ""
    if isinstance(v, float):
        if v != v:
            return empty
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return empty if v is None else str(v)


def _number(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and v == v else None


def _plot(name: str, result: Result, out: Path, plt: Any) -> Optional[tuple[str, str]]:
    rows = result.get("rows") or []
    if not rows:
        return None
    draw = _PLOTS.get(name, _plot_declared)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        caption = draw(rows, result, ax)
        if caption is None:
            return None
        ax.set_title(caption, fontsize="medium", loc="left")  # from the axes rightwards, over the legend: never cut off
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            # Right of the axes, not inside them: "best" still covered lines or bars in three
            # of the five plots. The figure widens by about the legend's width and
            # tight_layout fits the axes into the rest.
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
            fig.set_size_inches(10.5, 4.5)
        fig.tight_layout()
        file_name = f"{name}.png"
        fig.savefig(out / file_name, dpi=110)
        return file_name, caption
    finally:
        plt.close(fig)


def _block_bytes(label: str) -> float:
    label = str(label).strip().upper()
    for suffix, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if label.endswith(suffix):
            return float(label[:-1]) * mult
    return float(label)


def _plot_io(rows: list[dict], result: Result, ax: Any) -> Optional[str]:
    """GB/s vs block size, per contender and direction; the best queue depth x threads per block."""
    series: dict[str, dict[float, float]] = {}
    for r in rows:
        block = _block_bytes(r["block"])
        for col in ("offload GB/s", "fio GB/s", "deepspeed GB/s"):
            v = _number(r.get(col))
            if v is None:
                continue
            pts = series.setdefault(f"{col.split()[0]} {r['op']}", {})
            pts[block] = max(v, pts.get(block, 0.0))
    if not series:
        return None
    for label, pts in sorted(series.items()):
        xs = sorted(pts)
        style = "-" if label.startswith("offload") else "--"
        ax.plot(xs, [pts[x] for x in xs], style, marker="o", label=label)
    blocks = sorted({x for pts in series.values() for x in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(blocks, [_size_label(b) for b in blocks])
    ax.set_xlabel("block size")
    ax.set_ylabel("GB/s (median, O_DIRECT)")
    ax.set_ylim(bottom=0)
    return "sequential bandwidth vs block size (best queue depth x threads per block)"


def _size_label(n: float) -> str:
    for suffix, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{int(n // mult)}{suffix}"
    return f"{int(n)}"


def _plot_adam(rows: list[dict], result: Result, ax: Any) -> Optional[str]:
    """Mparam/s vs threads at the largest size measured, one line per contender, each labelled
    with the bytes per parameter it moves. The roofline is measured at fp32's 28 B/param; a
    contender moving fewer bytes (bf16 moments: 20 B) has a higher ceiling in params/s, so the
    roofline is drawn once per byte count (its GB/s over those bytes), in that rows' colour
    family, and no bf16 line sits against fp32's ceiling."""
    size = max(r["params_M"] for r in rows)
    series: dict[str, list[tuple[int, float]]] = {}
    bytes_of: dict[str, int] = {}
    roof_gb_s: dict[int, float] = {}  # threads -> the roofline's GB/s
    for r in rows:
        v = _number(r.get("Mparam/s"))
        if r["params_M"] != size or v is None:
            continue
        if r["contender"] == "roofline":
            roof_gb_s[int(r["threads"])] = v * 1e6 * r.get("B/param", 28) / 1e9
            continue
        series.setdefault(r["contender"], []).append((int(r["threads"]), v))
        bytes_of[r["contender"]] = int(r.get("B/param", 28))
    for label, pts in series.items():
        pts.sort()
        style = "-" if label.startswith("ours") else "--"
        ax.plot([t for t, _ in pts], [v for _, v in pts], style, marker="o",
                label=f"{label} ({bytes_of[label]} B/param)")
    ts = sorted(roof_gb_s)
    for nbytes in sorted({b for c, b in bytes_of.items() if c != "triad" and c.startswith(("ours", "torch", "Deep"))}):
        ax.plot(ts, [roof_gb_s[t] * 1e9 / nbytes / 1e6 for t in ts], ":", color="black",
                alpha=0.4 + 0.3 * (nbytes == 28), linewidth=2,
                label=f"roofline at {nbytes} B/param (measured GB/s / {nbytes} B)")
    threads = sorted({t for pts in series.values() for t, _ in pts})
    ax.set_xticks(threads)
    ax.set_xlabel("threads")
    ax.set_ylabel("M params / s (median)")
    ax.set_ylim(bottom=0)
    return f"Adam step throughput vs threads, {size:g} M params (dotted: roofline per byte count)"


def _plot_optimizers(rows: list[dict], result: Result, ax: Any) -> Optional[str]:
    """Horizontal bars of M params/s per contender at the largest size and thread count, ours
    in blue, peers in grey; the dotted lines are the roofline at 20 B/param (fp32) and
    16 B/param (bf16 state), the measured GB/s over those bytes."""
    size = max(r["params_M"] for r in rows)
    threads = max(r["threads"] for r in rows if r["params_M"] == size)
    case = [r for r in rows if r["params_M"] == size and r["threads"] == threads]
    roof = next((r for r in case if r["contender"] == "roofline"), None)
    pts = [(r["contender"], _number(r.get("Mparam/s"))) for r in case if r["contender"] != "roofline"]
    pts = [(c, v) for c, v in pts if v is not None]
    if not pts:
        return None
    colors = ["tab:blue" if " ours " in c else "tab:gray" for c, _ in pts]
    ax.barh(range(len(pts)), [v for _, v in pts], color=colors)
    ax.set_yticks(range(len(pts)), [c for c, _ in pts], fontsize="small")
    ax.invert_yaxis()
    if roof is not None:
        gb_s = roof["Mparam/s"] * roof.get("B/param", 20)
        for nbytes, style in ((20, ":"), (16, "--")):
            ax.axvline(gb_s / nbytes, color="black", linestyle=style, alpha=0.6,
                       label=f"roofline at {nbytes} B/param")
    ax.set_xlabel("M params / s (median; higher is better)")
    return f"Lion and Adagrad steps, {size:g} M params, {threads} threads"


# Where each bench_train contender keeps parameters and optimizer state.
_TRAIN_TIERS = {
    "torch": "plain PyTorch (all on compute device)",
    "engine": "engine: params cpu, optimizer cpu",
    "engine_nvme_opt": "engine: params cpu, optimizer nvme",
    "engine_nvme_all": "engine: params nvme, optimizer nvme",
    "fsdp2": "FSDP2 CPU offload",
    "deepspeed": "DeepSpeed ZeRO-3: cpu, cpu",
    "deepspeed_nvme": "DeepSpeed ZeRO-3: nvme, nvme",
}


def _plot_train(rows: list[dict], result: Result, ax: Any) -> Optional[str]:
    """Horizontal bars of step time, one per contender, labelled with its placement."""
    pts = [(r["contender"], _number(r.get("step_ms"))) for r in rows]
    pts = [(c, v) for c, v in pts if v is not None]
    if not pts:
        return None
    labels = [_TRAIN_TIERS.get(c, c) for c, _ in pts]
    colors = ["tab:blue" if c.startswith("engine") else "tab:gray" for c, _ in pts]
    ax.barh(range(len(pts)), [v for _, v in pts], color=colors)
    ax.set_yticks(range(len(pts)), labels, fontsize="small")
    ax.invert_yaxis()
    for i, (_, v) in enumerate(pts):
        ax.text(v, i, f" {v:.0f}", va="center", fontsize="small")
    ax.set_xlabel("step time, ms (median; lower is better)")
    n = result.get("n_params")
    size = f", {n / 1e6:.1f} M params" if isinstance(n, (int, float)) else ""
    return f"training step time by tier{size}"


def _plot_checkpoint(rows: list[dict], result: Result, ax: Any) -> Optional[str]:
    """Grouped bars: per (tier, op), offload vs the baselines it is judged against (the disk's
    sequential write / read: `vs disk`; for an NVMe-tier save, the disk copy too: `vs copy`,
    the swap file read while the checkpoint is written) and torch.save / load, GB/s. A row
    without a figure (the copy of a CPU-tier save) gets no bar, not a zero-height one."""
    cols = [("offload GB/s", "tab:blue", "offload"), ("disk GB/s", "tab:green", "disk write / read"),
            ("copy GB/s", "tab:olive", "disk copy (nvme save)"), ("torch GB/s", "tab:gray", "torch.save / load")]
    cols = [c for c in cols if any(_number(r.get(c[0])) is not None for r in rows)]
    cases = [f"{r['tier']} {r['op']}" for r in rows]
    width = 0.8 / len(cols)
    for k, (col, color, label) in enumerate(cols):
        at = [(i, v) for i, r in enumerate(rows) if (v := _number(r.get(col))) is not None]
        ax.bar([i + (k - (len(cols) - 1) / 2) * width for i, _ in at], [v for _, v in at], width,
               label=label, color=color)
    ax.set_xticks(range(len(rows)), cases)
    ax.set_ylabel("GB/s of optimizer state (median)")
    return "checkpoint save / load bandwidth by optimizer tier"


def _plot_declared(rows: list[dict], result: Result, ax: Any) -> Optional[str]:
    """A benchmark the suite has no plot for: the line its JSON declares ({"x", "y", "group"})."""
    spec = result.get("plot")
    if not spec:
        return None
    groups: dict[str, list[tuple[str, float]]] = {}
    for r in rows:
        y = _number(r.get(spec["y"]))
        if y is not None:
            groups.setdefault(str(r.get(spec.get("group", ""), "")), []).append((str(r.get(spec["x"])), y))
    for g, pts in groups.items():
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=g or None)
    ax.set_xlabel(spec["x"])
    ax.set_ylabel(spec["y"])
    return spec.get("title", "")


_PLOTS: dict[str, Callable[[list[dict], Result, Any], Optional[str]]] = {
    "bench_io": _plot_io,
    "bench_adam": _plot_adam,
    "bench_optimizers": _plot_optimizers,
    "bench_train": _plot_train,
    "bench_checkpoint": _plot_checkpoint,
}

__all__ = ["render"]
