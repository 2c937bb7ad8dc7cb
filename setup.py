"""Build offload._C with CMake + ninja.

setuptools drives the build so that `pip install -e .` and `pip install .` both work;
CMake does the compiling, because per-file ISA flags (one kernel file per instruction set,
dispatched at run time) are simple there and awkward in setuptools.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


def _find_ninja() -> str | None:
    """The ninja binary: on PATH (pip's isolated build env puts the `ninja` wheel's there)."""
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the wheel's module knows where its binary is

        candidate = Path(getattr(ninja, "BIN_DIR", "") or "") / "ninja"
        return str(candidate) if candidate.is_file() else None
    except ImportError:
        return None


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11  # a build requirement (pyproject.toml)

        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        build_type = os.environ.get("OFFLOAD_BUILD_TYPE", "Release")
        configure = [
            "cmake",
            str(ROOT),
            "-G",
            "Ninja",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DOFFLOAD_OUTPUT_DIR={ext_path.parent}",
            f"-DOFFLOAD_OUTPUT_NAME={ext_path.name}",
        ]
        ninja = _find_ninja()
        if ninja:
            configure.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
        subprocess.run(configure, cwd=build_temp, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_temp, check=True)


setup(ext_modules=[CMakeExtension("offload._C")], cmdclass={"build_ext": CMakeBuild})
