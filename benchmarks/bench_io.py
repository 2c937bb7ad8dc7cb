"""Sequential read and write bandwidth of offload's AIO engine, against fio and DeepSpeed AIO.

The question: does offload.storage.io move a multi-GB file between memory and disk as fast as the
tools people already trust? Each case (block size, queue depth, threads) runs the same
transfer of the same file with every contender, interleaved (A B C, B C A, C A B ...: the order
rotates each round), and reports medians:

- offload   AIOHandle(block_size, queue_depth, threads): one pwrite/pread of the whole file.
- fio       direct=1, ioengine=libaio, rw=write/read, the same file and block size, one job
            with iodepth = queue_depth x threads (the same number of blocks in flight).
- deepspeed DeepSpeed's async I/O op (aio_handle(block_size, queue_depth, intra_op_parallelism
            = threads), sync_pwrite/sync_pread) on a buffer from its own page-locked
            allocator, so it takes its fast path (JIT-built; dropped with the reason if that
            fails).

Everything is O_DIRECT, so the page cache plays no part. Writes overwrite the file, which is
written in full once before the first case (so every contender overwrites allocated blocks,
the steady state of an offload swap file) and reads read it back.

    python benchmarks/bench_io.py --quick                 # ~0.5 GB, one case, < 1 minute
    python benchmarks/bench_io.py --dir /mnt/nvme/tmp     # 4 GB over the default grid
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `offload` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks._common import (
    Progress,
    Samples,
    base_parser,
    interleave,
    machine_info,
    na_reasons,
    peer_reason,
    print_machine,
    print_table,
    ratio,
    write_json,
)
from offload.sizes import ALIGNMENT, parse_bytes
from offload.storage.io import AIOHandle, aligned_empty

GB = 1e9


def parse_size(text: str) -> int:
    """--size / --block-sizes in fio's notation, as the labels below write them: a bare K/M/G/T
    is binary (fio's default kb_base=1024), so '1M' is 1 MiB; anything else ('4GiB', '1e9',
    '500MB') as offload.sizes.parse_bytes reads it."""
    text = text.strip()
    return parse_bytes(text + "iB" if text[-1:].upper() in ("K", "M", "G", "T") else text)


def size_label(n: int) -> str:
    """A compact block-size label in fio's notation ('1M' = 1 MiB), for the table and the
    plot's axis (benchmarks/_report.py reads it back)."""
    for suffix, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)


# --------------------------------------------------------------------------------------------
# contenders: each returns GB/s of one transfer of the whole file


def offload_contender(buf: torch.Tensor, path: str, op: str, bs: int, qd: int, threads: int):
    handle = AIOHandle(block_size=bs, queue_depth=qd, threads=threads)

    def run() -> float:
        t0 = time.perf_counter()
        (handle.pwrite if op == "write" else handle.pread)(buf, path, offset=0).wait()
        return buf.numel() / (time.perf_counter() - t0) / GB

    return run, handle.close


def fio_contender(path: str, nbytes: int, op: str, bs: int, iodepth: int):
    cmd = [
        "fio", "--name=bench", f"--filename={path}", f"--rw={op}", f"--bs={bs}",
        f"--iodepth={iodepth}", "--ioengine=libaio", "--direct=1", f"--size={nbytes}",
        "--numjobs=1", "--fallocate=none", "--end_fsync=0", "--output-format=json",
    ]

    def run() -> float:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0][op]
        if job["io_bytes"] != nbytes:
            raise RuntimeError(f"fio moved {job['io_bytes']} of {nbytes} bytes")
        return job["bw_bytes"] / GB

    return run


class DeepSpeedPeer:
    """DeepSpeed's aio op, loaded once (JIT build). `error` says why it is unavailable."""

    def __init__(self) -> None:
        self.module = None
        self.error: Optional[str] = None
        try:
            import logging

            logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
            from deepspeed.ops.op_builder import AsyncIOBuilder

            builder = AsyncIOBuilder()
            if not builder.is_compatible(verbose=False):
                raise RuntimeError("AsyncIOBuilder is not compatible here (libaio-dev missing?)")
            from benchmarks.peer_ops import PeerNotReady, prepare

            why = prepare("async_io")  # built, announced, or dropped with the reason ([Note: peer builds])
            if why is not None:
                raise PeerNotReady(why)
            self.module = builder.load(verbose=False)
        except Exception as exc:  # any failure drops the peer, with the reason printed
            self.error = peer_reason(exc)

    def locked_buffer(self, nbytes: int) -> torch.Tensor:
        h = self.module.aio_handle(1 << 20, 8, False, True, 1)
        return h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))

    def contender(self, buf: torch.Tensor, path: str, op: str, bs: int, qd: int, threads: int):
        h = self.module.aio_handle(bs, qd, False, True, threads)

        def run() -> float:
            t0 = time.perf_counter()
            if op == "write":
                n = h.sync_pwrite(buf, path)
            else:
                n = h.sync_pread(buf, path)
            dt = time.perf_counter() - t0
            if n < 0:
                raise RuntimeError(f"deepspeed sync_p{op} returned {n}")
            return buf.numel() / dt / GB

        return run


def rotated_interleave(contenders: dict[str, Callable[[], float]], repeats: int,
                       desc: Optional[str] = None):
    """``interleave``, one round at a time, the order rotated each round (A B C, B C A, ...).

    On this kind of virtual disk a transfer slows the one right after it (the host is still
    flushing or refilling its cache), so a fixed order would always hand the same contender
    the worst slot.
    """
    names = list(contenders)
    merged = {name: Samples() for name in names}
    dropped: set[str] = set()
    bar = Progress(desc, repeats) if desc else None
    for r in range(repeats):
        k = r % len(names)
        order = [n for n in names[k:] + names[:k] if n not in dropped]
        got = interleave({n: contenders[n] for n in order}, 1)
        for n in order:
            if got[n].values:
                merged[n].values.extend(got[n].values)
            else:
                dropped.add(n)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return merged


# --------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="directory for the test file (default: a fresh folder in the "
                   "temp dir, $TMPDIR or /tmp, removed at the end; `python -m benchmarks` points "
                   "TMPDIR under its --out; not a tmpfs)")
    p.add_argument("--size", default=None,
                   help="file size; K/M/G are binary, as in fio (default 4G; --quick 512M)")
    p.add_argument("--block-sizes", default=None,
                   help="comma list; K/M/G are binary, as in fio (default 1M,4M; --quick 1M)")
    p.add_argument("--queue-depths", default=None, help="per thread (default 32; --quick 32)")
    p.add_argument("--threads", default=None, help="comma list (default 1,2; --quick 2)")
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--no-deepspeed", action="store_true")
    args = p.parse_args(argv)

    nbytes = parse_size(args.size or ("512M" if args.quick else "4G"))
    nbytes -= nbytes % ALIGNMENT
    block_sizes = [parse_size(s) for s in (args.block_sizes or ("1M" if args.quick else "1M,4M")).split(",")]
    depths = [int(s) for s in (args.queue_depths or "32").split(",")]
    thread_counts = [int(s) for s in (args.threads or ("2" if args.quick else "1,2")).split(",")]
    repeats = args.repeats or 3

    own_dir = args.dir is None
    work_dir = tempfile.mkdtemp(prefix="offload-bench-io-") if own_dir else args.dir
    path = os.path.join(work_dir, "bench_io.bin")
    info = machine_info(work_dir)
    info["file_bytes"] = nbytes
    print_machine(info)

    peers_note: dict[str, str] = {}
    fio_ok = not args.no_fio and shutil.which("fio") is not None
    if not fio_ok:
        peers_note["fio"] = ("fio not found on PATH (apt install fio)" if not args.no_fio
                             else "skipped (--no-fio)")
    ds = None if args.no_deepspeed else DeepSpeedPeer()
    if ds is None:
        peers_note["deepspeed"] = "skipped (--no-deepspeed)"
    elif ds.error:
        peers_note["deepspeed"] = ds.error
        ds = None
    for name, why in peers_note.items():
        print(f"  [{name}] dropped: {why}")

    # Each engine moves its own kind of buffer, as its users would: ours from aligned_empty
    # (page-aligned, on transparent huge pages), DeepSpeed's from its page-locked allocator
    # (its no-bounce path); fio uses its own. The same bytes go into both.
    pattern = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)

    def filled(buf: torch.Tensor) -> torch.Tensor:
        for at in range(0, nbytes, pattern.numel()):
            n = min(pattern.numel(), nbytes - at)
            buf[at : at + n].copy_(pattern[:n])
        return buf

    buf = filled(aligned_empty(nbytes, pin=False))
    ds_buf = filled(ds.locked_buffer(nbytes)) if ds is not None else None

    rows: list[dict[str, Any]] = []
    all_samples: list[dict[str, Any]] = []  # every measurement, GB/s, in run order
    try:
        # Write the whole file once, so reads read real data and writes overwrite.
        with AIOHandle(block_size=1 << 20, queue_depth=32, threads=2) as h:
            h.pwrite(buf, path).wait()
        os.sync()
        for bs in block_sizes:
            for qd in depths:
                for threads in thread_counts:
                    for op in ("write", "read"):
                        contenders: dict[str, Callable[[], float]] = {}
                        run, close = offload_contender(buf, path, op, bs, qd, threads)
                        contenders["offload"] = run
                        if fio_ok:
                            contenders["fio"] = fio_contender(path, nbytes, op, bs, qd * threads)
                        if ds is not None:
                            contenders["deepspeed"] = ds.contender(ds_buf, path, op, bs, qd, threads)
                        samples = rotated_interleave(contenders, repeats,
                                                     f"io {op} {size_label(bs)}/qd{qd}/t{threads}")
                        close()
                        contenders.clear()  # DeepSpeed's handle (and its threads) go now
                        med = {k: s.median for k, s in samples.items()}
                        peers = [v for k, v in med.items() if k != "offload" and v == v]
                        best_peer = max(peers) if peers else float("nan")
                        row = {
                            "case": f"{size_label(bs)}/qd{qd}/t{threads}",
                            "op": op, "block": size_label(bs), "qd": qd, "threads": threads,
                            "offload GB/s": med["offload"],
                            "fio GB/s": med.get("fio"),
                            "deepspeed GB/s": med.get("deepspeed"),
                            "vs fio": ratio(med["offload"], med.get("fio", float("nan"))),
                            "vs best peer": ratio(med["offload"], best_peer),
                        }
                        rows.append(row)
                        all_samples.append({"case": row["case"], "op": op,
                                            **{k: s.values for k, s in samples.items()}})
                        print(f"  {op:5s} bs={size_label(bs)} qd={qd} threads={threads}: " +
                              ", ".join(f"{k} {v:.2f}" for k, v in med.items() if v == v) +
                              " GB/s", flush=True)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
        if own_dir:
            shutil.rmtree(work_dir, ignore_errors=True)

    columns = ["op", "block", "qd", "threads", "offload GB/s", "fio GB/s", "deepspeed GB/s",
               "vs fio", "vs best peer"]
    # "vs best peer" is empty only when no peer ran: its reason is every peer's.
    ratio_peers = {"vs fio": "fio", "vs best peer": "best peer"}
    missing = dict(peers_note)
    if "fio" in peers_note and "deepspeed" in peers_note:
        missing["best peer"] = "no peer ran"
    print()
    print_table(rows, columns, na=na_reasons(ratio_peers, missing))
    summary = {}
    for op in ("write", "read"):
        mine = [r for r in rows if r["op"] == op]
        ours = max(r["offload GB/s"] for r in mine)
        peer = max((v for r in mine for k in ("fio GB/s", "deepspeed GB/s")
                    if (v := r.get(k)) is not None and v == v), default=float("nan"))
        summary[op] = {"offload_best_gb_per_s": ours, "best_peer_gb_per_s": peer,
                       "ratio": ratio(ours, peer)}
        if peer == peer:
            print(f"best setting, {op}: offload {ours:.2f} GB/s vs best peer {peer:.2f} GB/s "
                  f"-> {ratio(ours, peer):.2f}x (>1: offload faster)")
        else:
            why = "; ".join(f"{k}: {v}" for k, v in peers_note.items())
            print(f"best setting, {op}: offload {ours:.2f} GB/s; vs best peer n/a ({why})")
    write_json(args.json, {
        "machine": info, "rows": rows, "summary": summary, "samples": all_samples,
        "dropped": peers_note, "repeats": repeats,
        "peers_missing": missing, "ratio_peers": ratio_peers,
        "plot": {"x": "case", "y": "vs best peer", "group": "op",
                 "title": "offload / best peer, median sequential GB/s (1.0 = parity)"},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
