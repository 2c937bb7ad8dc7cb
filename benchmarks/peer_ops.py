"""DeepSpeed's JIT-built ops, as the benchmark suite's peers use them: where torch builds them,
whether one is built, a build lock left behind, and building them ahead (`python -m
benchmarks.peer_ops`, what `python -m benchmarks --build-peers` runs first).

[Note: peer builds] DeepSpeed's CPU optimizers (cpu_adam, cpu_lion, cpu_adagrad), its AIO op
and its CPU communication op are compiled on first use by torch's `cpp_extension.load`, into
torch's extensions folder (`TORCH_EXTENSIONS_DIR`, else ~/.cache/torch_extensions/py3X_cpu).
That first use takes several minutes on 2 cores and prints nothing meanwhile; torch guards
the build with a lock file (`<folder>/<op>/lock`) that a killed build leaves behind, and every
later load of that op (a benchmark, the test suite, a user's own DeepSpeed job) then waits on
it forever, silently. So, before a benchmark first uses an op (`prepare`):
- an op that is built (in the folder, or prebuilt into DeepSpeed's wheel) is used;
- a lock without a built op drops the peer, naming the lock and what to do, instead of
  hanging on it (the suite runner removes such locks in its own private folder first: it runs
  one benchmark at a time, so a lock there is always stale);
- under the runner's `--quick` (`OFFLOAD_BENCH_PEER_BUILDS=skip`) an op not built yet drops
  its peer with the reason and the command that builds it;
- otherwise the build is announced before it starts.
The runner points `TORCH_EXTENSIONS_DIR` at a folder under `--out`, so the builds land there
and nothing is left outside it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

OPS = {
    "cpu_adam": "DeepSpeed's CPU Adam op",
    "cpu_lion": "DeepSpeed's CPU Lion op",
    "cpu_adagrad": "DeepSpeed's CPU Adagrad op",
    "async_io": "DeepSpeed's AIO op",
    "deepspeed_shm_comm": "DeepSpeed's CPU communication op",
}
"""Op name (DeepSpeed's builder NAME, torch's extension name) -> what it is, for messages."""

SKIP_ENV = "OFFLOAD_BENCH_PEER_BUILDS"
"""'skip': an op not built yet drops its peer instead of building (the runner's --quick)."""

BUILD_HINT = "python -m benchmarks --build-peers (with the same --out) builds them once"


class PeerNotReady(RuntimeError):
    """A peer's op is not built (and may not be built now) or is locked: its message is the
    whole reason, printed as it is (`benchmarks._common.peer_reason`)."""


def extensions_root() -> Path:
    """The folder torch builds extensions in: `TORCH_EXTENSIONS_DIR`, else torch's default
    (`cpp_extension._get_build_directory`'s rule, without creating anything)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    cu = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{cu}"


def _prebuilt(name: str) -> bool:
    try:
        from deepspeed.git_version_info import installed_ops  # type: ignore[import-not-found]
    except Exception:  # not installed, or a DeepSpeed without the table: nothing prebuilt
        return False
    return bool(installed_ops.get(name))


def is_built(name: str, root: Optional[Path] = None) -> bool:
    root = root or extensions_root()
    return _prebuilt(name) or any((root / name).glob(f"{name}*.so"))


def lock_path(name: str, root: Optional[Path] = None) -> Path:
    return (root or extensions_root()) / name / "lock"


def prepare(name: str) -> Optional[str]:
    """Before the first use of op `name` ([Note: peer builds]): None to go on (built, or its
    build announced on stdout), or the reason to drop the peer."""
    root = extensions_root()
    if is_built(name, root):
        return None
    what = OPS.get(name, f"DeepSpeed's {name} op")
    lock = lock_path(name, root)
    if lock.exists():
        return (f"{what}: build lock {lock} is there (a build is running, or a killed one left it and torch "
                f"would wait on it forever); if no build is running, delete it")
    if os.environ.get(SKIP_ENV) == "skip":
        return f"{what} not built yet (first use builds it, several minutes): skipped under --quick; {BUILD_HINT}"
    print(f"  building {what} into {root / name}: first run only, several minutes on 2 cores ...", flush=True)
    return None


def stale_locks(root: Path) -> list[Path]:
    """The build locks under `root` (one per op folder)."""
    return sorted(root.glob("*/lock")) if root.is_dir() else []


def build(names: list[str]) -> dict[str, str]:
    """Builds each op (announced); {name: why it failed} for those that did not build."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU: DeepSpeed's CPU builders
    failed: dict[str, str] = {}
    for name in names:
        why = prepare(name)
        if why is None and not is_built(name):
            try:
                from deepspeed.ops.op_builder.builder import OpBuilder  # type: ignore[import-not-found]
                from deepspeed.ops.op_builder.cpu import (  # type: ignore[import-not-found]
                    AsyncIOBuilder, CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder, ShareMemCommBuilder)

                builders: dict[str, type[OpBuilder]] = {
                    "cpu_adam": CPUAdamBuilder, "cpu_lion": CPULionBuilder, "cpu_adagrad": CPUAdagradBuilder,
                    "async_io": AsyncIOBuilder, "deepspeed_shm_comm": ShareMemCommBuilder}
                builder = builders[name]()
                if not builder.is_compatible(verbose=False):
                    raise RuntimeError(f"{name} cannot build here (for async_io: libaio-dev missing?)")
                builder.load(verbose=False)
            except Exception as exc:  # report and go on: the benchmarks drop that peer
                from benchmarks._common import peer_reason

                why = peer_reason(exc)
        if why is not None:
            failed[name] = why
            print(f"  {name}: {why}", flush=True)
        else:
            print(f"  {name}: built ({OPS.get(name, name)})", flush=True)
    return failed


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Build DeepSpeed's ops the benchmark suite compares with, "
                                            "into TORCH_EXTENSIONS_DIR (or torch's default folder)")
    p.add_argument("ops", nargs="*", default=list(OPS), help=f"op names (default: all of {list(OPS)})")
    args = p.parse_args(argv)
    unknown = [n for n in args.ops if n not in OPS]
    if unknown:
        p.error(f"unknown op(s) {unknown}; choose from {list(OPS)}")
    os.environ.pop(SKIP_ENV, None)  # building is what was asked
    failed = build(args.ops)
    return 1 if len(failed) == len(args.ops) else 0


if __name__ == "__main__":
    sys.exit(main())
