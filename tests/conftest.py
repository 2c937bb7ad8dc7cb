"""Shared test helpers: markers, skips, and what several test files need once."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import traceback
from typing import Any, Callable, Mapping, Sequence

import pytest
import torch

# One model for the tests, the benchmarks and the examples: offload/models/gpt.py, whose
# defaults are the tests' tiny GPT. The tests import it from here under these names.
from offload.models.gpt import GPT as TinyGPT
from offload.models.gpt import Block, SmallEmbedding, gpt_batches, lm_loss

__all__ = ["Block", "SmallEmbedding", "TinyGPT", "arithmetic_line", "check_torchrun_exit", "free_port",
           "gpt_batches", "lm_loss", "run_distributed"]


def arithmetic_line() -> str:
    """The arithmetic underneath this run: which CPU, which code paths torch and offload's
    Adam take on it (ATEN_CPU_CAPABILITY, MKL_CBWR, OFFLOAD_ADAM_ISA change them)."""
    from offload.optim import adam_isa

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
    except OSError:
        pass  # not Linux: the name is only informative
    env = " ".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OFFLOAD_ADAM_ISA")
                   if k in os.environ)
    return (f"cpu: {model}, {os.cpu_count()} cores; torch {torch.__version__} kernels "
            f"{torch.backends.cpu.get_cpu_capability()}; offload Adam kernel {adam_isa()}"
            + (f"; forced by {env}" if env else ""))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """How far inside its measured bound each parity comparison landed (tests/parity.py)."""
    from tests.parity import MARGINS

    terminalreporter.write_line(arithmetic_line())
    if not MARGINS:
        return
    worst = sorted(MARGINS, key=lambda m: m.ratio, reverse=True)
    terminalreporter.write_line(
        f"parity: {len(MARGINS)} comparisons against measured bounds; the closest (distance / bound):"
    )
    for m in worst[:5]:
        terminalreporter.write_line(f"  {m.ratio:.3f}  {m.what}  ({m.worst})")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


def pytest_collection_finish(session):
    """Start the type checker now, beside the tests, when its test will run: it is one
    process on one core for half a minute in a fresh clone ([Note: mypy beside the suite]
    in tests/test_types.py)."""
    if any(item.nodeid.endswith("test_types.py::test_mypy_passes_over_offload") for item in session.items):
        from tests.test_types import start_in_background

        start_in_background()


# -- a multi-process launcher ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# [Note: ranks forked from a preloaded server] Each `run_distributed` used to start its
# ranks with `spawn`: a fresh interpreter per rank importing torch, offload and (for the
# Hugging Face tests) transformers, ~1.7 s of both cores per call, over a hundred calls a
# suite run. The ranks now fork from multiprocessing's forkserver, which imported those once
# (`_PRELOAD`): the same fresh process state for the code under test (nothing of the test
# process is inherited: no threads, no process group, no CUDA), at a few milliseconds a rank.
# What a fork cannot give is an environment other than the server's, read at import time
# (ATEN_CPU_CAPABILITY, OFFLOAD_ADAM_ISA, ...): a call whose environment differs from the one
# the server started with spawns as before. Either way the worker runs with the caller's
# environment.
_PRELOAD = ["torch", "torch.distributed", "offload", "offload.engine", "tests.conftest", "tests.parity",
            "transformers", "accelerate", "peft"]
_SERVER_ENV: dict[str, str] = {}
_VOLATILE_ENV = ("PYTEST_CURRENT_TEST", "PYTORCH_NVML_BASED_CUDA_CHECK")
"""Set and changed while the suite runs, read only at run time (the worker applies the
caller's value): pytest's test name, and the CUDA availability check's mode, which
`import deepspeed` sets for the rest of the process (os.environ.setdefault). Compared, the
latter made every fork after the first DeepSpeed test fall back to a fresh interpreter."""


def _start_method() -> str:
    """'forkserver' while the environment is the server's (started here on first use), else
    'spawn' ([Note: ranks forked from a preloaded server])."""
    import importlib.util
    import multiprocessing

    env = {k: v for k, v in os.environ.items() if k not in _VOLATILE_ENV}
    if not _SERVER_ENV:
        multiprocessing.set_forkserver_preload(
            [m for m in _PRELOAD if importlib.util.find_spec(m.split(".")[0]) is not None])
        _SERVER_ENV.update(env)
        return "forkserver"
    return "forkserver" if env == _SERVER_ENV else "spawn"


def forkserver_env_diff(env: Mapping[str, str], ignore: Sequence[str] = ()) -> list[str]:
    """The names whose values differ between `env` and the preloaded server's import-time
    environment (set in one and not the other, or set to another value), but for the
    `ignore`d and volatile names; starts the server on first use ([Note: ranks forked from
    a preloaded server])."""
    _start_method()
    skip = set(_VOLATILE_ENV) | set(ignore)
    mine = {k: v for k, v in env.items() if k not in skip}
    server = {k: v for k, v in _SERVER_ENV.items() if k not in skip}
    return sorted(k for k in mine.keys() | server.keys() if mine.get(k) != server.get(k))


def forkserver_matches(env: Mapping[str, str], ignore: Sequence[str] = ()) -> bool:
    """Whether a process with environment `env` can fork from the preloaded server (its
    import-time environment is the server's, but for the `ignore`d names)."""
    return not forkserver_env_diff(env, ignore)


def server_environment() -> dict[str, str]:
    """A copy of the environment the preloaded server was started with (less the volatile
    names), starting it on first use."""
    _start_method()
    return dict(_SERVER_ENV)


def restore_environment(before: Mapping[str, str]) -> list[str]:
    """Puts os.environ back to `before` but for the volatile names; returns the names it
    changed back ([Note: each test's environment])."""
    changed = sorted(k for k in os.environ.keys() | before.keys()
                     if k not in _VOLATILE_ENV and os.environ.get(k) != before.get(k))
    for k in changed:
        if k in before:
            os.environ[k] = before[k]
        else:
            del os.environ[k]
    return changed


@pytest.fixture(autouse=True)
def _environment_kept():
    """[Note: each test's environment] A test that sets an environment variable in the
    suite's own process (directly, or through a library it imports) would change every
    later test: the run forks from the preloaded server only while os.environ is the
    server's, so one leaked name turns every later multi-rank test and script into a fresh
    interpreter, and a test that reads the name sees another's value. Whatever order the
    tests run in (pytest --random-order, docs/testing.md), each starts from the environment
    the previous one started from. The volatile names (`_VOLATILE_ENV`) are left as they are:
    `import deepspeed` sets one for the rest of the process, as it would in a user's."""
    before = dict(os.environ)
    yield
    restore_environment(before)


def _worker(
    rank: int, world_size: int, port: int, outdir: str, init_group: bool, fn: Callable, args: tuple,
    env: dict[str, str],
) -> None:
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        _save_atomic({"ok": True, "result": result}, outdir, rank)
    except BaseException:
        _save_atomic({"ok": False, "error": traceback.format_exc()}, outdir, rank)
        raise
    finally:
        if dist.is_initialized():
            from offload.units.collectives import settle_collectives

            settle_collectives()  # nothing of ours in flight when the group goes
            try:
                dist.barrier()  # leave together (see Engine.close)
            finally:
                dist.destroy_process_group()


def _save_atomic(obj: Any, outdir: str, rank: int) -> None:
    tmp = os.path.join(outdir, f"{rank}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, os.path.join(outdir, f"{rank}.pt"))


def run_distributed(
    fn: Callable, world_size: int, *args: Any, init_group: bool = True, timeout_s: float = 300
) -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` real processes (gloo over TCP on a
    free port); return each rank's result, or raise with the failing rank's traceback.
    The workers see torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
    with `init_group=False` they do not start the process group themselves, so the code
    under test must. `fn` must be importable (defined at a test module's top level)."""
    import time

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _worker, args=(world_size, free_port(), outdir, init_group, fn, args, dict(os.environ)),
            nprocs=world_size, join=False, start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:  # ours: started just above
                        if proc.is_alive():
                            proc.terminate()
                    raise TimeoutError(f"{fn.__name__} did not finish within {timeout_s} s")
        except Exception as exc:
            errors, done = [], 0
            for r in range(world_size):
                path = os.path.join(outdir, f"{r}.pt")
                if os.path.exists(path):
                    res = torch.load(path, weights_only=False)
                    if not res["ok"]:
                        errors.append(f"rank {r}:\n{res['error']}")
                    else:
                        done += 1
            # A process that died after returning its result (at exit) failed too.
            raise RuntimeError("\n".join(errors) or f"{exc} ({done} of {world_size} ranks "
                               "returned a result)") from None
        results = []
        for r in range(world_size):
            res = torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False)
            results.append(res["result"])
        return results


def check_torchrun_exit(proc: "subprocess.CompletedProcess", results_complete: bool, what: str) -> None:
    """Assert a torchrun launch succeeded: every rank exited 0 (an abort at interpreter exit
    is a failure too: [Note: collective tensors at exit] in offload/units/collectives.py)."""
    assert proc.returncode == 0 and results_complete, (
        f"{what}: exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )


# -- hypothesis profiles (tests/test_generated_structures.py) ---------------------------------
# `ci` (the default): the same examples on every run (derandomized), no example database,
# no deadline (a spawned world-size-2 example takes seconds). `long`: fresh random examples
# on every run; the tests scale their example counts by the profile
# (OFFLOAD_HYPOTHESIS_PROFILE=long python -m pytest -q tests/test_generated_structures.py).
try:
    from hypothesis import HealthCheck
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # the test extra installs it; without it only the generated tests fail to import
    pass
else:
    _slow_ok = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
    _hypothesis_settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                                          print_blob=True, suppress_health_check=_slow_ok)
    _hypothesis_settings.register_profile("long", derandomize=False, database=None, deadline=None,
                                          print_blob=True, suppress_health_check=_slow_ok)
    _hypothesis_settings.load_profile(os.environ.get("OFFLOAD_HYPOTHESIS_PROFILE", "ci"))
