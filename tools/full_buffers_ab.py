"""A/B in one process: the 134M GPT with both tiers on NVMe at world size 1 on the CPU, its
full buffers from `FullBuffers` and shards read straight into them (as built) against the
CPU allocator and staged reads (the private torch calls switched off), and plain PyTorch;
interleaved rounds, medians of the per-round ratios, minor page faults per step.

    OMP_NUM_THREADS=2 python tools/full_buffers_ab.py ROUNDS NVME_DIR
"""
import os, resource, statistics, sys, time, torch, offload
import offload.units.shard as shard_mod
from offload.models.gpt import GPT
V = 64000
x = torch.randint(0, V, (4, 128), generator=torch.Generator().manual_seed(0))
def make():
    torch.manual_seed(0); return GPT(vocab=V, d_model=768, n_layer=12, n_head=12, seq=128)
def eng(name, pool):
    shard_mod.CAN_POINT = pool
    p = os.path.join(sys.argv[2] if len(sys.argv) > 2 else "/tmp/offload-ab", name); os.makedirs(p, exist_ok=True)
    e = offload.initialize(make(), {"compute_device": "cpu", "precision": {"dtype": "fp32"}, "gradient_clipping": 0.0,
        "offload": {"param_tier": "nvme", "optimizer_tier": "nvme", "nvme_path": p, "pinned_budget_bytes": 1 << 30}})
    shard_mod.CAN_POINT = True
    return e
m = make(); opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
def torch_step():
    loss = m(x, x); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
E = {"nvme_all reused+direct": eng("p", True), "nvme_all fresh+staged": eng("f", False)}
def estep(e):
    return lambda: (e.backward(e(x, x)), e.step())
C = {"torch": torch_step, **{k: estep(e) for k, e in E.items()}}
T = {k: [] for k in C}; F = {k: [] for k in C}
R = int(sys.argv[1]) if len(sys.argv) > 1 else 7
for r in range(R + 1):
    for k, f in C.items():
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t0 = time.perf_counter()
        f()
        t = time.perf_counter() - t0; df = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        if r: T[k].append(t); F[k].append(df)
base = statistics.median(T["torch"])
for k in C:
    print(f"{k:18s} step {statistics.median(T[k])*1e3:7.0f} ms  x torch {statistics.median([a/b for a, b in zip(T[k], T['torch'])]):.3f}  minor faults/step {statistics.median(F[k]):9.0f}")
for e in E.values(): e.close()
