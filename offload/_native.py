"""Loads the native core, offload._C, with an error that says how to build it."""

from __future__ import annotations

try:
    from offload import _C  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "offload's native extension (offload._C) is not built or does not load: "
        f"{exc}. Install the package with `pip install -e .` (or, in a source checkout, "
        "`python setup.py build_ext --inplace`)."
    ) from exc

C = _C


def cpu_features() -> dict[str, bool]:
    """The SIMD instruction sets this CPU supports, as the native dispatch sees them."""
    return dict(_C.cpu_features())
