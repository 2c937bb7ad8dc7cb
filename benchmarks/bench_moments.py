"""The optimizer tier on NVMe with fp32, bf16 and 8-bit Adam moments: bytes read and written
per step and parameter, and the step time, the three engines interleaved in one process.

    OMP_NUM_THREADS=2 python -m benchmarks.bench_moments --layers 8 --d-model 768 --nvme-path DIR

An NVMe-tier step reads and writes each unit's master and moments once: 4 + 8 B/param with
fp32 moments, 4 + 4 with bf16, 4 + 2.03 with 8-bit (one byte per moment and an fp32 scale per
256 elements: docs/adam.md). Parameters stay in RAM (bf16), so the bytes are the optimizer's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import offload
from offload.models.gpt import GPT

MOMENTS = ("fp32", "bf16", "8bit")


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="GPT blocks")
    p.add_argument("--d-model", type=int, default=768, help="model width (heads of 64)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (of 128 tokens)")
    p.add_argument("--steps", type=int, default=5, help="steps per engine (the first is dropped)")
    p.add_argument("--nvme-path", required=True, help="directory on the disk to measure")
    p.add_argument("--pinned-budget-mb", type=int, default=1024, help="offload.pinned_budget_bytes in MiB")
    a = p.parse_args(argv)
    x = torch.randint(0, a.vocab, (a.batch, 128))

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(vocab=a.vocab, d_model=a.d_model, n_layer=a.layers, n_head=a.d_model // 64, seq=128)

    engines = {}
    for m in MOMENTS:
        path = os.path.join(a.nvme_path, m)
        os.makedirs(path, exist_ok=True)
        engines[m] = offload.initialize(model(), {
            "compute_device": "cpu", "precision": {"dtype": "bf16"}, "gradient_clipping": 0.0,
            "optimizer": {"moments_dtype": m, "lr": 1e-4},
            "offload": {"param_tier": "cpu", "optimizer_tier": "nvme", "nvme_path": path,
                        "pinned_budget_bytes": a.pinned_budget_mb << 20}})
    n = sum(p.numel() for p in model().parameters())
    rows: dict[str, dict[str, list[float]]] = {m: {"s": [], "read": [], "written": []} for m in MOMENTS}
    try:
        for step in range(a.steps):
            for m, e in engines.items():  # interleaved: each round runs every contender once
                before, t0 = e.io_stats(), time.perf_counter()
                e.backward(e(x, x))
                e.step()
                t, after = time.perf_counter() - t0, e.io_stats()
                if step:
                    rows[m]["s"].append(t)
                    rows[m]["read"].append((after["bytes_read"] - before["bytes_read"]) / n)
                    rows[m]["written"].append((after["bytes_written"] - before["bytes_written"]) / n)
    finally:
        for e in engines.values():
            e.close()
    out = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in rows.items()}
    print(f"{n / 1e6:.1f}M parameters, optimizer on NVMe, medians of {a.steps - 1} interleaved steps")
    print("moments  step ms  read B/param  written B/param  bytes vs fp32")
    for m, r in out.items():
        print(f"{m:7s}  {r['s'] * 1e3:7.0f}  {r['read']:12.2f}  {r['written']:15.2f}  "
              f"{(r['read'] + r['written']) / (out['fp32']['read'] + out['fp32']['written']):13.2f}")
    return out


if __name__ == "__main__":
    main()
