"""The same GPT in plain PyTorch (fp32 weights, bf16 autocast, torch.optim.AdamW): does it fit?

The baseline for the "model larger than RAM" run (docs/examples.md): train_gpt.py's model,
trained the way plain PyTorch trains it — fp32 parameters, `torch.autocast("cpu",
torch.bfloat16)` for forward and backward, `torch.optim.AdamW` — needs 16 bytes per
parameter of training state (weights 4, gradients 4, exp_avg 4, exp_avg_sq 4), all in host
memory. This script tries, stage by stage, and reports how far it got.

It runs under an address-space limit (`resource.setrlimit(RLIMIT_AS)`), set on itself
before the model is built, so running out of memory is a clean allocation failure
(`RuntimeError: DefaultCPUAllocator: can't allocate memory`, or `MemoryError`) that it
catches and reports — not the kernel's OOM killer, which on a shared machine may kill some
other process. Never run a large plain-PyTorch model without such a limit.

    python examples/plain_pytorch_oom.py --size 4b --seq 32 --batch 1
    python examples/plain_pytorch_oom.py --layers 2 --d-model 512 --mem-limit +96MiB   # tiny

--mem-limit: `auto` (default) = the smaller of the machine's RAM (MemTotal) and what is
available now (MemAvailable) less 3 GiB, so the attempt can never push other processes out
(a limit at MemTotal on a machine where others hold memory would leave the kernel's OOM
killer to decide; any limit below weights + gradients, 8 B/param, fails the same way);
a size (`20GiB`) = that much address space in all; `+SIZE` = SIZE above what the process has
mapped when the limit is set (after importing torch: its libraries and thread stacks).

Exit status: 0 = it trained (the model fits), 3 = out of memory (reported), anything else =
a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_gpt's helpers
import train_gpt  # noqa: E402,F401  (it puts a checkout's offload on sys.path)

from offload.models.gpt import GPT, GPT_PRESETS  # noqa: E402  (train_gpt.py's model)
from offload.sizes import GiB, format_bytes, parse_bytes  # noqa: E402  (GB = 10**9, GiB = 2**30)
from cli import size_arg  # noqa: E402  (examples/cli.py: every size flag reads the same forms)

EXIT_OOM = 3


def _proc_bytes(path: str, field: str) -> int:
    """A "Field:  N kB" line of a /proc file, in bytes."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{path} has no {field}")


def _status_bytes(field: str) -> int:
    return _proc_bytes("/proc/self/status", field)


def _meminfo_bytes(field: str) -> int:
    return _proc_bytes("/proc/meminfo", field)


def address_space_limit(spec: str) -> tuple[int, str]:
    """(bytes, how it was chosen) for --mem-limit."""
    if spec == "auto":
        total, avail = _meminfo_bytes("MemTotal"), _meminfo_bytes("MemAvailable")
        limit = min(total, avail - 3 * GiB)
        return limit, (f"auto: min(MemTotal {format_bytes(total)}, MemAvailable "
                       f"{format_bytes(avail)} - 3 GiB)")
    if spec.startswith("+"):
        mapped = _status_bytes("VmSize")
        return mapped + parse_bytes(spec[1:]), f"{format_bytes(mapped)} mapped + {spec[1:]}"
    return parse_bytes(spec), spec


def mem_limit_arg(text: str) -> str:
    """--mem-limit's forms, checked when the flag is read: auto, SIZE or +SIZE."""
    if text != "auto":
        size_arg(text[1:] if text.startswith("+") else text)
    return text


mem_limit_arg.__name__ = "mem-limit"  # argparse names the type in its message


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(GPT_PRESETS), default=None, help="train_gpt.py's presets")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4)")
    p.add_argument("--d-model", type=int, default=None, help="width (default 256)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    p.add_argument("--seq", type=int, default=32, help="sequence length, tokens")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--steps", type=int, default=2, help="training steps to try")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: fp32 weights + torch.autocast bf16 (PyTorch's mixed precision)")
    p.add_argument("--mem-limit", type=mem_limit_arg, default="auto",
                   help="address-space limit: auto, SIZE or +SIZE (e.g. 20GiB, +96MiB)")
    p.add_argument("--json", default=None, help="also write the outcome as JSON")
    args = p.parse_args(argv)
    preset = GPT_PRESETS[args.size] if args.size else (4, 256, 4)
    for name, value in zip(("layers", "d_model", "heads"), preset):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower()
                                              or "Cannot allocate memory" in text)


def main(argv=None) -> int:
    args = parse_args(argv)
    # One tiny training step before the limit: it starts torch's thread pool (a thread that
    # cannot get its stack is an abort, not an exception) and imports what torch imports
    # lazily (AdamW pulls in torch._dynamo: ~100 MB of address space), so that what fails
    # under the limit is the training state and nothing else.
    warm = GPT(64, 16, 1, 2, 8, qkv_bias=True, fp32_matmul=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
        warm_loss = warm(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    warm_loss.backward()
    torch.optim.AdamW(warm.parameters(), foreach=False).step()
    del warm, warm_loss
    limit, how = address_space_limit(args.mem_limit)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    n_est = 12 * args.layers * args.d_model**2 + (args.vocab + args.seq) * args.d_model
    print(f"plain PyTorch: GPT ~{n_est / 1e9:.2f}B parameters ({args.layers} layers, d_model "
          f"{args.d_model}, vocab {args.vocab}); fp32 weights, "
          f"{'bf16 autocast' if args.precision == 'bf16' else 'fp32'}, torch.optim.AdamW; training "
          f"state 16 B/param = {16 * n_est / 1e9:.1f} GB; machine RAM "
          f"{format_bytes(_meminfo_bytes('MemTotal'))}; address-space limit {format_bytes(limit)} "
          f"({how})", flush=True)

    outcome = {"params": None, "stage": None, "completed": [], "error": None, "limit_bytes": limit}
    t0 = time.perf_counter()
    state: dict = {}

    def stage(name: str, fn: Callable[[], None]) -> None:
        outcome["stage"] = name
        fn()
        outcome["completed"].append(name)
        print(f"  {name}: ok ({time.perf_counter() - t0:.1f} s, peak RSS "
              f"{format_bytes(_status_bytes('VmHWM'))})", flush=True)

    def build() -> None:
        torch.manual_seed(0)
        # fp32_matmul: the bf16 products run as fp32 GEMMs, as in train_gpt.py ([Note: CPU
        # bf16 matmuls]): the same arithmetic speed, so the two runs differ only in memory.
        state["model"] = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq, qkv_bias=True,
                             fp32_matmul=True)
        outcome["params"] = sum(p.numel() for p in state["model"].parameters())
        print(f"  model: {outcome['params'] / 1e9:.3f}B parameters, "
              f"{format_bytes(4 * outcome['params'])} of fp32 weights", flush=True)

    def optimizer() -> None:
        # foreach=False: no extra temporaries beyond the state itself (the fair best case).
        state["opt"] = torch.optim.AdamW(state["model"].parameters(), lr=3e-4, foreach=False)

    def train_step(i: int) -> Callable[[], None]:
        def run() -> None:
            g = torch.Generator().manual_seed(i)
            idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = state["model"](idx[:, :-1], idx[:, 1:])
            outcome["stage"] = f"step {i + 1} backward (fp32 gradients, 4 B/param)"
            loss.backward()
            outcome["stage"] = f"step {i + 1} optimizer (AdamW exp_avg + exp_avg_sq, 8 B/param)"
            state["opt"].step()
            state["opt"].zero_grad(set_to_none=False)  # as most loops keep them: 4 B/param stays
            print(f"  step {i + 1} loss {loss.item():.4f}", flush=True)
        return run

    try:
        stage("build the model (fp32 weights, 4 B/param)", build)
        stage("create torch.optim.AdamW", optimizer)
        for i in range(args.steps):
            stage(f"step {i + 1}", train_step(i))
    except (RuntimeError, MemoryError) as exc:
        if not is_oom(exc):
            raise
        state.clear()  # give the memory back before printing
        first_line = (str(exc).strip().splitlines() or ["(no message)"])[0]
        outcome["error"] = f"{type(exc).__name__}: {first_line}"
        print(f"OUT OF MEMORY at stage '{outcome['stage']}' after {time.perf_counter() - t0:.1f} s "
              f"(completed: {', '.join(outcome['completed']) or 'nothing'}):", flush=True)
        print(f"  {outcome['error']}", flush=True)
        print(f"peak RSS {format_bytes(_status_bytes('VmHWM'))}, address-space limit "
              f"{format_bytes(limit)}", flush=True)
        _write(args.json, outcome)
        return EXIT_OOM
    print(f"trained {args.steps} steps in plain PyTorch within {format_bytes(limit)}: the model fits "
          f"(peak RSS {format_bytes(_status_bytes('VmHWM'))})", flush=True)
    _write(args.json, outcome)
    return 0


def _write(path, outcome) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(outcome, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
