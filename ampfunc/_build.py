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

A finished entry's ``build.json`` records its library's size and sha256; an entry whose library
does not match (a truncated copy, a full disk, a hand edit) is rebuilt under the lock and
replaced atomically, with one line saying so, instead of being loaded (a truncated library
kills the process with SIGBUS). A failed build leaves the compiler's output in
``<cache>/<entry>.build-error.log`` and names its cause in the warning.

Environment (switches take ``1/true/yes/on`` or ``0/false/no/off``, any case; any other value
is refused with an error naming the variable, see :func:`env_flag`):

* ``AMPFUNC_DISABLE_EXT=1``: never build or load; the reference serves every op.
* ``AMPFUNC_REQUIRE_EXT=1``: a failed build is an error instead of a one-line warning (CI).
* ``AMPFUNC_EXT_CACHE``: the cache directory (default ``~/.cache/ampfunc/ext``).
* ``AMPFUNC_EXT_CUDA=0``: build the CPU kernels only even where CUDA is available.
* ``AMPFUNC_EXT_MARCH``: the x86-64 ``-march`` of a build: ``native`` (default for builds on
  first use, whose cache entry is keyed by this CPU), ``x86-64-v3`` (default for the
  ahead-of-time wheel: AVX2+FMA+F16C, any x86-64 CPU since about 2015), or ``none``. A value
  the compiler refuses is reported by name before anything is compiled.
* ``AMPFUNC_EXT_PREBUILT=0``: ignore a prebuilt library in the package.
* ``AMPFUNC_EXT_VERBOSE=1``: show the compiler's output.
* ``AMPFUNC_CPU_POOL_MB``: the CPU output pool's limit, a whole number of MB (read by the
  library, checked here: see :func:`cpu_pool_mb`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

import torch

__all__ = ["load", "direct_module", "source_dir", "cache_dir", "source_digest", "build_record", "env_flag",
           "cpu_pool_mb", "check_march"]

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


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = False) -> bool:
    """A switch from the environment: ``1/true/yes/on`` or ``0/false/no/off`` (any case, spaces
    ignored); unset or empty gives ``default``.

    Every ampfunc switch is read here, so all take the same spellings; any other value raises
    ``ValueError`` naming the variable rather than being guessed at (``AMPFUNC_DIRECT=false``
    once left the direct door on, ``AMPFUNC_DISABLE_EXT=2`` would disable).
    Cost: reads the environment; no host sync.
    """
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of {'/'.join(_TRUE)} (on) or {'/'.join(_FALSE)} (off), "
                     f"or unset ({'on' if default else 'off'})")


# The pool's byte limit is a size_t that pool_stats() reports as an int64 (ext/glue/cpu_pool.h):
# a larger number of MB would wrap.
_POOL_MB_MAX = (2**63 - 1) >> 20


def cpu_pool_mb() -> int | None:
    """``AMPFUNC_CPU_POOL_MB`` as a whole number of megabytes, or None when unset (the library's
    default, 2048); ``0`` turns the CPU output pool off.

    ext/glue/cpu_pool.h reads the variable itself when the pool is first used (it warns on stderr
    and keeps the default for a bad value set after loading); :func:`load` calls this first so a
    bad value (``2G``, ``0.5``, ``-1``, ``abc``, more than an int64 of bytes) is refused by name
    instead of misread (``strtoull`` took ``2G`` as 2 MB and ``abc`` as 0, the pool off).
    Cost: reads the environment; no host sync.
    """
    raw = os.environ.get("AMPFUNC_CPU_POOL_MB", "")
    value = raw.strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 19 or int(value) > _POOL_MB_MAX:
        raise ValueError(f"AMPFUNC_CPU_POOL_MB={raw!r}: expected a whole number of megabytes, at most "
                         f"{_POOL_MB_MAX} (0 turns the CPU output pool off; unset means 2048)")
    return int(value)


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


def _cxx() -> list[str]:
    """The C++ compiler cpp_extension runs (``CXX``, else ``c++``), as an argv prefix."""
    return shlex.split(os.environ.get("CXX", "").strip() or "c++")


def check_march(ahead_of_time: bool = False) -> None:
    """Raises ``ValueError`` naming ``AMPFUNC_EXT_MARCH`` when the compiler refuses the ``-march``
    it asks for (a typo would otherwise surface as a 600-character compiler command). Only an
    explicit setting is checked, and only where the compiler runs; any doubt (no compiler, a
    timeout) is left to the build, which reports it.
    Cost: one preprocessor run of an empty file (a few ms).
    """
    raw = os.environ.get("AMPFUNC_EXT_MARCH", "").strip()
    m = march(ahead_of_time)
    if not raw or m is None or os.name == "nt":
        return
    try:
        out = subprocess.run([*_cxx(), f"-march={m}", "-E", "-x", "c++", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError, ValueError):
        return
    if out.returncode != 0:
        said = next((line.strip() for line in out.stderr.splitlines() if "error" in line.lower()),
                    out.stderr.strip().splitlines()[0] if out.stderr.strip() else f"exit {out.returncode}")
        raise ValueError(f"AMPFUNC_EXT_MARCH={raw!r}: the compiler ({' '.join(_cxx())}) refuses -march={m}: "
                         f"{said[:300]} (use a -march it accepts, e.g. native or x86-64-v3, or none)")


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
    out = [str(src / "bindings.cpp"), str(src / "cpu" / "kernels.cpp"), str(src / "cpu" / "lowmem.cpp")]
    if with_cuda:
        out += sorted(str(p) for p in (src / "cuda").glob("*.cu"))
    return out


def _cuda_target() -> dict:
    """What a CUDA build compiles for: cpp_extension takes TORCH_CUDA_ARCH_LIST, else the
    visible GPUs' compute capabilities."""
    from torch.utils.cpp_extension import CUDA_HOME

    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not archs and torch.cuda.is_available():
        archs = ";".join(sorted({"{}.{}".format(*torch.cuda.get_device_capability(i))
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


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _library_record(lib: Path) -> dict:
    """What build.json records of an entry's library, to recognise a damaged copy before loading
    it (hashing the ~1 MB CPU library takes about 1-2 ms, once per process)."""
    return {"name": lib.name, "size": lib.stat().st_size, "sha256": _file_sha256(lib)}


def _check_entry(entry: Path) -> tuple[Path | None, str | None]:
    """``(library, None)`` for a finished entry whose library is the one its build.json records;
    ``(None, None)`` when there is no entry; ``(None, what is wrong)`` for a damaged one. A library
    loaded without this check can kill the process (a truncated ``.so`` is mapped, then SIGBUS)."""
    if not entry.is_dir():
        return None, None
    lib = _library_in(entry)
    if lib is None:
        return None, "it has no library"
    try:
        rec = json.loads((entry / "build.json").read_text()).get("library")
    except (OSError, ValueError, AttributeError):
        return None, "its build.json is missing or unreadable"
    if not isinstance(rec, dict) or rec.get("name") != lib.name:
        return None, "its build.json records no checksum of the library (an older ampfunc built it)"
    size = lib.stat().st_size
    if size != rec.get("size"):
        return None, f"{lib.name} is {size} bytes, {rec.get('size')} were built"
    if _file_sha256(lib) != rec.get("sha256"):
        return None, f"{lib.name} differs from the library that was built (sha256)"
    return lib, None


def _fsync(path: Path) -> None:
    """Flushes a file, or a directory's entries, to disk: the entry renamed into place after a
    build must not turn out truncated after a power cut."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a directory cannot be opened on Windows; nothing to flush there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _try_flock(f) -> bool:
    import fcntl

    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def _locked(lock_path: Path, what: str):
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename below still keeps entries whole
        yield
        return
    with open(lock_path, "a+") as f:
        if not _try_flock(f):
            print(f"ampfunc: waiting for another process building {what}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_STALE_S = 3600  # a temporary directory this old is a killed build's, lock or not


def _remove_stale_temporaries(root: Path, entry: Path) -> None:
    """Removes what killed builds left (``.tmp-<entry>-*``): those of ``entry``, whose lock the
    caller holds, are all dead; another entry's are when its lock is free or after an hour."""
    for tmp in root.glob(".tmp-*"):
        name = tmp.name[len(".tmp-"):].rpartition("-")[0]  # mkdtemp's suffix has no '-'
        if name == entry.name or _lock_is_free(root / f".{name}.lock") or _age_s(tmp) > _STALE_S:
            shutil.rmtree(tmp, ignore_errors=True)


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _lock_is_free(lock_path: Path) -> bool:
    try:
        import fcntl
    except ImportError:
        return False  # cannot tell: age decides
    try:
        with open(lock_path) as f:
            if not _try_flock(f):
                return False
            fcntl.flock(f, fcntl.LOCK_UN)
            return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _packaged_ninja_dir() -> str | None:
    """Where the ``ninja`` package (a dependency) put its executable: beside this Python's
    scripts, which are not on PATH when a virtual environment's python runs unactivated."""
    try:
        import ninja

        dirs = [getattr(ninja, "BIN_DIR", "")]
    except ImportError:
        dirs = []
    dirs += [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    exe = "ninja" + (sysconfig.get_config_var("EXE") or "")
    for d in dirs:
        if d and os.access(os.path.join(d, exe), os.X_OK):
            return d
    return None


@contextlib.contextmanager
def _ninja_on_path():
    """cpp_extension runs ``ninja`` from PATH only; during the build, add the packaged one when
    PATH has none."""
    found = shutil.which("ninja") is not None
    extra = None if found else _packaged_ninja_dir()
    if extra is None:
        yield
        return
    old = os.environ.get("PATH")
    os.environ["PATH"] = extra + (os.pathsep + old if old else "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def _compile(src: Path, with_cuda: bool, cflags: list[str], build_dir: Path) -> None:
    """Compiles and links the extension into ``build_dir`` (and loads it into this process)."""
    from torch.utils import cpp_extension

    with _ninja_on_path():
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
            verbose=env_flag("AMPFUNC_EXT_VERBOSE"),
        )


def _check_compiler() -> None:
    """A missing compiler, said plainly (torch's error is the failed command line, and the
    shell's 'c++: not found' is buried after it)."""
    if os.name == "nt":
        return
    try:
        cxx = _cxx()
    except ValueError:
        return  # unbalanced quotes in CXX: the build says what it makes of it
    if cxx and shutil.which(cxx[0]) is None:
        setting = f"CXX={os.environ['CXX']!r}" if os.environ.get("CXX", "").strip() else "the default; CXX is unset"
        raise RuntimeError(f"no C++ compiler: {cxx[0]!r} ({setting}) is not on PATH; install g++ or clang++, "
                           f"or set CXX to one")


# Lines of torch's build error that are not the cause: ninja's progress and FAILED lines, the
# compiler and linker commands (they end in "-o <output>"), ninja's epilogue.
_NOISE = re.compile(r"^(\[\d+/\d+\]|FAILED:|ninja: |Error building extension)|\s-o\s+\S+$")
_CAUSE = re.compile(r"error|not found|no such file|cannot find|undefined reference|killed|fatal", re.I)


def _failure_cause(text: str) -> str:
    """The lines of a failed build's output that say why (at most two, deduplicated: every
    source fails alike on a bad flag), for a one-line message."""
    lines = [line.strip() for line in text.splitlines()]
    meaningful = [line for line in lines if line and not _NOISE.search(line)]
    causes = [line for line in meaningful if _CAUSE.search(line)] or meaningful[-2:]
    picked = list(dict.fromkeys(line[:300] for line in causes))[:2]
    if picked:
        return " / ".join(picked)
    first = text.strip().splitlines()[0] if text.strip() else "no output"
    return first[:300]


def _failure_message(exc: BaseException, kind: str, entry: Path) -> str:
    """One line for a failed build: the compiler's own words, where its whole output was saved,
    the setting most likely at fault, and how to watch the next build."""
    text = str(exc)
    log = entry.parent / f"{entry.name}.build-error.log"
    try:
        log.write_text(f"{type(exc).__name__}: {text}\n")
        where = f"full output in {log}"
    except OSError:
        where = "full output with AMPFUNC_REQUIRE_EXT=1"
    msg = (f"building the {kind} kernels failed: {_failure_cause(text)} "
           f"({where}; AMPFUNC_EXT_VERBOSE=1 shows the compiler's output")
    raw_march = os.environ.get("AMPFUNC_EXT_MARCH", "").strip()
    if raw_march:
        msg += f"; AMPFUNC_EXT_MARCH={raw_march!r} is set"
    if os.environ.get("CXX", "").strip():
        msg += f"; CXX={os.environ['CXX']!r} is set"
    return msg + ")"


def _unwritable(root: Path, exc: OSError) -> RuntimeError:
    default = "" if os.environ.get("AMPFUNC_EXT_CACHE") else " (the default, ~/.cache/ampfunc/ext)"
    return RuntimeError(f"the kernel cache {root}{default} is not writable ({exc.strerror or exc}): "
                        f"set AMPFUNC_EXT_CACHE to a writable folder")


_LOADED: list = []  # the path of the library this process loaded


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))
    _LOADED[:] = [path]


def direct_module():
    """The loaded library's direct door (eager CPU calls that skip the dispatcher; see
    ext/glue/direct.h, namespace ``direct``), or None when no library is loaded or it has none."""
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
    """Loads the cached build of the current sources, building it first if there is none or it
    is damaged. Returns where the library came from."""
    src = source_dir()
    if src is None:
        raise RuntimeError("the C++ sources (ext/bindings.cpp) are not shipped with this installation")
    cflags = cpu_flags()
    record = build_record(src, with_cuda, cflags)
    entry = _entry(record)
    lib, _ = _check_entry(entry)
    if lib is not None:
        _load_library(lib)
        return str(lib)
    root = entry.parent
    kind = "CPU+CUDA" if with_cuda else "CPU"
    with contextlib.ExitStack() as stack:
        try:
            root.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_locked(root / f".{entry.name}.lock", f"the {kind} kernels into {entry}"))
        except OSError as exc:
            raise _unwritable(root, exc) from exc
        lib, damage = _check_entry(entry)
        if lib is not None:  # built by the process we waited for
            _load_library(lib)
            return str(lib)
        _check_compiler()
        check_march()
        _remove_stale_temporaries(root, entry)
        what = f"the {kind} kernels ({' '.join(cflags)}) into {entry} (about a minute)..."
        if damage:  # one line: what was wrong, and that it is being replaced
            print(f"ampfunc: the cached kernels in {entry} are damaged ({damage}); rebuilding {what}",
                  file=sys.stderr, flush=True)
        else:
            print(f"ampfunc: building {what}", file=sys.stderr, flush=True)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=root))
        except OSError as exc:
            raise _unwritable(root, exc) from exc
        try:
            try:
                _compile(src, with_cuda, cflags, tmp)  # loads the library from tmp
            except Exception as exc:  # noqa: BLE001 - any failure: say why in one line, keep the log
                raise RuntimeError(_failure_message(exc, kind, entry)) from exc
            built = _library_in(tmp)
            if built is None:
                raise RuntimeError(f"building the {kind} kernels produced no library in {tmp}")
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache's entry from other users
            _fsync(built)
            with open(tmp / "build.json", "w") as f:
                json.dump(dict(record, library=_library_record(built)), f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _fsync(tmp)
            if entry.exists():  # damaged: set aside, then the new one takes its name at once
                aside = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=root))
                os.rename(entry, aside / "damaged")
                shutil.rmtree(aside, ignore_errors=True)
            try:
                os.rename(tmp, entry)  # atomic: the entry appears complete or not at all
            except OSError:
                if _check_entry(entry)[0] is None:  # not a concurrent winner: a real error
                    raise
            _fsync(root)
            with contextlib.suppress(OSError):
                (root / f"{entry.name}.build-error.log").unlink()  # an earlier failure's, now stale
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
    # One version string can name ABI-incompatible torches (nightlies, source builds): compare
    # the commits when both sides know theirs. The compiler (record["cxx"]) is not compared: the
    # C++ ABI follows torch's headers and flags, and the JIT key holds it only to rebuild on a switch.
    built_git, here_git = record.get("torch_git") or "", getattr(torch.version, "git_version", "") or ""
    if built_git.lower() not in ("", "unknown") and here_git.lower() not in ("", "unknown") and built_git != here_git:
        return f"built against torch commit {built_git[:12]}, this torch is commit {here_git[:12]}"
    m = record.get("march")
    if m == "native":
        if record.get("cpu") != _cpu_tag():
            return "built with -march=native on another CPU"
    elif m and not _cpu_runs(m):
        return f"built with -march={m}, which this CPU does not run"
    return None


def _load_prebuilt(with_cuda: bool) -> str | None:
    if not env_flag("AMPFUNC_EXT_PREBUILT", default=True):
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
    raises instead under ``AMPFUNC_REQUIRE_EXT=1``; a malformed setting (see :func:`env_flag`,
    :func:`cpu_pool_mb`) raises ``ValueError`` naming it.
    """
    if env_flag("AMPFUNC_DISABLE_EXT"):
        return "reference", "AMPFUNC_DISABLE_EXT is set"
    require = env_flag("AMPFUNC_REQUIRE_EXT")
    # Every setting is checked before anything is built or loaded: a misspelt one raises,
    # naming it, here rather than being swallowed into a fallback below or misread later.
    env_flag("AMPFUNC_EXT_PREBUILT", default=True)
    env_flag("AMPFUNC_EXT_VERBOSE")
    cpu_pool_mb()
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
    if not env_flag("AMPFUNC_EXT_CUDA", default=True):
        return False
    if not torch.cuda.is_available():
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None
