"""Checkpoint save and load speed, against the disk and against torch.save / torch.load.

The question: does `engine.save_checkpoint` / `load_checkpoint` move a model's optimizer
state (fp32 master + two fp32 Adam moments, 12 bytes per parameter) at the speed of the
disk? Interleaved, repeated, medians, per round:

- offload save / load  `engine.save_checkpoint(dir, tag)` (O_DIRECT, checksummed chunks,
                       fsync, rename, `latest`) and `engine.load_checkpoint(dir, tag)`
                       (checksums verified, state handed back unit by unit).
- disk write / read    one `AIOHandle` pwrite (+ fsync) / pread of a file of the same size
                       from one page-aligned buffer: the disk's sequential bandwidth, measured
                       in the same run with the same I/O settings.
- torch.save / load    `torch.save(engine.optimizer.state_dict())` (the same tensors) + fsync,
                       and `torch.load` after the file's pages are dropped from the page cache
                       (posix_fadvise DONTNEED), so it reads from the disk as the others do.
- disk copy            (NVMe tier) a pread of the state's size from the engine's swap file
                       and, at the same time, a pwrite of a new file + fsync: what a save
                       from the NVMe tier must do at least, since the state is read from the
                       swap file on the same disk as it is written to the checkpoint.

GB/s counts the state's bytes (master + moments). The table ends with the ratios:
`vs disk` (target >= 0.8), `vs copy` (the NVMe save against the disk copy) and `vs torch`.

    python benchmarks/bench_checkpoint.py --quick                 # ~0.2 GB of state
    python benchmarks/bench_checkpoint.py --params 200M --dir /mnt/nvme/tmp
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `offload` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from benchmarks._common import (
    base_parser,
    interleave,
    machine_info,
    print_machine,
    print_table,
    ratio,
    write_json,
)

from offload.plan import parse_count  # noqa: E402  ('64M', '1.3B', '7e9')

GB = 1e9


class Stack(nn.Module):
    """`layers` square Linear blocks (each a unit) of about params / layers parameters."""

    def __init__(self, params: int, layers: int) -> None:
        super().__init__()
        d = max(64, int((params / layers) ** 0.5) // 64 * 64)
        self.blocks = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def build_engine(params: int, layers: int, tier: str, nvme_path: str | None):
    import offload
    from offload.config import Config, OffloadConfig

    with torch.device("meta"):
        model = Stack(params, layers)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.normal_()
    cfg = Config(compute_device="cpu", offload=OffloadConfig(optimizer_tier=tier, nvme_path=nvme_path))
    engine = offload.initialize(model, cfg)
    # Moments with real (incompressible, non-zero) values, written through the state
    # accessor so the NVMe tier gets them too.
    for unit in engine.units:
        with engine.optimizer.unit_state(unit.index) as s:
            state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        state["exp_avg"].normal_()
        state["exp_avg_sq"].uniform_()
        engine.optimizer.load_unit_state(unit.index, state)
    return engine


def state_bytes(engine) -> int:
    total = 0
    for unit in engine.units:
        with engine.optimizer.unit_state(unit.index) as s:
            total += sum(s[k].numel() * s[k].element_size() for k in ("master", "exp_avg", "exp_avg_sq"))
    return total


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def contenders(engine, nbytes: int, work: str) -> dict[str, Callable[[], float]]:
    from offload.storage.io import AIOHandle, aligned_empty

    aio = engine.config.aio
    handle = AIOHandle(block_size=aio.block_size, queue_depth=aio.queue_depth, threads=aio.threads)
    buf = aligned_empty(nbytes)
    buf.random_(0, 255)
    raw = os.path.join(work, "disk.bin")
    copy = os.path.join(work, "copy.bin")
    ckpt = os.path.join(work, "ckpt")
    tfile = os.path.join(work, "torch.pt")
    gbs = lambda t: nbytes / t / GB  # noqa: E731

    # Every round writes new files, as a training run writing a new tag does (the disk must
    # allocate blocks each time); the previous round's files are removed outside the timing.
    rounds = {"save": 0}

    def disk_write() -> float:
        t0 = time.perf_counter()
        handle.pwrite(buf, raw, 0).wait()
        fd = os.open(raw, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        return gbs(time.perf_counter() - t0)

    copy_from = {}

    def disk_copy() -> float:
        if "buf" not in copy_from:
            copy_from["buf"] = aligned_empty(nbytes)
        t0 = time.perf_counter()
        # from the swap file, as the save does (not `raw`: reading that would warm the
        # host's cache for the "disk read" reference that follows)
        read = handle.pread(copy_from["buf"], engine.optimizer.store.path, 0)
        write = handle.pwrite(buf, copy, 0)
        read.wait()
        write.wait()
        fd = os.open(copy, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        return gbs(time.perf_counter() - t0)

    def disk_read() -> float:
        t0 = time.perf_counter()
        handle.pread(buf, raw, 0).wait()
        return gbs(time.perf_counter() - t0)

    def offload_save() -> float:
        rounds["save"] += 1
        t0 = time.perf_counter()
        engine.save_checkpoint(ckpt, tag=f"round{rounds['save']}")
        return gbs(time.perf_counter() - t0)

    def offload_load() -> float:
        t0 = time.perf_counter()
        rounds["loaded"] = os.path.basename(engine.load_checkpoint(ckpt)[0])
        return gbs(time.perf_counter() - t0)

    def torch_save() -> float:
        t0 = time.perf_counter()
        torch.save(engine.optimizer.state_dict(), tfile)
        drop_cache(tfile)  # fsync (counted, as ours is) and evict for the load
        return gbs(time.perf_counter() - t0)

    def torch_load() -> float:
        drop_cache(tfile)
        t0 = time.perf_counter()
        torch.load(tfile, weights_only=False)
        return gbs(time.perf_counter() - t0)

    def remove(path: str) -> Callable[[], None]:
        def run() -> None:
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.unlink(path)

        return run

    def remove_saved() -> None:
        # Every tag but the one loaded last. With the NVMe tier that one is still being
        # read in place (docs/checkpoint.md): deleting it would only defer the freeing of
        # its blocks into the next round's timed load, when the engine lets go of it.
        if os.path.isdir(ckpt):
            for name in os.listdir(ckpt):
                if name != rounds.get("loaded") and os.path.isdir(os.path.join(ckpt, name)):
                    shutil.rmtree(os.path.join(ckpt, name))

    def settled(fn: Callable[[], float], prepare: Callable[[], None] = lambda: None) -> Callable[[], float]:
        # Each contender fsyncs what it wrote. On a virtual disk that flush also pushes out
        # whatever was left dirty before (the previous contender's files, the blocks freed
        # by deleting the last round's copy), so every timed run starts from a synced disk
        # (os.sync, outside the timing).
        def run() -> float:
            prepare()
            os.sync()
            return fn()

        return run

    out = {
        "disk write": settled(disk_write, remove(raw)),
        "offload save": settled(offload_save, remove_saved),
        "torch.save": settled(torch_save, remove(tfile)),
    }
    if not engine.optimizer.store.resident:
        out["disk copy"] = settled(disk_copy, remove(copy))
    out.update({
        "disk read": settled(disk_read), "offload load": settled(offload_load),
        "torch.load": settled(torch_load),
    })
    return out


def run_tier(args: Any, tier: str, params: int, repeats: int) -> list[dict[str, Any]]:
    work = tempfile.mkdtemp(prefix="offload-bench-ckpt-", dir=args.dir)
    try:
        nvme = os.path.join(work, "swap") if tier == "nvme" else None
        if nvme:
            os.makedirs(nvme)
        try:
            engine = build_engine(params, args.layers, tier, nvme)
        except NotImplementedError as exc:
            print(f"  tier {tier}: skipped ({exc})")
            return []
        nbytes = state_bytes(engine)
        print(f"tier {tier}: {sum(u.layout.numel for u in engine.units) / 1e6:.1f} M params, "
              f"{nbytes / GB:.2f} GB of optimizer state, {repeats} rounds")
        samples = interleave(contenders(engine, nbytes, work), repeats, desc=f"checkpoint {tier}")
        med = {k: v.median for k, v in samples.items()}
        for k, v in samples.items():
            print(f"  {k:13s} GB/s per round: " + " ".join(f"{x:.2f}" for x in v.values))
        engine.close()
        rows = []
        for op, ours, disk, peer in (("save", "offload save", "disk write", "torch.save"),
                                     ("load", "offload load", "disk read", "torch.load")):
            copy = med.get("disk copy") if op == "save" else None
            rows.append({
                "tier": tier, "op": op, "state GB": nbytes / GB,
                "offload s": nbytes / med[ours] / GB,
                "offload GB/s": med[ours], "disk GB/s": med[disk], "copy GB/s": copy,
                "torch GB/s": med[peer], "vs disk": ratio(med[ours], med[disk]),
                "vs copy": None if copy is None else ratio(med[ours], copy),
                "vs torch": ratio(med[ours], med[peer]),
            })
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="directory on the disk to test (default: the temp "
                   "dir, $TMPDIR or /tmp; `python -m benchmarks` points TMPDIR under its --out)")
    p.add_argument("--params", default=None, help="model parameters, e.g. 100M (default 100M; 16M with --quick)")
    p.add_argument("--layers", type=int, default=8, help="units the parameters are split into")
    p.add_argument("--tiers", default="cpu,nvme", help="optimizer tiers to test (nvme when it exists)")
    args = p.parse_args(argv)
    args.dir = args.dir or tempfile.gettempdir()  # each tier's files go in a folder made and removed in it
    params = parse_count(args.params or ("16M" if args.quick else "100M"))
    repeats = args.repeats or (3 if args.quick else 5)
    info = machine_info(args.dir)
    from offload._native import C

    info["crc32c_kernel"] = C.crc32c_kernel()
    print_machine(info)
    # The machine may be shared: the load average says how much the figures can be trusted.
    info["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average before: {info['load_average_before']}")
    rows: list[dict[str, Any]] = []
    for tier in args.tiers.split(","):
        rows += run_tier(args, tier.strip(), params, repeats)
    info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average after: {info['load_average_after']}")
    print("vs disk / vs copy / vs torch: our GB/s over theirs (>1 = offload faster); "
          "vs copy: nvme-tier saves only")
    print_table(rows, na={"vs copy": "only nvme-tier saves have a disk copy to compare"})
    write_json(args.json, {
        "machine": info, "rows": rows, "params": params, "repeats": repeats,
        "peers_missing": {}, "na_reasons": {"vs copy": "only nvme-tier saves have a disk copy to compare"},
        "plot": {"x": "op", "y": "offload GB/s", "group": "tier",
                 "title": "checkpoint save/load bandwidth"},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
