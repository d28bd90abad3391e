"""Packaging steps pyproject.toml cannot say (the metadata lives there).

1. Every wheel carries ext/'s C++/CUDA sources as ``ampfunc/_ext`` (an sdist carries ``ext/``
   through MANIFEST.in), so any install builds its kernels on first use exactly as a checkout
   does; ``ampfunc/_build.py`` finds them there.
2. ``AMPFUNC_BUILD_EXT=1`` also compiles the kernels now, as projects built on
   ``torch.utils.cpp_extension`` do, into ``ampfunc/_kernels*.so`` beside a record
   (``ampfunc/_kernels.json``) of what it was built from and for; the wheel becomes a platform
   wheel, and the package loads that library without compiling whenever the record matches the
   running torch, Python and CPU (otherwise it builds from the shipped sources as in 1). It builds
   against the torch already installed, so it needs ``--no-build-isolation``::

       AMPFUNC_BUILD_EXT=1 pip wheel --no-build-isolation --no-deps .

   On x86-64 the library is built for ``-march=x86-64-v3`` (AVX2/FMA/F16C: the vector width the
   kernels are written for, and any x86-64 CPU since about 2015) unless ``AMPFUNC_EXT_MARCH``
   says otherwise; ``AMPFUNC_EXT_MARCH=native`` builds for this CPU only, which the record says,
   and such a library is never loaded on another CPU. CUDA kernels are included where torch is a
   CUDA build and nvcc is found (``AMPFUNC_EXT_CUDA=0`` leaves them out; ``TORCH_CUDA_ARCH_LIST``
   picks the GPUs).
"""

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
EXT = ROOT / "ext"
SOURCE_SUFFIXES = (".cpp", ".h", ".hpp", ".cu", ".cuh")


def _flag(name, default=False):
    """A switch spelt as ``ampfunc._build.env_flag`` takes them (that module needs torch, which an
    isolated build lacks): 1/true/yes/on or 0/false/no/off; anything else stops the build, naming it."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"setup.py: {name}={raw!r}: expected 1/true/yes/on or 0/false/no/off (or unset)")


def _check_setuptools():
    """pyproject.toml's ``license = "Apache-2.0"`` (PEP 639) needs setuptools 77; an older one in
    a --no-build-isolation build would fail with a schema error that does not say so."""
    import setuptools

    try:
        major = int(setuptools.__version__.split(".")[0])
    except ValueError:
        return
    if major < 77:
        raise SystemExit(f"setup.py: setuptools {setuptools.__version__} is too old for this project's metadata "
                         f"(PEP 639 license); pip install 'setuptools>=77' (an isolated build gets it itself)")


class BuildPyWithSources(build_py):
    """Copies ext/'s sources into the built package as ampfunc/_ext."""

    def run(self):
        editable = getattr(self, "editable_mode", False)
        if not editable:  # build/ outlives builds: a module deleted from the sources must not ship
            shutil.rmtree(Path(self.build_lib) / "ampfunc", ignore_errors=True)
        super().run()
        if editable:
            return  # an editable install reads ext/ where it is
        if not (EXT / "bindings.cpp").is_file():
            raise SystemExit("setup.py: ext/bindings.cpp is missing; the package would have no kernels")
        dst = Path(self.build_lib) / "ampfunc" / "_ext"
        shutil.rmtree(dst, ignore_errors=True)
        for p in sorted(EXT.rglob("*")):
            if p.is_file() and p.suffix in SOURCE_SUFFIXES:
                target = dst / p.relative_to(EXT)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, target)


def _ahead_of_time():
    """The extension module and build command of AMPFUNC_BUILD_EXT=1."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        raise SystemExit("AMPFUNC_BUILD_EXT=1 compiles against the installed torch: install torch first, then "
                         "build with --no-build-isolation (pip wheel --no-build-isolation --no-deps .)") from None
    # The one place that knows the flags and what a build depends on (loaded by path: importing
    # the ampfunc package itself would pull in all of it).
    spec = importlib.util.spec_from_file_location("_ampfunc_build", ROOT / "ampfunc" / "_build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)

    try:
        build.check_march(ahead_of_time=True)  # a -march the compiler refuses, by its variable's name
        with_cuda = (build.env_flag("AMPFUNC_EXT_CUDA", default=True) and torch.version.cuda is not None
                     and cpp_extension.CUDA_HOME is not None)
    except ValueError as exc:
        raise SystemExit(f"setup.py: {exc}") from None
    cflags = build.cpu_flags(ahead_of_time=True) + ["-g0"]  # -g0: Python's own CFLAGS ask for debug info (20x the size)
    record = build.build_record(EXT, with_cuda, cflags)
    if record["march"] == "native":
        print("setup.py: AMPFUNC_EXT_MARCH=native: this library is for this CPU only; elsewhere the package "
              "ignores it and builds from the shipped sources", file=sys.stderr)
    sources = [os.path.relpath(s, ROOT) for s in build.sources(EXT, with_cuda)]
    kind = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    module = kind(
        name=f"ampfunc.{build.PREBUILT_NAME}",
        sources=sources,
        include_dirs=[str(EXT)],
        extra_compile_args={"cxx": cflags + (["-DAMPFUNC_WITH_CUDA"] if with_cuda else []),
                            "nvcc": list(build.CUDA_FLAGS)},
        extra_link_args=list(build.LD_FLAGS),
    )

    class BuildExtWithRecord(cpp_extension.BuildExtension):
        """Builds the library and writes its record beside it."""

        def run(self):
            super().run()
            lib = Path(self.get_ext_fullpath(module.name))
            (lib.parent / f"{build.PREBUILT_NAME}.json").write_text(json.dumps(record, indent=1, sort_keys=True))
            print(f"setup.py: built {lib.name} ({' '.join(cflags)}{', CUDA' if with_cuda else ''}) for torch "
                  f"{torch.__version__}", file=sys.stderr)

    return [module], BuildExtWithRecord


_check_setuptools()
cmdclass = {"build_py": BuildPyWithSources}
ext_modules = []
if _flag("AMPFUNC_BUILD_EXT"):
    ext_modules, cmdclass["build_ext"] = _ahead_of_time()

setup(cmdclass=cmdclass, ext_modules=ext_modules)
