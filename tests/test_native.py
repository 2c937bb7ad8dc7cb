"""The native module loads and its CPU-feature detection agrees with the kernel's view."""

from __future__ import annotations

import platform

import pytest

from offload._native import cpu_features


def _proc_cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 feature flags only")
def test_cpu_features_match_proc_cpuinfo():
    flags = _proc_cpu_flags()
    features = cpu_features()
    # /proc/cpuinfo lists what both the CPU and the kernel support, which is what the
    # native check (CPUID + XGETBV) must also conclude.
    assert features["avx2"] == ({"avx2", "fma", "f16c"} <= flags)
    assert features["avx512"] == ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags)
    assert features["neon"] is False


def test_cpu_features_are_booleans():
    features = cpu_features()
    assert set(features) == {"avx2", "avx512", "avx512_bf16", "neon"}
    assert all(isinstance(v, bool) for v in features.values())
