"""Running a user-facing script (an example, the benchmark suite) as its own process, forked
from the suite's preloaded server instead of a fresh interpreter.

[Note: scripts forked from the preloaded server] Each example or benchmark run used to be a
`subprocess.run([python, script, ...])`: a fresh interpreter importing torch, offload and,
for the Hugging Face examples, transformers, 1.5-3.5 s of a core each, some forty times a
suite run. `run_python` forks the process instead from multiprocessing's forkserver, the one
`run_distributed` uses ([Note: ranks forked from a preloaded server] in tests/conftest.py),
which imported those once. The script still runs in a process of its own, as `__main__`,
with its own argv, environment, working directory and file descriptors 1 and 2 (captured
to files), and exits through the interpreter's exit path: atexit handlers and weakref
finalizers run (the engine's swap-file cleanup and exit drain are among them), and the exit
status is what `python script.py` gives (`sys.exit(msg)`: the message on stderr, status 1;
an uncaught exception: its traceback, status 1).

What a fork cannot give is an import-time setting other than the server's (the environment
read when torch or offload is imported: ATEN_CPU_CAPABILITY, OFFLOAD_ADAM_ISA, ...): a call
whose environment differs from the server's in anything but `OMP_NUM_THREADS` (applied with
`torch.set_num_threads`) and `PYTHONPATH` (the repository is already on the path) runs as a
fresh interpreter, as before. Launchers (`torchrun`) and signal tests keep real subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Mapping, Sequence

from tests.conftest import forkserver_matches

__all__ = ["run_python"]

_IGNORED_ENV = ("OMP_NUM_THREADS", "PYTHONPATH")


def run_python(args: Sequence[str], *, env: Mapping[str, str], cwd: str, timeout: float
               ) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`, forked
    from the preloaded server where the environment allows (see the note). `args` is a
    script path or `-m module`, then its arguments."""
    cmd = [sys.executable, *args]
    if not forkserver_matches(env, ignore=_IGNORED_ENV):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(env), cwd=cwd)
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory() as outdir:
        proc = ctx.Process(target=_script, args=(list(args), dict(env), cwd, outdir))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()  # ours: started just above
            proc.join()
            raise subprocess.TimeoutExpired(cmd, timeout, *_read(outdir))
        out, err = _read(outdir)
    return subprocess.CompletedProcess(cmd, proc.exitcode, out, err)


def _read(outdir: str) -> tuple[str, str]:
    texts = []
    for name in ("stdout", "stderr"):
        path = os.path.join(outdir, name)
        with open(path, encoding="utf-8", errors="replace") if os.path.exists(path) else open(os.devnull) as f:
            texts.append(f.read())
    return texts[0], texts[1]


def _script(args: list[str], env: dict[str, str], cwd: str, outdir: str) -> None:
    """In the forked process: become `python *args` and exit as it would."""
    import atexit
    import runpy
    import traceback

    out = open(os.path.join(outdir, "stdout"), "w", encoding="utf-8")
    err = open(os.path.join(outdir, "stderr"), "w", encoding="utf-8")
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))
    status = _run_main(args, runpy, traceback)
    try:
        atexit._run_exitfuncs()  # the interpreter's exit path (multiprocessing skips it)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _run_main(args: list[str], runpy, traceback) -> int:
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        run = lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        run = lambda: runpy.run_path(args[0], run_name="__main__")  # noqa: E731
    try:
        run()
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would
        traceback.print_exc()
        return 1
