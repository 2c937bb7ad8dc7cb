"""Loads the native core, offload._C, with an error that says how to build it."""

from __future__ import annotations

try:
    # Imported under the name the package uses (`C`) rather than assigned to it, so that the
    # type checker reads `C` as the module (offload/_C.pyi): `C.AioRequest` is a type.
    from offload import _C as C
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "offload's native extension (offload._C) is not built or does not load: "
        f"{exc}. Install the package with `pip install -e .` (or, in a source checkout, "
        "`python setup.py build_ext --inplace`)."
    ) from exc


def cpu_features() -> dict[str, bool]:
    """The SIMD instruction sets this CPU supports, as the native dispatch sees them."""
    return dict(C.cpu_features())
