"""`from_pretrained` of a checkpoint larger than the memory the process may use (issue 33):
a generated Llama-style safetensors checkpoint loaded with both tiers on NVMe by a process
in a memory cgroup whose limit is smaller than the checkpoint, with the peak resident
memory measured from the process's start and checked against the bound docs/hf.md states.

    python tools/load_under_limit.py --size 3.5GB --dir DIR --threads 1 --control whole   # docs/hf.md
    python tools/load_under_limit.py --size 3.5GB --dir DIR --threads 1 --steps 1         # + training
    python tools/load_under_limit.py --size 480MB --hidden 256 --vocab 2048 --control whole  # the test's

DIR must be on a local disk, not tmpfs (the swap files would be memory, charged to the
cgroup). What it does, in order:
1. writes the checkpoint (`write_checkpoint`): random weights, piece by piece (never the
   whole model in memory), shards with an index and a `config.json` that transformers'
   AutoConfig reads; then flushed and dropped from the page cache, so the load reads the disk.
2. makes a memory cgroup (`MemoryCgroup`: v2's memory.max where the machine has a v2 memory
   controller, v1's memory.limit_in_bytes otherwise; root is needed) and starts the child
   in it: `sh` puts itself in the cgroup and execs Python, so the child is limited and
   measured from its first instruction. The limit starts at the checkpoint's size.
3. the child imports everything the load uses (torch, transformers' Llama, accelerate,
   offload) and reports its high-water mark (VmHWM) so far: the *baseline*. The parent
   lowers the limit to baseline + the bound predicted from the checkpoint's shape (with
   `--steps`: or the training bound, if larger) + `--margin`, or to `--limit`; it must be
   below the checkpoint's size. Then the child goes on.
4. the child runs `offload.integrations.hf.from_pretrained` + `offload.initialize` with both
   tiers on NVMe, reads VmHWM (the load's peak *from process start*: it is never reset),
   computes the bound from the engine's own numbers (`load_bound`), checks a sample of
   weights bit for bit against the files (read here with plain reads, not with the code under
   test), and trains `--steps` steps (their peak against the training bound: the planner's
   host figure with the prefetch budgets + the batch's activations + slack).
5. the parent reports: checkpoint bytes, the limit, the baseline, the peak, the bound and
   its parts, the cgroup's own peak (which counts page cache too), whether the kernel
   OOM-killed the child, the times; it removes the cgroup and the files (`--keep` keeps them).

`--control whole` runs the same load with every tensor read before the first unit is filled
(the regression a state dict loaded whole would be), in the same cgroup under the same limit:
it is OOM-killed, so the limit is below what holding the checkpoint takes. `--control
transformers` runs transformers' own `from_pretrained`: transformers 5 leaves an fp32
checkpoint's weights in a private mapping of its files, paged in when first used (and
dropped again under pressure), so its load reads almost nothing and is no control for
memory held (docs/hf.md has the figures).
Exit status: 0 when the child finished within the limit and under the bound(s) with its
weights right, 1 otherwise, 2 when no memory cgroup can be made here (the reason is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/: memory_cgroup, llama_checkpoint
from memory_cgroup import CgroupUnavailable, MemoryCgroup  # noqa: E402
from memory_cgroup import read_text as _read  # noqa: E402
from llama_checkpoint import ITEMSIZE, LlamaShape, read_stored, shape_for, write_checkpoint  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20

SLACK_BYTES = 40 * MiB
"""The part of the bounds that is not a tensor the engine or the loader sizes: code imported
on the way (~8 MiB of file pages), the meta model's and the engine's Python objects (~0.15
MiB per unit), and what glibc keeps of freed heap blocks (those under its dynamic mmap
threshold, at most 32 MiB). Measured 1-30 MiB at every size tried (docs/hf.md); a
constant, not a share of the model: a loader that held a share of the checkpoint shows."""

_ITEMSIZE = ITEMSIZE


# -- the bound ---------------------------------------------------------------------------------


def load_bound(parts: dict[str, int]) -> int:
    """The host memory `from_pretrained` + `initialize` may add to the baseline, as
    docs/hf.md states it: the shards the engine keeps in host memory (`host`: none with both
    tiers on NVMe), the pinned staging pool (its budget), one unit's fp32 master while its
    values arrive, two full parameters as read (the one being read and the previous one,
    until the engine lets it go; each with its cast copy when the checkpoint's dtype is not
    the model's), one unit's shard in the compute dtype when that is not fp32 (the copy
    `publish` writes, in a reused full buffer: offload/units/shard.py), and `SLACK_BYTES`."""
    return (parts["host"] + parts["pinned_budget"] + parts["largest_master"]
            + 2 * parts["largest_param_read"] + parts["publish_copy"] + parts["slack"])


def predicted_parts(shape: LlamaShape, dtype: str, pinned_budget: int) -> dict[str, int]:
    """`load_bound`'s parts from the checkpoint's shape, before any engine exists (the child
    reports the engine's own, which the bound is checked with): units are the decoder
    layers and the root (embeddings, final norm, head)."""
    layer = shape.layer_numel()
    root = shape.numel() - layer * shape.num_hidden_layers
    largest_param = max(math.prod(s) for _, s in shape.tensors())
    return {"host": 0, "pinned_budget": pinned_budget, "largest_master": 4 * max(layer, root),
            "largest_param_read": largest_param * _ITEMSIZE[dtype],
            "publish_copy": 0 if dtype == "float32" else _ITEMSIZE[dtype] * max(layer, root),
            "slack": SLACK_BYTES}


def working_set_bytes(shape: LlamaShape, dtype: str) -> int:
    """One unit's pinned working set with both tiers on NVMe (offload/runtime/build.py
    `_check_nvme`): fp32 master and two fp32 moments, each page-aligned, and the
    page-aligned parameter shard in the compute dtype; the largest unit's."""
    def page(n: int) -> int:
        return -(-n // 4096) * 4096

    numel = max(shape.layer_numel(), shape.numel() - shape.layer_numel() * shape.num_hidden_layers)
    return 3 * page(4 * numel) + page(_ITEMSIZE[dtype] * numel) + 4096


def engine_config(dtype: str, nvme_path: str, pinned_budget: int) -> dict[str, Any]:
    """The engine's config: compute on the CPU in the checkpoint's dtype, AdamW, both tiers
    on NVMe, no clipping and `nonfinite_loss: off`, so the updates run in backward and the
    gradient shards are transient (the default guard holds them: docs/prefetch.md)."""
    return {"compute_device": "cpu", "nonfinite_loss": "off",
            "precision": {"dtype": {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]},
            "optimizer": {"lr": 1e-5, "weight_decay": 0.0},
            "offload": {"param_tier": "nvme", "optimizer_tier": "nvme", "nvme_path": nvme_path,
                        "pinned_budget_bytes": pinned_budget}}


def planned_training_bytes(shape: LlamaShape, dtype: str, nvme_path: str, pinned_budget: int) -> int:
    """What offload's memory planner says training this model takes in host memory on this
    CPU with both tiers on NVMe: host shards + the pinned pool + the working set of forward
    and backward (a CPU run's device memory is host memory), plus what its working set leaves
    out by its own account (offload/plan/tier_bytes.py `working_bytes`): up to
    `prefetch.prefetch_bytes + prefetch.keep_bytes` of full buffers read ahead and kept.
    Activations are not included (the planner leaves them to the user: docs/plan.md). From
    a meta model."""
    import torch
    import transformers

    from offload.config import Config
    from offload.plan import make_machine, plan

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_llama_config(shape, dtype, shape.num_hidden_layers))
    config = Config.from_dict(engine_config(dtype, nvme_path, pinned_budget))
    e = plan(model, machine=make_machine(cpu_mem=1 << 50, nvme_free=1 << 50),
             config=config).estimate("nvme", "nvme")
    return int(e.per_rank.host + e.per_rank.pinned + e.working_device_bytes
               + config.prefetch.prefetch_bytes + config.prefetch.keep_bytes)


def activation_bytes(shape: LlamaShape, dtype: str, seq: int) -> int:
    """The bytes autograd saves for backward in a forward of one `seq`-token sequence (the
    activations; the weights it saves are the engine's, counted by the planner): counted with
    saved-tensor hooks on plain 1- and 2-layer models of the same widths, the layers'
    share extrapolated to the model's depth (every layer saves the same)."""
    import torch
    import transformers

    def saved(layers: int) -> int:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(_llama_config(shape, dtype, layers)).to(getattr(torch, dtype))
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in weights:
                storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
            return t

        ids = torch.randint(0, shape.vocab_size, (1, seq))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
        return sum(storages.values())

    one, two = saved(1), saved(2)
    return one + (shape.num_hidden_layers - 1) * (two - one)


def _llama_config(shape: LlamaShape, dtype: str, layers: int) -> Any:
    import transformers

    fields = {k: v for k, v in shape.config_json(dtype).items() if k not in ("architectures", "model_type")}
    return transformers.LlamaConfig(**{**fields, "num_hidden_layers": layers})


# -- the child -------------------------------------------------------------------------------


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _bits(t: Any) -> Any:
    """`t`'s bytes as integers (bit-for-bit equality; a NaN equals itself)."""
    import torch

    return t.contiguous().view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize])


def _read_whole_first() -> None:
    """The regression the control injects: the checkpoint's source reads every tensor on its
    first read (as a state dict loaded whole, `safetensors.torch.load_file`, would) and
    hands them out from memory."""
    from offload.checkpoint.safetensors_dir import RenamedSource

    read_one = RenamedSource.get
    held: dict[str, Any] = {}
    done: list[bool] = []

    def get(self: RenamedSource, name: str) -> Any:
        if not done:
            done.append(True)
            held.update((n, read_one(self, n)) for n in self.key_of)
        return held.pop(name, None)

    RenamedSource.get = get  # type: ignore[method-assign]


def _child(spec: dict[str, Any]) -> None:
    """Runs in the cgroup: imports, reports the baseline, waits for the parent's go, loads,
    measures, checks, trains; one JSON line per phase on stdout."""
    import importlib

    import torch
    import transformers

    # what the load imports on its way, imported now so that the baseline holds the code
    for name in ("transformers.models.llama.modeling_llama", "accelerate"):
        importlib.import_module(name)

    import offload
    from offload.integrations.hf import from_pretrained

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    print(json.dumps({"baseline_hwm": _status_bytes("VmHWM"), "baseline_rss": _status_bytes("VmRSS")}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    if spec["mode"] == "transformers":  # a control: transformers' own loader
        reference = transformers.AutoModelForCausalLM.from_pretrained(spec["ckpt"], dtype="auto")
        out.update(load_s=time.perf_counter() - t0, load_hwm=_status_bytes("VmHWM"),
                   params=sum(p.numel() for p in reference.parameters()))
        print(json.dumps(out), flush=True)
        return
    model = from_pretrained(spec["ckpt"])
    model_dtype = next(iter(model.parameters())).dtype
    if spec["mode"] == "whole":  # a control: the regression of reading every tensor first
        _read_whole_first()
    engine = offload.initialize(model, offload.Config.from_dict(engine_config(spec["dtype"], spec["nvme"], spec["pinned"])))
    out["load_s"] = time.perf_counter() - t0
    out["load_hwm"] = _status_bytes("VmHWM")  # from the exec on: never reset
    itemsize, model_itemsize = _ITEMSIZE[spec["dtype"]], model_dtype.itemsize
    largest = max(p.numel() for p in engine.module.parameters())
    memory = engine.memory_bytes()
    out["parts"] = {
        "host": memory["host"],
        "pinned_budget": spec["pinned"],
        "largest_master": 4 * max(u.master_numel for u in engine.units),
        # as read, plus the cast to the model's dtype where they differ
        "largest_param_read": largest * (itemsize + (model_itemsize if model_itemsize != itemsize else 0)),
        "publish_copy": max((u.layout.shard_numel * u.dtype.itemsize for u in engine.units
                             if u.dtype != torch.float32), default=0),
        "slack": SLACK_BYTES,
    }
    out["pinned_reserved"] = memory["pinned"]
    out["units"] = len(engine.units)
    out["params"] = sum(p.numel() for p in engine.module.parameters())
    print(json.dumps(out), flush=True)  # as it goes: a kill later still leaves these
    # bit for bit against the files, one unit gathered at a time
    names = dict(engine.module.named_parameters())
    layers = spec["layers"]
    sample = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
              f"model.layers.{layers // 2}.mlp.down_proj.weight",
              f"model.layers.{layers - 1}.post_attention_layernorm.weight",
              "model.norm.weight", "lm_head.weight"]
    t1 = time.perf_counter()
    checked = {}
    for key in sample:
        want = read_stored(spec["ckpt"], key)
        with engine.gathered([names[key]]):
            got = names[key].detach()
            checked[key] = bool(got.dtype == want.dtype and got.shape == want.shape
                                and torch.equal(_bits(got), _bits(want)))
        del want
    out["checked"] = checked
    out["verify_s"] = time.perf_counter() - t1
    out["verify_hwm"] = _status_bytes("VmHWM")
    print(json.dumps(out), flush=True)
    if spec["steps"]:
        g = torch.Generator().manual_seed(0)
        engine.train()
        t2 = time.perf_counter()
        losses = []
        for _ in range(spec["steps"]):
            ids = torch.randint(0, spec["vocab"], (1, spec["seq"]), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            print(json.dumps({"losses": losses, "train_hwm": _status_bytes("VmHWM")}), flush=True)
        out.update(steps=spec["steps"], losses=losses, step_s=(time.perf_counter() - t2) / spec["steps"],
                   train_hwm=_status_bytes("VmHWM"), io=engine.io_stats())
    engine.close()
    out["end_hwm"] = _status_bytes("VmHWM")
    out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out), flush=True)


# -- the parent ------------------------------------------------------------------------------


CONTROLS = {
    "whole": "offload's load with every tensor read before the first unit is filled (a regression)",
    "transformers": "transformers' own from_pretrained",
}


def run_child(spec: dict[str, Any], cgroup: MemoryCgroup, limit_of: Any, timeout_s: float = 3600) -> dict[str, Any]:
    """Start the child in `cgroup`, set the limit to `limit_of(baseline_hwm)` once it has
    imported, and return what it reported plus the cgroup's figures: `killed` (by a
    signal), `oom_kills`, `cgroup_peak`, `limit`, `returncode`, `stderr` (its tail)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    oom_before = cgroup.oom_kills()
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cgroup.command(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env, cwd=ROOT)
        assert proc.stdin is not None and proc.stdout is not None
        result: dict[str, Any] = {}
        try:
            first = proc.stdout.readline()
            if first:
                result.update(json.loads(first))
                result["limit"] = int(limit_of(result["baseline_hwm"]))
                cgroup.set_limit(result["limit"])
                proc.stdin.write("go\n")
                proc.stdin.flush()
                for line in proc.stdout:
                    if line.startswith("{"):
                        result.update(json.loads(line))
            proc.wait(timeout=timeout_s)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            with contextlib.suppress(BrokenPipeError, OSError):
                proc.stdin.close()
        err.seek(0)
        result["stderr"] = err.read()[-4000:]
    result.update(returncode=proc.returncode, killed=proc.returncode < 0,
                  oom_kills=cgroup.oom_kills() - oom_before, cgroup_peak=cgroup.peak_bytes(),
                  wall_s=time.perf_counter() - t0)
    return result


def measure(*, size_bytes: int, workdir: str, dtype: str = "float32", hidden_size: int = 1024,
            vocab_size: int = 4096, pinned_bytes: Optional[int] = None, margin_bytes: int = 32 * MiB,
            limit_bytes: Optional[int] = None, steps: int = 0, seq: int = 32, threads: int = 0, controls: tuple[str, ...] = (),
            keep: bool = False, log: Any = None) -> dict[str, Any]:
    """The whole run (module docstring); returns the report as a dict. Raises
    CgroupUnavailable where no cgroup can be made, ValueError where the limit would not be
    below the checkpoint (a checkpoint too small for the baseline and bound)."""
    say = log or (lambda *a: None)
    shape = shape_for(size_bytes, dtype, hidden_size, vocab_size)
    pinned = pinned_bytes or -(-working_set_bytes(shape, dtype) * 5 // 4 // MiB) * MiB
    predicted = load_bound(predicted_parts(shape, dtype, pinned))
    os.makedirs(workdir, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="load-under-limit-", dir=workdir)
    ckpt, nvme = os.path.join(run_dir, "ckpt"), os.path.join(run_dir, "nvme")
    os.makedirs(nvme)
    report: dict[str, Any] = {"shape": asdict(shape), "dtype": dtype, "pinned_budget": pinned,
                              "predicted_bound": predicted}
    cgroup: Optional[MemoryCgroup] = None
    try:
        if steps:  # training takes more than loading: the limit leaves room for it
            report["planned_training"] = planned_training_bytes(shape, dtype, nvme, pinned)
            report["activations"] = activation_bytes(shape, dtype, seq)
            report["training_bound"] = report["planned_training"] + report["activations"] + SLACK_BYTES
        room = max(predicted, report.get("training_bound", 0))  # what the limit leaves above the baseline
        cgroup = MemoryCgroup(f"offload-load-{os.getpid()}-{int(time.time() * 1e3) % 10**9}")
        report["cgroup"] = f"v{cgroup.version} {cgroup.path}"
        t0 = time.perf_counter()
        report["checkpoint_bytes"] = ckpt_bytes = write_checkpoint(ckpt, shape, dtype)
        report["write_s"] = time.perf_counter() - t0
        say(f"checkpoint: {ckpt_bytes / 1e9:.2f} GB ({dtype}, {shape.numel() / 1e6:.0f}M parameters, "
            f"{shape.num_hidden_layers} layers of {shape.layer_numel() / 1e6:.1f}M) in {report['write_s']:.1f} s")

        def limit_of(baseline: int) -> int:
            limit = limit_bytes if limit_bytes is not None else baseline + room + margin_bytes
            if limit >= ckpt_bytes:
                raise ValueError(
                    f"the limit {limit / MiB:.0f} MiB (baseline {baseline / MiB:.0f} MiB + bound "
                    f"{room / MiB:.0f} MiB + margin) is not below the checkpoint's "
                    f"{ckpt_bytes / MiB:.0f} MiB: ask for a larger --size or a smaller --hidden")
            return limit

        cgroup.set_limit(ckpt_bytes)  # until the baseline is known: already below the checkpoint
        spec = {"mode": "offload", "ckpt": ckpt, "nvme": nvme, "pinned": pinned, "dtype": dtype,
                "steps": steps, "seq": seq, "threads": threads, "vocab": vocab_size, "layers": shape.num_hidden_layers}
        run = run_child(spec, cgroup, limit_of)
        report["offload"] = run
        if "parts" in run:
            run["bound"] = load_bound(run["parts"])
            run["load_increase"] = run["load_hwm"] - run["baseline_hwm"]
            run["within_bound"] = run["load_increase"] <= run["bound"]
        if "train_hwm" in run:
            run["train_increase"] = run["train_hwm"] - run["baseline_hwm"]
            run["within_bound"] = run["within_bound"] and run["train_increase"] <= report["training_bound"]
        for mode in controls:  # the same cgroup, the same limit
            say(f"control {mode!r}: {CONTROLS[mode]}, under the same limit")
            limit = run.get("limit", limit_bytes)
            report[mode] = run_child({**spec, "mode": mode}, cgroup,
                                     lambda baseline: limit if limit is not None else limit_of(baseline))
        return report
    finally:
        if cgroup is not None:
            cgroup.remove()
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            report["kept"] = run_dir


def _mb(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / MiB:,.0f} MiB"


def _print_report(r: dict[str, Any]) -> bool:
    run = r.get("offload", {})
    print(f"machine: {_cpu()}, {os.cpu_count()} cores, {_read('/proc/meminfo', '').split()[1]} kB memory; "
          f"cgroup {r.get('cgroup')}")
    print(f"checkpoint: {r['checkpoint_bytes'] / 1e9:.2f} GB {r['dtype']}, {r['shape']}")
    if "limit" not in run:
        print(f"the child did not start: rc {run.get('returncode')}\n{run.get('stderr', '')}")
        return False
    ok = bool(run.get("within_bound")) and not run["killed"] and all(run.get("checked", {}).values())
    print(f"limit {_mb(run['limit'])} ({run['limit'] / r['checkpoint_bytes']:.2f} of the checkpoint); "
          f"baseline (imports) {_mb(run['baseline_hwm'])}")
    if "parts" in run:
        p = run["parts"]
        print(f"loaded {run['params'] / 1e6:.0f}M parameters in {run['units']} units in {run['load_s']:.1f} s; "
              f"peak RSS from process start {_mb(run['load_hwm'])} = baseline + {_mb(run['load_increase'])}; "
              f"bound {_mb(run['bound'])} (pinned {_mb(p['pinned_budget'])} + one unit's master "
              f"{_mb(p['largest_master'])} + 2 x {_mb(p['largest_param_read'])} + publish copy "
              f"{_mb(p['publish_copy'])} + host {_mb(p['host'])} + slack {_mb(p['slack'])}): {'within' if run['within_bound'] else 'OVER'}")
        print(f"weights checked bit for bit: {sum(run['checked'].values())}/{len(run['checked'])}; "
              f"peak RSS after checking {_mb(run['verify_hwm'])}")
        if run.get("steps"):
            print(f"{run['steps']} training step(s): {run['step_s']:.1f} s each, losses "
                  f"{[round(x, 4) for x in run['losses']]}; peak RSS from process start {_mb(run['train_hwm'])} "
                  f"= baseline + {_mb(run['train_increase'])}; bound {_mb(r['training_bound'])} (the planner's "
                  f"{_mb(r['planned_training'])} with prefetch and kept buffers + activations {_mb(r['activations'])} + slack)"
                  f": {'within' if run['train_increase'] <= r['training_bound'] else 'OVER'}")
        print(f"peak RSS at the end {_mb(run.get('end_hwm'))}; cgroup peak usage (page cache too) "
              f"{_mb(run['cgroup_peak'])}; child wall {run['wall_s']:.1f} s")
    if run["killed"] or run["returncode"]:
        print(f"the child failed: rc {run['returncode']}, OOM kills {run['oom_kills']}\n{run['stderr']}")
        ok = False
    for mode in CONTROLS:
        ctl = r.get(mode)
        if ctl is None:
            continue
        fate = (f"OOM-killed (rc {ctl['returncode']}, {ctl['oom_kills']} kill(s))" if ctl["oom_kills"] else
                f"finished, peak RSS {_mb(ctl.get('load_hwm'))} = baseline + "
                f"{_mb(ctl.get('load_hwm', 0) - ctl.get('baseline_hwm', 0))}" if ctl["returncode"] == 0 else
                f"failed: rc {ctl['returncode']}\n{ctl['stderr']}")
        print(f"control {mode!r} ({CONTROLS[mode]}) under {_mb(ctl.get('limit'))}: {fate}; "
              f"cgroup peak {_mb(ctl['cgroup_peak'])}")
        if mode == "whole" and not ctl["oom_kills"]:
            print("the limit did not stop a loader holding the whole checkpoint: it is too high to show anything")
            ok = False
    return ok


def _cpu() -> str:
    for line in _read("/proc/cpuinfo", "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main(argv: Optional[list[str]] = None) -> int:
    from offload.sizes import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="3.5GB", help="checkpoint size (default 3.5GB)")
    p.add_argument("--dtype", default="float32", choices=sorted(_ITEMSIZE))
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (units are layers of ~12.3x its square)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dir", default=None, help="where the checkpoint and swap files go (a local disk, "
                   "not tmpfs; default: a temporary directory under the current one)")
    p.add_argument("--pinned", default=None, help="pinned staging budget (default: 1.25 x one unit's working set)")
    p.add_argument("--limit", default=None, help="the cgroup's limit (default: baseline + predicted bound + margin)")
    p.add_argument("--margin", default="32MiB", help="added to baseline + bound for the default limit")
    p.add_argument("--steps", type=int, default=0, help="training steps after the load (default 0)")
    p.add_argument("--control", action="append", default=[], choices=sorted(CONTROLS),
                   help="also run this under the same limit (repeatable): " +
                   "; ".join(f"{k}: {v}" for k, v in CONTROLS.items()))
    p.add_argument("--threads", type=int, default=0, help="torch's intra-op threads in the child (default: "
                   "torch's own; 1 where other work shares the cores: OpenMP's barriers spin when one is taken)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and swap files")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        _child(json.loads(args.child))
        return 0
    try:
        report = measure(size_bytes=parse_bytes(args.size), workdir=args.dir or os.getcwd(), dtype=args.dtype,
                         hidden_size=args.hidden, vocab_size=args.vocab,
                         pinned_bytes=parse_bytes(args.pinned) if args.pinned else None,
                         margin_bytes=parse_bytes(args.margin),
                         limit_bytes=parse_bytes(args.limit) if args.limit else None,
                         steps=args.steps, threads=args.threads, controls=tuple(args.control), keep=args.keep, log=print)
    except CgroupUnavailable as exc:
        print(f"skipped: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a size or limit that cannot show the point: one line, the fix in it
        print(f"load_under_limit: {exc}", file=sys.stderr)
        return 2
    ok = _print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
