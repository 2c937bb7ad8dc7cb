"""Measuring a machine profile (offload/plan/profile.py): `python -m offload.plan --measure`.

Each figure is the median of a few timed samples after one untimed warm-up, each sample
repeating the operation for at least `SAMPLE_S` ([Note: samples long enough]: on a machine
shared with other work a single short call measures a burst, not the rate a step gets), on
buffers large enough to leave the caches (the full sizes; `quick` uses small ones, for tests and a
first look: its rates are rougher). The whole profile takes under a minute on a laptop. The
optimizer and the disk are measured with the engine's own code: the native Adam kernels
(`adam_step_flat`, `adam8bit_step_flat`) at each thread count, and `offload.storage.io`'s
AIO engine with O_DIRECT at the tiers' block size on a file under `nvme_path`.

A machine shared with other work measures slower than it is when idle, and the figures say
what the step will get on the machine as it was: measure when the machine is as it will be
during training.
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import datetime, timezone
from typing import Callable, Optional

import torch

from offload.plan.profile import Figure, MachineProfile, MatmulRate, OptimizerRate, fingerprint, hardware_text

__all__ = ["measure_profile", "thread_counts"]

MATMUL_SIZES = (256, 512, 1024, 2048)
"""d_model values the CPU matmul rate is measured at (the model interpolates between)."""


SAMPLE_S = 0.25
"""[Note: samples long enough] Each timed sample repeats the operation for at least this
long (`quick`: a fifth): a rate is then the machine's over a scheduler's many time slices,
as a training step sees it, not one lucky burst on a shared machine (measured here with
other work running: single calls of a 10 ms matmul varied 9x between runs)."""


def _median_time(fn: Callable[[], object], reps: int, sync: Callable[[], None] = lambda: None,
                 min_s: float = SAMPLE_S) -> float:
    """Seconds per call of `fn`: the median of `reps` samples, each as many calls as fill
    `min_s`, after one untimed warm-up call."""
    t0 = time.perf_counter()
    fn()  # warm-up: page faults, first-touch, kernel selection
    sync()
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, int(min_s / once))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def thread_counts(cores: int) -> tuple[int, ...]:
    """1, powers of two below `cores`, and `cores`."""
    out = {1, cores}
    t = 2
    while t < cores:
        out.add(t)
        t *= 2
    return tuple(sorted(out))


def _host_bandwidth(quick: bool) -> Figure:
    n = (32 if quick else 256) << 20
    src = torch.ones(n // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), 3 if quick else 5, min_s=SAMPLE_S / 5 if quick else SAMPLE_S)
    return Figure(value=2 * n / t / 1e9, unit="GB/s",
                  method=f"torch copy_ of {n >> 20} MiB fp32, bytes read + written / median of "
                         f"{3 if quick else 5} samples of >= {SAMPLE_S / 5 if quick else SAMPLE_S:g} s")


def _parallel_op(quick: bool, host_gbps: float) -> Figure:
    """[Note: the cost of a launch] A CPU kernel on more elements than one thread's grain
    (torch: 32768) runs on all of torch's threads and returns when the last one finishes.
    On an idle machine that costs microseconds beyond the bytes; on one where other work
    keeps the cores busy, each launch waits until the scheduler runs every one of its
    threads: measured here under load, an add of 65K elements took 27 ms, the same add of
    16K (one thread) 7 us. A step launches a few dozen such kernels per unit, so this is
    measured apart from bandwidth: the mean time of a 256K-element add, less its bytes at
    the host bandwidth, each call after a 0.5 ms pause as a step has Python between its
    kernels (the pause lets the threads go idle; back to back, a busy machine's launch
    measured 1-4 ms, with pauses 22 ms: a step's launches are the paused kind)."""
    n = 1 << 18
    x, y = torch.randn(n), torch.randn(n)
    torch.add(x, y, out=x)
    samples = []
    for _ in range(3 if quick else 5):
        busy, calls, t0 = 0.0, 0, time.perf_counter()
        while time.perf_counter() - t0 < (SAMPLE_S / 5 if quick else SAMPLE_S) or calls < 3:
            time.sleep(0.0005)
            a = time.perf_counter()
            torch.add(x, y, out=x)
            busy += time.perf_counter() - a
            calls += 1
        samples.append(busy / calls)
    latency = max(statistics.median(samples) - 12 * n / (host_gbps * 1e9), 1e-6)
    return Figure(value=latency, unit="s", method=f"torch.add of {n} fp32 elements on {torch.get_num_threads()} "
                  "thread(s), each after a 0.5 ms pause; median of the samples' mean time per call, less "
                  "its 12 B/element at the host bandwidth")


def _optimizer_rates(quick: bool, cores: int) -> tuple[OptimizerRate, ...]:
    from offload.optim.adam8bit import Moments8bit, adam8bit_step_flat
    from offload.optim.functional import adam_step_flat

    n = (1 if quick else 8) << 20
    reps = 2 if quick else 3
    master = torch.randn(n)
    grad = torch.randn(n) * 1e-3
    out = []
    state: dict[str, tuple[torch.Tensor, ...]] = {
        "fp32": (torch.zeros(n), torch.zeros(n)),
        "bf16": (torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)),
        "8bit": tuple(Moments8bit.zeros(n)),
    }
    for moments, tensors in state.items():
        for threads in thread_counts(cores):
            step = [0]

            def run(moments: str = moments, t: tuple[torch.Tensor, ...] = tensors, threads: int = threads) -> None:
                step[0] += 1
                if moments == "8bit":
                    adam8bit_step_flat(master, grad, t[0], t[1], t[2], t[3], step=step[0], lr=1e-4, beta1=0.9,
                                       beta2=0.999, eps=1e-8, weight_decay=0.01, threads=threads)
                else:
                    adam_step_flat(master, grad, t[0], t[1], step=step[0], lr=1e-4, beta1=0.9, beta2=0.999,
                                   eps=1e-8, weight_decay=0.01, threads=threads)

            t = _median_time(run, reps, min_s=SAMPLE_S / 5 if quick else SAMPLE_S)
            out.append(OptimizerRate(moments=moments, threads=threads, rate=Figure(
                value=n / t, unit="elements/s",
                method=f"native Adam step ({moments} moments, fp32 master and gradient) on {n >> 20}M "
                       f"elements, {threads} thread(s), median of {reps} samples of >= {SAMPLE_S / 5 if quick else SAMPLE_S:g} s")))
    return tuple(out)


def _matmul_rates(device: torch.device, quick: bool, dtypes: tuple[str, ...],
                  launch_s: float = 0.0) -> tuple[MatmulRate, ...]:
    """FLOP/s at each size, the launch latency (`launch_s`, the CPU's `parallel_op`) taken
    out of each call's time: the model charges it per call apart."""
    sizes = MATMUL_SIZES[:2] if quick else MATMUL_SIZES
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for dt in dtypes:
        torch_dt = torch.float32 if dt == "fp32" else torch.bfloat16
        for d in sizes:
            tokens = 512 if quick else 2048
            if device.type == "cuda":
                tokens = 8192
            a = torch.randn(tokens, d, device=device).to(torch_dt)
            b = torch.randn(d, 4 * d, device=device).to(torch_dt)
            reps = 2 if quick else 3
            t = _median_time(lambda: torch.mm(a, b), reps, sync, SAMPLE_S / 5 if quick else SAMPLE_S)
            work = max(t - launch_s, 0.05 * t)
            out.append(MatmulRate(device=device.type, dtype=dt, d_model=d, rate=Figure(
                value=2 * tokens * d * 4 * d / work, unit="FLOP/s",
                method=f"torch.mm ({tokens} x {d}) @ ({d} x {4 * d}) in {dt}, {torch.get_num_threads()} "
                       f"torch thread(s), 2mnk / (median of {reps} samples of >= {SAMPLE_S / 5 if quick else SAMPLE_S:g} s "
                       f"per call" + (f", less the launch latency {launch_s:.3g} s)" if launch_s else ")"))))
    return tuple(out)


def _nvme(path: str, block_size: int, quick: bool) -> tuple[Figure, Figure]:
    from offload.storage.io import AIOHandle, aligned_empty

    n = (16 if quick else 256) << 20
    reps = 2 if quick else 3
    os.makedirs(path, exist_ok=True)
    f = os.path.join(path, f"offload-profile-{os.getpid()}.bin")
    buf = aligned_empty(n)
    buf.fill_(1)
    w, r = [], []
    direct = True
    try:
        with AIOHandle(block_size, 32, 2) as h:
            req = h.pwrite(buf, f, 0)  # the first write allocates the file's blocks: not timed
            req.wait()
            direct = bool(req.direct)
            for _ in range(reps):
                t0 = time.perf_counter()
                h.pwrite(buf, f, 0).wait()
                w.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                h.pread(buf, f, 0).wait()
                r.append(time.perf_counter() - t0)
    finally:
        if os.path.exists(f):
            os.unlink(f)
    how = (f"offload.storage.io AIOHandle, {'O_DIRECT' if direct else 'BUFFERED (O_DIRECT refused: the page cache)'}"
           f", block {block_size} B, queue depth 32, 2 threads, {n >> 20} MiB file under {path}, median of {reps}")
    return (Figure(value=n / statistics.median(r) / 1e9, unit="GB/s", method="read: " + how),
            Figure(value=n / statistics.median(w) / 1e9, unit="GB/s", method="overwrite: " + how))


def _gpu(quick: bool) -> dict[str, object]:
    dev = torch.device("cuda")
    n = (64 if quick else 512) << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)
    sync = torch.cuda.synchronize
    reps = 3
    h2d = _median_time(lambda: gpu.copy_(host, non_blocking=True), reps, sync)
    d2h = _median_time(lambda: host.copy_(gpu, non_blocking=True), reps, sync)
    how = f"{n >> 20} MiB pinned host buffer, copy_ non_blocking + synchronize, median of {reps}"
    free, _total = torch.cuda.mem_get_info(dev)
    del gpu
    return {
        "h2d": Figure(value=n / h2d / 1e9, unit="GB/s", method="host to device: " + how),
        "d2h": Figure(value=n / d2h / 1e9, unit="GB/s", method="device to host: " + how),
        "gpu_matmul": _matmul_rates(dev, quick, ("bf16",)),
        "gpu_free_bytes": Figure(value=float(free), unit="bytes", method="torch.cuda.mem_get_info"),
        "gpu_name": torch.cuda.get_device_name(dev),
    }


def measure_profile(*, nvme_path: Optional[str] = None, block_size: int = 1 << 20,
                    quick: bool = False) -> MachineProfile:
    """Measure this machine (see the module docstring). `nvme_path`: a directory on the disk
    the NVMe tiers will use (None: no NVMe figures); `block_size`: the tiers' `aio.block_size`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    absent = []
    kw: dict[str, object] = {}
    if nvme_path:
        kw["nvme_read"], kw["nvme_write"] = _nvme(nvme_path, block_size, quick)
        kw["nvme_block_size"], kw["nvme_path"] = block_size, nvme_path
    else:
        absent.append("no nvme_path: no NVMe figures (give --nvme-path DIR)")
    if torch.cuda.is_available():
        kw.update(_gpu(quick))
    else:
        absent.append("no GPU: no host-device copies, GPU matmul or GPU memory (compute on the CPU)")
    host = _host_bandwidth(quick)
    launch = _parallel_op(quick, host.value)
    return MachineProfile(
        fingerprint=fingerprint(nvme_path), hardware=hardware_text(nvme_path),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), quick=quick,
        cpu_threads=cores, host_bandwidth=host, parallel_op=launch,
        optimizer=_optimizer_rates(quick, cores),
        # back to back, a matmul's launch is the hot kind (threads spinning): nothing taken out
        cpu_matmul=_matmul_rates(torch.device("cpu"), quick, ("fp32", "bf16")),
        absent=tuple(absent), **kw)  # type: ignore[arg-type]
