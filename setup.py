"""Build the Cython extensions of sparsemap.

Every ``.pyx`` file under ``sparsemap/`` becomes one extension module, so a new
factor or solver module needs no change here.
"""
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent


def _extensions():
    exts = []
    for pyx in sorted((HERE / "sparsemap").rglob("*.pyx")):
        rel = pyx.relative_to(HERE)
        name = ".".join(rel.with_suffix("").parts)
        exts.append(
            Extension(
                name,
                [str(rel)],
                include_dirs=[np.get_include()],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                extra_compile_args=["-O3"],
            )
        )
    return exts


setup(
    ext_modules=cythonize(
        _extensions(),
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    ),
)
