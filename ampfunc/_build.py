"""Builds and loads the compiled extension (``ext/``) on first use, or loads a prebuilt one.

Where the kernels come from, first match wins:

1. a library built ahead of time into the wheel (``AMPFUNC_BUILD_EXT=1 pip wheel ...``, see
   ``setup.py``): ``ampfunc/_kernels*.so`` with ``ampfunc/_kernels.json`` saying what it was built
   from and for. It is used only when that record matches this process (same sources, torch,
   Python, CUDA or not, and a CPU that runs its instruction set); otherwise the sources are built
   as below, so a mismatched wheel is slower to start, never wrong.
2. the build cache: one directory per *content* key, a hash of the sources' bytes, the compiler
   flags, torch's version and commit, the Python ABI, the platform and, when the flags say
   ``-march=native``, the CPU's instruction sets. Paths are not in the key, so two checkouts of
   one commit, a checkout and a wheel install, or two virtual environments with the same torch
   share one build and never rebuild each other; an edited source gets a new entry. A finished
   entry is loaded directly (no ninja run, no timestamp comparison).
3. a build: under a lock (``flock`` on ``<cache>/.<entry>.lock``, so concurrent first imports
   build once and the others wait), into a temporary directory that is renamed into place when
   complete, so a crash or a concurrent process never leaves a half-written entry that looks
   finished. Every build prints one line saying what it builds and where.

The sources are ``ext/`` next to the package (a checkout or an editable install) or
``ampfunc/_ext`` (a wheel or sdist install, which ships them).

Environment:

* ``AMPFUNC_DISABLE_EXT=1``: never build or load; the reference serves every op.
* ``AMPFUNC_REQUIRE_EXT=1``: a failed build is an error instead of a one-line warning (CI).
* ``AMPFUNC_EXT_CACHE``: the cache directory (default ``~/.cache/ampfunc/ext``).
* ``AMPFUNC_EXT_CUDA=0``: build the CPU kernels only even where CUDA is available.
* ``AMPFUNC_EXT_MARCH``: the x86-64 ``-march`` of a build: ``native`` (default for builds on
  first use, whose cache entry is keyed by this CPU), ``x86-64-v3`` (default for the
  ahead-of-time wheel: AVX2+FMA+F16C, any x86-64 CPU since about 2015), or ``none``.
* ``AMPFUNC_EXT_PREBUILT=0``: ignore a prebuilt library in the package.
* ``AMPFUNC_EXT_VERBOSE=1``: show the compiler's output.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

import torch

__all__ = ["load", "direct_module", "source_dir", "cache_dir", "source_digest", "build_record"]

_EXT_NAME = "ampfunc_ext"
_SOURCE_SUFFIXES = (".cpp", ".h", ".hpp", ".cu", ".cuh")
PREBUILT_NAME = "_kernels"  # ampfunc/_kernels*.so + ampfunc/_kernels.json, written by setup.py
JIT_MARCH = "native"
AOT_MARCH = "x86-64-v3"
# /proc/cpuinfo flags a portable -march needs at run time (x86-64-v3: AVX2, FMA, F16C, BMI1/2...).
_MARCH_CPU_FLAGS = {
    "x86-64": (),
    "x86-64-v2": ("sse4_2", "popcnt", "ssse3"),
    "x86-64-v3": ("sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"),
    "x86-64-v4": ("avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}


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


def source_digest(src: Path) -> str:
    """sha256 of every C++/CUDA source and header under ``src`` (relative paths and bytes):
    the same for any copy of one commit, wherever it lies."""
    h = hashlib.sha256()
    for p in sorted(q for q in src.rglob("*") if q.suffix in _SOURCE_SUFFIXES and q.is_file()):
        h.update(p.relative_to(src).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _cpu_tag() -> str:
    """A short fingerprint of this CPU's instruction sets: a ``-march=native`` build must not be
    handed to another CPU (a cache on a network home, a wheel copied elsewhere)."""
    return hashlib.sha1((platform.machine() + _cpu_flags_line()).encode()).hexdigest()[:8]


def _cpu_runs(march: str) -> bool:
    need = _MARCH_CPU_FLAGS.get(march)
    if need is None:
        return False  # an -march we cannot check: do not guess
    have = set(_cpu_flags_line().split(":", 1)[-1].split())
    return set(need) <= have


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def march(ahead_of_time: bool = False) -> str | None:
    """The ``-march`` of a build (x86-64 only; None elsewhere or under ``AMPFUNC_EXT_MARCH=none``)."""
    if not _is_x86():
        return None
    value = os.environ.get("AMPFUNC_EXT_MARCH", "").strip() or (AOT_MARCH if ahead_of_time else JIT_MARCH)
    return None if value.lower() in ("none", "default", "0") else value


def cpu_flags(ahead_of_time: bool = False) -> list[str]:
    """C++ flags of a build. The C++ standard is cpp_extension's choice (torch 2.13 wants C++20).
    On x86-64, ``-march`` sets at::vec's vector width: kernels.cpp selects CPU_CAPABILITY_AVX512
    when the compiler targets AVX-512 F/BW/DQ/VL, else CPU_CAPABILITY_AVX2 with AVX2+FMA+F16C."""
    flags = ["-O3", "-fopenmp"]
    m = march(ahead_of_time)
    if m:
        flags.append(f"-march={m}")
    return flags


# Tuples: cpp_extension appends its own -L/-l flags to the lists it is given, which would move
# the key of a process's later lookups if these were the lists handed to it.
CUDA_FLAGS = ("-O3", "-DAMPFUNC_WITH_CUDA", "--expt-relaxed-constexpr")
LD_FLAGS = ("-fopenmp",)


def sources(src: Path, with_cuda: bool) -> list[str]:
    out = [str(src / "bindings.cpp"), str(src / "cpu" / "kernels.cpp")]
    if with_cuda:
        out += sorted(str(p) for p in (src / "cuda").glob("*.cu"))
    return out


def _cuda_target() -> dict:
    """What a CUDA build compiles for: cpp_extension takes TORCH_CUDA_ARCH_LIST, else the
    visible GPUs' compute capabilities."""
    from torch.utils.cpp_extension import CUDA_HOME

    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not archs and torch.cuda.is_available():
        archs = ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i)
                                 for i in range(torch.cuda.device_count())}))
    return {"cuda": torch.version.cuda, "cuda_home": str(CUDA_HOME), "archs": archs}


def build_record(src: Path, with_cuda: bool, cflags: list[str]) -> dict:
    """Everything a build's binary depends on, except file paths; its hash names the cache
    entry, and setup.py stores it beside a prebuilt library."""
    m = next((f.split("=", 1)[1] for f in cflags if f.startswith("-march=")), None)
    return {
        "sources": source_digest(src),
        "cflags": list(cflags),
        "cuda_flags": list(CUDA_FLAGS) if with_cuda else [],
        "ldflags": list(LD_FLAGS),
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", ""),
        "python": sys.implementation.cache_tag,
        "platform": sysconfig.get_platform(),
        "march": m,
        # -march=native binds the binary to this CPU; a portable -march does not.
        "cpu": _cpu_tag() if m == "native" else None,
        "cxx": os.environ.get("CXX", ""),
        "with_cuda": with_cuda,
        "cuda": _cuda_target() if with_cuda else None,
    }


def _key(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def _cache_root() -> Path:
    return Path(os.environ.get("AMPFUNC_EXT_CACHE") or Path.home() / ".cache" / "ampfunc" / "ext")


def cache_dir(with_cuda: bool) -> Path:
    """The cache entry of the current sources and flags (it may not exist yet)."""
    src = source_dir()
    if src is None:
        raise RuntimeError("the C++ sources (ext/bindings.cpp) are not shipped with this installation")
    return _entry(build_record(src, with_cuda, cpu_flags()))


def _entry(record: dict) -> Path:
    torch_tag = record["torch"].replace("+", "_")
    kind = "cpu+cuda" if record["with_cuda"] else "cpu"
    return _cache_root() / f"{kind}-torch{torch_tag}-{record['python']}-{_key(record)}"


def _library_in(directory: Path) -> Path | None:
    libs = sorted(directory.glob("*.so")) + sorted(directory.glob("*.pyd")) + sorted(directory.glob("*.dll"))
    return libs[0] if libs else None


@contextlib.contextmanager
def _locked(lock_path: Path, what: str):
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename below still keeps entries whole
        yield
        return
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"ampfunc: waiting for another process building {what}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(src: Path, with_cuda: bool, cflags: list[str], build_dir: Path) -> None:
    """Compiles and links the extension into ``build_dir`` (and loads it into this process)."""
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=_EXT_NAME + ("_cuda" if with_cuda else ""),
        sources=sources(src, with_cuda),
        extra_cflags=list(cflags) + (["-DAMPFUNC_WITH_CUDA"] if with_cuda else []),
        extra_cuda_cflags=list(CUDA_FLAGS) if with_cuda else [],
        extra_ldflags=list(LD_FLAGS),
        extra_include_paths=[str(src)],
        build_directory=str(build_dir),
        is_python_module=False,
        with_cuda=with_cuda,
        verbose=_flag("AMPFUNC_EXT_VERBOSE"),
    )


_LOADED: list = []  # the path of the library this process loaded


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))
    _LOADED[:] = [path]


def direct_module():
    """The loaded library's direct door (eager CPU calls that skip the dispatcher; see
    ext/bindings.cpp, namespace ``direct``), or None when no library is loaded or it has none."""
    if not _LOADED:
        return None
    lib = ctypes.PyDLL(str(_LOADED[0]))  # PyDLL: the call holds the GIL and raises a set error
    make = getattr(lib, "ampfunc_direct_module", None)
    if make is None:
        return None
    make.restype = ctypes.py_object
    make.argtypes = []
    return make()


def _build(with_cuda: bool) -> str:
    """Loads the cached build of the current sources, building it first if there is none.
    Returns where the library came from."""
    src = source_dir()
    if src is None:
        raise RuntimeError("the C++ sources (ext/bindings.cpp) are not shipped with this installation")
    cflags = cpu_flags()
    record = build_record(src, with_cuda, cflags)
    entry = _entry(record)
    lib = _library_in(entry) if entry.is_dir() else None
    if lib is not None:
        _load_library(lib)
        return str(lib)
    entry.parent.mkdir(parents=True, exist_ok=True)
    kind = "CPU+CUDA" if with_cuda else "CPU"
    with _locked(entry.parent / f".{entry.name}.lock", f"the {kind} kernels into {entry}"):
        lib = _library_in(entry) if entry.is_dir() else None
        if lib is not None:  # built by the process we waited for
            _load_library(lib)
            return str(lib)
        if entry.exists():  # an entry without its library (deleted by hand): replace it
            shutil.rmtree(entry)
        print(f"ampfunc: building the {kind} kernels ({' '.join(cflags)}) into {entry} (about a minute)...",
              file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
        try:
            _compile(src, with_cuda, cflags, tmp)  # loads the library from tmp
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache's entry from other users
            (tmp / "build.json").write_text(json.dumps(record, indent=1, sort_keys=True))
            try:
                os.rename(tmp, entry)  # atomic: the entry appears complete or not at all
            except OSError:
                if _library_in(entry) is None:  # not a concurrent winner: a real error
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # cpp_extension loaded the library from tmp; the entry holds the same file (same inode,
        # so ctypes finds the loaded copy, not a second one)
        _LOADED[:] = [_library_in(entry)]
    return str(entry)


def prebuilt() -> tuple[Path, dict] | None:
    """The library built into this package ahead of time, with its build record, if any."""
    here = Path(__file__).resolve().parent
    meta = here / f"{PREBUILT_NAME}.json"
    libs = sorted(here.glob(f"{PREBUILT_NAME}*.so")) + sorted(here.glob(f"{PREBUILT_NAME}*.pyd"))
    if not libs or not meta.is_file():
        return None
    return libs[0], json.loads(meta.read_text())


def prebuilt_mismatch(record: dict, with_cuda: bool) -> str | None:
    """Why a prebuilt library cannot serve this process, or None when it can."""
    src = source_dir()
    checks = [
        ("torch", torch.__version__),
        ("python", sys.implementation.cache_tag),
        ("platform", sysconfig.get_platform()),
        ("with_cuda", with_cuda),
    ]
    if src is not None:  # an editable checkout whose sources changed since the library was built
        checks.append(("sources", source_digest(src)))
    for field, here in checks:
        if record.get(field) != here:
            return f"built for {field}={record.get(field)!r}, this is {here!r}"
    m = record.get("march")
    if m == "native":
        if record.get("cpu") != _cpu_tag():
            return "built with -march=native on another CPU"
    elif m and not _cpu_runs(m):
        return f"built with -march={m}, which this CPU does not run"
    return None


def _load_prebuilt(with_cuda: bool) -> str | None:
    if os.environ.get("AMPFUNC_EXT_PREBUILT", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    found = prebuilt()
    if found is None:
        return None
    lib, record = found
    why = prebuilt_mismatch(record, with_cuda)
    if why is not None:
        if record.get("with_cuda") == with_cuda:  # say why the shipped library is passed over
            print(f"ampfunc: not using the prebuilt kernels {lib.name} ({why}); building from the sources",
                  file=sys.stderr, flush=True)
        return None
    _load_library(lib)
    return str(lib)


def load() -> tuple[str, str | None]:
    """Loads the prebuilt or cached extension, building it if needed; returns ``(backend, why_not)``.

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
            if _load_prebuilt(with_cuda) is None:
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


def _want_cuda() -> bool:
    if os.environ.get("AMPFUNC_EXT_CUDA", "1").strip() == "0":
        return False
    if not torch.cuda.is_available():
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None
