"""Builds and loads the compiled extension (``ext/``) on first use.

The extension is compiled with ``torch.utils.cpp_extension.load`` (ninja) into a cache
directory, once per (sources, flags, torch, python) combination; later imports load the cached
library in milliseconds. It registers the CPU (and, when built with CUDA, the CUDA) kernels of
the ops that :mod:`ampfunc.ops` defines; without it the ops run their plain-torch references.

Environment:

* ``AMPFUNC_DISABLE_EXT=1``: never build or load; the reference serves every op.
* ``AMPFUNC_REQUIRE_EXT=1``: a failed build is an error instead of a one-line warning (CI).
* ``AMPFUNC_EXT_CACHE``: the cache directory (default ``~/.cache/ampfunc/ext``).
* ``AMPFUNC_EXT_CUDA=0``: build the CPU kernels only even where CUDA is available.
* ``AMPFUNC_EXT_VERBOSE=1``: show the compiler's output.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

__all__ = ["load", "source_dir", "cache_dir"]

_EXT_NAME = "ampfunc_ext"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def source_dir() -> Path | None:
    """Where the C++/CUDA sources are: ``ext/`` next to the package (a source checkout or an
    editable install) or ``ampfunc/_ext`` (a wheel that ships them)."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "ext", here / "_ext"):
        if (cand / "bindings.cpp").is_file():
            return cand
    return None


def _cpu_tag() -> str:
    """A short fingerprint of the CPU's instruction sets: the build uses -march=native, so a
    cache shared between machines (a network home) must not hand one CPU another's binary."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def cache_dir(with_cuda: bool) -> Path:
    root = Path(os.environ.get("AMPFUNC_EXT_CACHE") or Path.home() / ".cache" / "ampfunc" / "ext")
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}-{_cpu_tag()}"
    return root / (tag + ("-cuda" if with_cuda else "-cpu"))


def _want_cuda() -> bool:
    if os.environ.get("AMPFUNC_EXT_CUDA", "1").strip() == "0":
        return False
    if not torch.cuda.is_available():
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None


def _cpu_flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]  # the C++ standard is cpp_extension's choice (torch 2.13 wants C++20)
    # The cache is per machine, so tune for it: AVX2/AVX-512 let at::vec use 256-bit vectors
    # (kernels.cpp selects CPU_CAPABILITY_AVX2 when the compiler targets AVX2+FMA+F16C).
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-march=native")
    return flags


def _build(with_cuda: bool):
    from torch.utils import cpp_extension

    src = source_dir()
    if src is None:
        raise RuntimeError("the C++ sources (ext/bindings.cpp) are not shipped with this installation")
    sources = [str(src / "bindings.cpp"), str(src / "cpu" / "kernels.cpp")]
    cflags = _cpu_flags()
    cuda_flags: list[str] = []
    if with_cuda:
        sources += sorted(str(p) for p in (src / "cuda").glob("*.cu"))
        cflags.append("-DAMPFUNC_WITH_CUDA")
        cuda_flags = ["-O3", "-DAMPFUNC_WITH_CUDA", "--expt-relaxed-constexpr"]
    build_dir = cache_dir(with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)
    verbose = _flag("AMPFUNC_EXT_VERBOSE")
    built = [p.stat().st_mtime for p in build_dir.glob("*.so")]
    stale = not built or max(Path(f).stat().st_mtime for f in sources) > max(built)
    if stale and not verbose:  # a (re)build is coming: say so once, it takes a while
        print(f"ampfunc: compiling the {'CPU+CUDA' if with_cuda else 'CPU'} kernels into {build_dir} "
              "(one time, about a minute)...", file=sys.stderr, flush=True)
    cpp_extension.load(
        name=_EXT_NAME + ("_cuda" if with_cuda else ""),
        sources=sources,
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_flags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(src)],
        build_directory=str(build_dir),
        is_python_module=False,
        with_cuda=with_cuda,
        verbose=verbose,
    )


def load() -> tuple[str, str | None]:
    """Builds (if needed) and loads the extension; returns ``(backend, why_not)``.

    ``backend`` is ``"cpu+cuda"``, ``"cpu"`` or ``"reference"``; ``why_not`` says why the
    compiled kernels are not (all) there, or is None. Warns once (one line) on a failed build,
    raises instead under ``AMPFUNC_REQUIRE_EXT=1``.
    """
    if _flag("AMPFUNC_DISABLE_EXT"):
        return "reference", "AMPFUNC_DISABLE_EXT is set"
    require = _flag("AMPFUNC_REQUIRE_EXT")
    errors = []
    for with_cuda in ((True, False) if _want_cuda() else (False,)):
        try:
            _build(with_cuda)
            why = None if not errors else f"CUDA kernels failed to build ({errors[0]})"
            if why and require:
                raise RuntimeError(why)
            if why:
                warnings.warn(f"ampfunc: {why}; CUDA tensors use the plain-torch reference kernels.", stacklevel=3)
            return ("cpu+cuda" if with_cuda else "cpu"), why
        except Exception as exc:  # noqa: BLE001 - any build failure means fall back (or raise)
            if require:
                raise RuntimeError(f"ampfunc: building the compiled extension failed and AMPFUNC_REQUIRE_EXT=1: "
                                   f"{exc}") from exc
            errors.append(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    why = errors[-1]
    warnings.warn(f"ampfunc: compiled kernels unavailable ({why}); using the plain-torch reference kernels "
                  "(set AMPFUNC_REQUIRE_EXT=1 to make this an error).", stacklevel=3)
    return "reference", why
