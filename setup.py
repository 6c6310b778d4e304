"""Build the Cython extensions of sparsemap.

Every ``.pyx`` file under ``sparsemap/`` becomes one extension module, so a new
factor or solver module needs no change here.

One build serves every install of a checkout in place. An editable install
(``pip install -e .``) leaves the compiled modules next to their sources; a
later editable install (another ``pip install -e ".[extra]"``) or in-place
build reuses each module that is newer than its ``.pyx``, every ``.pxd`` of the
package and this file, instead of translating and compiling it again in pip's
fresh build environment. A stale module is translated afresh, so that a change
of the compiler directives here reaches its C. A wheel (``pip install .``,
``pip wheel .``) compiles everything, with its own flags and build environment.
``python setup.py build_ext --inplace --force`` (or deleting the compiled
files) rebuilds everything.
"""
import sysconfig
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
PACKAGE = HERE / "sparsemap"
CYTHON_OPTIONS = dict(
    language_level=3,
    compiler_directives={
        "boundscheck": False,
        "wraparound": False,
        "cdivision": True,
        "initializedcheck": False,
    },
)


def _pyx(ext):
    return HERE / Path(*ext.name.split(".")).with_suffix(".pyx")


def _inplace_path(ext):
    """The compiled module that an in-place build leaves next to the ``.pyx``."""
    pyx = _pyx(ext)
    return pyx.with_name(pyx.stem + sysconfig.get_config_var("EXT_SUFFIX"))


def _up_to_date(ext):
    built = _inplace_path(ext)
    if not built.exists():
        return False
    # A module depends on its source and, through cimports, on the package's .pxd files.
    sources = [_pyx(ext), HERE / "setup.py", *PACKAGE.rglob("*.pxd")]
    return max(s.stat().st_mtime for s in sources) <= built.stat().st_mtime


class BuildExt(build_ext):
    """Translate and compile the stale modules only; copy the up-to-date ones."""

    def run(self):
        # Read before setuptools clears `inplace` for the build proper.
        self._may_reuse = not self.force and (self.inplace or self.editable_mode)
        super().run()

    def build_extensions(self):
        # Cythonize here, once and serially, before the (possibly parallel) compilation.
        self._reused = set()
        for ext in self.extensions:
            if self._may_reuse and _up_to_date(ext):
                self._reused.add(ext.name)
            else:
                ext.sources = cythonize([ext], force=True, **CYTHON_OPTIONS)[0].sources
        super().build_extensions()

    def build_extension(self, ext):
        if ext.name not in self._reused:
            return super().build_extension(ext)
        target = Path(self.get_ext_fullpath(ext.name))   # in the build folder
        self.mkpath(str(target.parent))
        self.copy_file(str(_inplace_path(ext)), str(target))


# Functions and loops start on cache-line boundaries: otherwise where a hot loop
# lands depends on unrelated code compiled before it, which moved the solve of a
# 50-word tree by 6% between builds that differ in a validation function only.
# (MSVC ignores these flags with a warning, as it does -O3.)
COMPILE_ARGS = ["-O3", "-falign-functions=64", "-falign-loops=32"]


def _extensions():
    return [
        Extension(
            ".".join(pyx.relative_to(HERE).with_suffix("").parts),
            [str(pyx.relative_to(HERE))],
            include_dirs=[np.get_include()],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            extra_compile_args=COMPILE_ARGS,
        )
        for pyx in sorted(PACKAGE.rglob("*.pyx"))
    ]


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
