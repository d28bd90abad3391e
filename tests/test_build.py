"""The build cache (ampfunc/_build.py): keyed by content, shared across paths, one build at a time.

Only the subprocess test loads the real extension (from the cache this test run already built);
the others replace the compiler with a stand-in, so nothing here compiles.
"""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ampfunc
from ampfunc import _build, ops

PACKAGE = Path(ampfunc.__file__).resolve().parent


def _copy_sources(dst: Path) -> Path:
    src = _build.source_dir()
    assert src is not None, "these tests need the C++ sources"
    shutil.copytree(src, dst)
    return dst


def _copy_package(root: Path) -> Path:
    """A second copy of the imported ampfunc (a checkout or a wheel install) at another path, its
    sources where that layout keeps them, without a prebuilt library (so it goes to the cache)."""
    shutil.copytree(PACKAGE, root / "ampfunc",
                    ignore=shutil.ignore_patterns("__pycache__", "_kernels*", "_ext"))
    _copy_sources(root / "ampfunc" / "_ext")
    return root


def test_copies_of_the_sources_at_other_paths_load_the_same_cached_build_without_rebuilding(tmp_path):
    if ops.backend() == "reference":
        pytest.skip("no compiled kernels in this process: " + str(ops.backend_reason()))
    (lib,) = [Path(p) for p in torch.ops.loaded_libraries if "ampfunc" in p]
    if lib.parent == PACKAGE:
        pytest.skip(f"this process loaded the library built into the package ({lib.name})")
    entry = _build.cache_dir(with_cuda=ops.backend() == "cpu+cuda")
    # The process that built the entry loaded the library from its temporary directory, which
    # was then renamed to the entry; any other process loads it from the entry.
    assert lib.parent == entry or lib.parent.name.startswith(f".tmp-{entry.name}-"), \
        f"the key moved: loaded {lib}, the key now names {entry}"
    lib = entry / lib.name
    before = {p.name: p.stat().st_mtime_ns for p in entry.parent.iterdir()}
    lib_mtime = lib.stat().st_mtime_ns
    env = dict(os.environ, AMPFUNC_EXT_CACHE=str(entry.parent), AMPFUNC_REQUIRE_EXT="1", AMPFUNC_EXT_PREBUILT="0")
    for copy in ("a", "b/deeper"):
        root = _copy_package(tmp_path / copy)
        env["PYTHONPATH"] = str(root)
        out = subprocess.run([sys.executable, "-c", "import ampfunc, torch; from ampfunc import ops; "
                              "print(ampfunc.__file__); print(ops.backend()); print(*torch.ops.loaded_libraries)"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        file, backend, loaded = out.stdout.splitlines()
        assert Path(file).resolve().is_relative_to(root) and backend == ops.backend()
        assert Path(loaded) == lib  # the very library this process loaded
        assert "building" not in out.stderr, out.stderr
    assert lib.stat().st_mtime_ns == lib_mtime  # not rebuilt, not rewritten
    assert {p.name: p.stat().st_mtime_ns for p in entry.parent.iterdir()} == before  # no new entry


def test_a_real_build_call_does_not_move_the_key(tmp_path, monkeypatch):
    # cpp_extension.load appends its -L/-l flags to the lists it is given; the key of the
    # process's later lookups must not move with them.
    from torch.utils import cpp_extension

    def fake_load(**kw):
        for flags in (kw["extra_cflags"], kw["extra_cuda_cflags"], kw["extra_ldflags"]):
            flags.append("-lsomething")
        (Path(kw["build_directory"]) / "ampfunc_ext.so").write_text("")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(_build, "_load_library", lambda p: None)
    monkeypatch.setenv("AMPFUNC_EXT_CACHE", str(tmp_path))
    before = _build.cache_dir(False)
    _build._build(False)
    assert _build.cache_dir(False) == before and (before / "ampfunc_ext.so").is_file()


def test_the_key_follows_content_and_flags_not_paths(tmp_path, monkeypatch):
    monkeypatch.delenv("AMPFUNC_EXT_MARCH", raising=False)
    a = _copy_sources(tmp_path / "a" / "ext")
    b = _copy_sources(tmp_path / "b" / "elsewhere")
    monkeypatch.setattr(_build, "source_dir", lambda: a)
    key_a = _build.cache_dir(False)
    monkeypatch.setattr(_build, "source_dir", lambda: b)
    assert _build.cache_dir(False) == key_a  # same bytes at another path: the same entry
    with open(b / "cpu" / "kernels.cpp", "a") as f:
        f.write("\n// an edit\n")
    edited = _build.cache_dir(False)
    assert edited != key_a and edited.parent == key_a.parent  # an edited source: a new entry
    (b / "cpu" / "extra.h").write_text("// a new header\n")
    assert _build.cache_dir(False) not in (key_a, edited)  # headers count too
    monkeypatch.setattr(_build, "source_dir", lambda: a)
    monkeypatch.setenv("AMPFUNC_EXT_MARCH", "x86-64-v3")
    if _build.march() is not None:  # x86-64: the flags are in the key
        assert _build.cache_dir(False) != key_a


class _FakeCompiler:
    """Stands in for cpp_extension: 'compiles' by writing a file, slowly, and counts."""

    def __init__(self, fail=False):
        self.builds, self.fail, self.lock = 0, fail, threading.Lock()

    def __call__(self, src, with_cuda, cflags, build_dir):
        with self.lock:
            self.builds += 1
        time.sleep(0.3)  # long enough for the other threads to arrive while the build runs
        if self.fail:
            (build_dir / "half-written.o").write_text("")
            raise RuntimeError("compiler error")
        (build_dir / "ampfunc_ext.so").write_text("not really a library")


def _isolated_cache(tmp_path, monkeypatch, compiler):
    cache = tmp_path / "cache"
    monkeypatch.setenv("AMPFUNC_EXT_CACHE", str(cache))
    monkeypatch.delenv("AMPFUNC_EXT_MARCH", raising=False)
    monkeypatch.setattr(_build, "_compile", compiler)
    monkeypatch.setattr(_build, "_check_compiler", lambda: None, raising=False)  # the stand-in is the compiler
    snapshot = _copy_sources(tmp_path / "ext")  # others may edit ext/ meanwhile: the key must hold still
    monkeypatch.setattr(_build, "source_dir", lambda: snapshot)
    loaded = []
    monkeypatch.setattr(_build, "_load_library", lambda p: loaded.append(Path(p)))
    return cache, loaded


def test_concurrent_first_builds_build_once_and_every_build_says_where(tmp_path, monkeypatch, capfd):
    compiler = _FakeCompiler()
    cache, loaded = _isolated_cache(tmp_path, monkeypatch, compiler)
    results = []
    threads = [threading.Thread(target=lambda: results.append(_build._build(False))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entry = _build.cache_dir(False)
    assert compiler.builds == 1 and len(results) == 4
    assert loaded == [entry / "ampfunc_ext.so"] * 3  # the waiting three load what the first built
    assert sorted(p.name for p in entry.iterdir()) == ["ampfunc_ext.so", "build.json"]
    assert [p.name for p in cache.iterdir() if p.name.startswith(".tmp-")] == []  # nothing half-done left
    err = capfd.readouterr().err
    assert err.count("ampfunc: building the CPU kernels") == 1 and str(entry) in err

    _build._build(False)  # a finished entry: loaded, not rebuilt, no message
    assert compiler.builds == 1 and "building" not in capfd.readouterr().err

    edited = _copy_sources(tmp_path / "edited")
    (edited / "cpu" / "kernels.cpp").write_text("// changed\n", encoding="utf-8")
    monkeypatch.setattr(_build, "source_dir", lambda: edited)
    _build._build(False)  # new sources: a second build, with its own line
    assert compiler.builds == 2 and "ampfunc: building the CPU kernels" in capfd.readouterr().err
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2


def test_a_failed_build_leaves_no_entry_behind(tmp_path, monkeypatch):
    compiler = _FakeCompiler(fail=True)
    cache, _ = _isolated_cache(tmp_path, monkeypatch, compiler)
    with pytest.raises(RuntimeError, match="compiler error"):
        _build._build(False)
    assert [p for p in cache.iterdir() if p.is_dir()] == []  # no entry that looks finished, no temp dir
    compiler.fail = False
    _build._build(False)  # the next import simply builds
    assert compiler.builds == 2 and (_build.cache_dir(False) / "ampfunc_ext.so").is_file()


def _record(**changes):
    src = _build.source_dir()
    rec = _build.build_record(src, False, _build.cpu_flags(ahead_of_time=True))
    rec.update(changes)
    return rec


def test_a_prebuilt_library_is_used_only_where_its_record_matches(monkeypatch):
    monkeypatch.delenv("AMPFUNC_EXT_MARCH", raising=False)
    rec = _record()
    if rec["march"] and not _build._cpu_runs(rec["march"]):
        pytest.skip(f"this CPU does not run -march={rec['march']}")
    assert _build.prebuilt_mismatch(rec, with_cuda=False) is None
    assert "torch" in _build.prebuilt_mismatch(_record(torch="2.11.0+cu130"), False)
    assert "python" in _build.prebuilt_mismatch(_record(python="cpython-312"), False)
    assert "sources" in _build.prebuilt_mismatch(_record(sources="0" * 64), False)
    assert "with_cuda" in _build.prebuilt_mismatch(rec, with_cuda=True)
    assert "another CPU" in _build.prebuilt_mismatch(_record(march="native", cpu="deadbeef"), False)
    assert _build.prebuilt_mismatch(_record(march="native", cpu=_build._cpu_tag()), False) is None
    assert "does not run" in _build.prebuilt_mismatch(_record(march="some-future-cpu"), False)


def test_load_prefers_a_matching_prebuilt_library_and_compiles_nothing(tmp_path, monkeypatch, capfd):
    compiler = _FakeCompiler()
    cache, loaded = _isolated_cache(tmp_path, monkeypatch, compiler)
    monkeypatch.setattr(_build, "_want_cuda", lambda: False)
    monkeypatch.delenv("AMPFUNC_DISABLE_EXT", raising=False)
    monkeypatch.delenv("AMPFUNC_EXT_PREBUILT", raising=False)
    lib = tmp_path / "_kernels.cpython-311-x86_64-linux-gnu.so"
    good = _record(march=None, cpu=None)
    monkeypatch.setattr(_build, "prebuilt", lambda: (lib, good))
    assert _build.load() == ("cpu", None)
    assert loaded == [lib] and compiler.builds == 0 and not cache.exists()

    monkeypatch.setenv("AMPFUNC_EXT_PREBUILT", "0")  # the switch that ignores it
    assert _build.load() == ("cpu", None) and compiler.builds == 1
    monkeypatch.delenv("AMPFUNC_EXT_PREBUILT")

    monkeypatch.setattr(_build, "prebuilt", lambda: (lib, dict(good, torch="0.0.0")))
    capfd.readouterr()
    assert _build.load() == ("cpu", None)  # a mismatched one is passed over, with a line saying why
    assert "not using the prebuilt kernels" in capfd.readouterr().err and compiler.builds == 1


def test_a_prebuilt_library_from_another_torch_commit_is_not_used(monkeypatch):
    # One version string can name ABI-incompatible builds (nightlies, source builds).
    monkeypatch.delenv("AMPFUNC_EXT_MARCH", raising=False)
    monkeypatch.setattr(torch.version, "git_version", "a" * 40, raising=False)
    rec = _record(march=None, cpu=None, torch_git="a" * 40)
    assert _build.prebuilt_mismatch(rec, False) is None
    why = _build.prebuilt_mismatch(dict(rec, torch_git="b" * 40), False)
    assert why is not None and "commit" in why and "bbbbbbbbbbbb" in why
    # A side that does not know its commit is not held against it; the compiler is not compared.
    assert _build.prebuilt_mismatch(dict(rec, torch_git="Unknown"), False) is None
    assert _build.prebuilt_mismatch(dict(rec, cxx="clang++-99"), False) is None
    monkeypatch.setattr(torch.version, "git_version", "", raising=False)
    assert _build.prebuilt_mismatch(dict(rec, torch_git="b" * 40), False) is None


# ---- damaged cache entries ---------------------------------------------------------------------


def test_a_cache_entry_records_its_library_size_and_checksum(tmp_path, monkeypatch):
    cache, _ = _isolated_cache(tmp_path, monkeypatch, _FakeCompiler())
    _build._build(False)
    entry = _build.cache_dir(False)
    rec = json.loads((entry / "build.json").read_text())["library"]
    lib = entry / "ampfunc_ext.so"
    assert rec == {"name": lib.name, "size": lib.stat().st_size,
                   "sha256": __import__("hashlib").sha256(lib.read_bytes()).hexdigest()}


@pytest.mark.parametrize("damage", ["truncated", "empty", "same size, other bytes", "no checksum recorded"])
def test_a_damaged_cache_entry_is_rebuilt_and_replaced_not_loaded(tmp_path, monkeypatch, capfd, damage):
    # A truncated library in an entry once killed every later import with SIGBUS (no message); an
    # empty one made every process fall back to the reference for good.
    compiler = _FakeCompiler()
    cache, loaded = _isolated_cache(tmp_path, monkeypatch, compiler)
    _build._build(False)
    entry = _build.cache_dir(False)
    lib = entry / "ampfunc_ext.so"
    good = lib.read_bytes()
    if damage == "truncated":
        lib.write_bytes(good[:5])
    elif damage == "empty":
        lib.write_bytes(b"")
    elif damage == "same size, other bytes":
        lib.write_bytes(b"X" * len(good))
    else:  # an entry written before build.json recorded the library
        meta = json.loads((entry / "build.json").read_text())
        del meta["library"]
        (entry / "build.json").write_text(json.dumps(meta))
    capfd.readouterr()
    loaded.clear()
    _build._build(False)
    err = capfd.readouterr().err
    assert compiler.builds == 2 and loaded == []  # rebuilt; the damaged file was never loaded
    assert lib.read_bytes() == good and _build._check_entry(entry) == (lib, None)
    lines = [line for line in err.splitlines() if line.startswith("ampfunc:")]
    assert len(lines) == 1 and "damaged" in lines[0] and "rebuilding" in lines[0] and str(entry) in lines[0], err
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == [entry.name]  # replaced, nothing set aside
    _build._build(False)  # and now it is simply loaded
    assert compiler.builds == 2 and loaded == [lib]


# ---- why a build failed ------------------------------------------------------------------------

# The shape of torch's exception when ninja fails: the compiler commands first, the cause later.
_TORCH_ERROR = (
    "Error building extension 'ampfunc_ext': [1/3] c++ -MMD -MF bindings.o.d -DTORCH_EXTENSION_NAME=ampfunc_ext "
    "-isystem /site-packages/torch/include -fPIC -std=c++20 -O3 -fopenmp -march=foo "
    "-c /ext/bindings.cpp -o bindings.o \n"
    "FAILED: bindings.o \n"
    "c++ -MMD -MF bindings.o.d -fPIC -std=c++20 -O3 -fopenmp -march=foo -c /ext/bindings.cpp -o bindings.o \n"
    "cc1plus: error: bad value 'foo' for '-march=' switch\n"
    "cc1plus: note: valid arguments to '-march=' switch are: nocona core2 x86-64 x86-64-v3 native\n"
    "[2/3] c++ -MMD -MF kernels.o.d -fPIC -O3 -march=foo -c /ext/cpu/kernels.cpp -o kernels.o \n"
    "FAILED: kernels.o \n"
    "c++ -MMD -MF kernels.o.d -fPIC -O3 -march=foo -c /ext/cpu/kernels.cpp -o kernels.o \n"
    "cc1plus: error: bad value 'foo' for '-march=' switch\n"
    "ninja: build stopped: subcommand failed.\n")


def _failing_compiler(text):
    def compile_(src, with_cuda, cflags, build_dir):
        (build_dir / "bindings.o").write_text("")
        raise RuntimeError(text)
    return compile_


def test_a_failed_build_names_the_compilers_cause_in_one_line_and_keeps_the_log(tmp_path, monkeypatch):
    cache, _ = _isolated_cache(tmp_path, monkeypatch, _failing_compiler(_TORCH_ERROR))
    monkeypatch.setattr(_build, "_want_cuda", lambda: False)
    monkeypatch.setattr(_build, "prebuilt", lambda: None)
    for name in ("AMPFUNC_DISABLE_EXT", "AMPFUNC_REQUIRE_EXT", "AMPFUNC_CPU_POOL_MB"):
        monkeypatch.delenv(name, raising=False)
    with pytest.warns(UserWarning) as caught:
        backend, why = _build.load()
    assert backend == "reference"
    assert "bad value 'foo' for '-march=' switch" in why and "-MMD" not in why  # the cause, not the command
    assert why.count("bad value") == 1 and "\n" not in why  # once, on one line
    assert "AMPFUNC_EXT_VERBOSE=1" in why
    log = cache / f"{_build.cache_dir(False).name}.build-error.log"
    assert str(log) in why and log.read_text().count("bad value") == 2  # the whole output survives
    assert why in str(caught[0].message)
    monkeypatch.setenv("AMPFUNC_REQUIRE_EXT", "1")
    with pytest.raises(RuntimeError, match="bad value 'foo'"):
        _build.load()
    # A later successful build removes the failure's log.
    monkeypatch.setattr(_build, "_compile", _FakeCompiler())
    monkeypatch.setattr(_build, "_load_library", lambda p: None)
    _build._build(False)
    assert not log.exists()


def test_a_build_without_a_compiler_says_so(tmp_path, monkeypatch):
    # Said before ninja runs (the real build path, which then stops at once)...
    monkeypatch.setenv("AMPFUNC_EXT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "no-such-compiler-ampfunc")
    for name in ("AMPFUNC_DISABLE_EXT", "AMPFUNC_REQUIRE_EXT", "AMPFUNC_EXT_MARCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_build, "_want_cuda", lambda: False)
    monkeypatch.setattr(_build, "prebuilt", lambda: None)
    monkeypatch.setattr(_build, "_load_library", lambda p: None)
    with pytest.warns(UserWarning):
        backend, why = _build.load()
    assert backend == "reference"
    assert "no C++ compiler: 'no-such-compiler-ampfunc' (CXX=" in why and "set CXX" in why, why
    # ...and found in the compiler's output when the shell is what says it.
    missing = "/bin/sh: 1: c++: not found"
    text = _TORCH_ERROR.replace("cc1plus: error: bad value 'foo' for '-march=' switch", missing)
    assert _build._failure_cause(text).startswith(missing)


def test_an_explicit_march_the_compiler_refuses_is_named_before_building(monkeypatch):
    if _build.march() is None or shutil.which(_build._cxx()[0]) is None:
        pytest.skip("needs x86-64 and a C++ compiler")
    monkeypatch.setenv("AMPFUNC_EXT_MARCH", "foo")
    with pytest.raises(ValueError, match=r"AMPFUNC_EXT_MARCH='foo'.*-march=foo"):
        _build.check_march()
    monkeypatch.setenv("AMPFUNC_EXT_MARCH", "x86-64-v3")
    _build.check_march()  # accepted
    monkeypatch.setenv("AMPFUNC_EXT_MARCH", "none")
    _build.check_march()  # no -march at all


# ---- an unwritable cache -----------------------------------------------------------------------


@pytest.mark.parametrize("where", ["AMPFUNC_EXT_CACHE", "default under HOME"])
def test_an_unwritable_cache_says_so_and_names_AMPFUNC_EXT_CACHE(tmp_path, monkeypatch, where):
    cache, _ = _isolated_cache(tmp_path, monkeypatch, _FakeCompiler())
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # nothing can be created below a file, whoever runs the test (root too)
    if where == "AMPFUNC_EXT_CACHE":
        monkeypatch.setenv("AMPFUNC_EXT_CACHE", str(blocker / "cache"))
    else:
        monkeypatch.delenv("AMPFUNC_EXT_CACHE")
        monkeypatch.setenv("HOME", str(blocker))
    with pytest.raises(RuntimeError) as info:
        _build._build(False)
    msg = str(info.value)
    assert "not writable" in msg and "set AMPFUNC_EXT_CACHE to a writable folder" in msg
    assert str(blocker) in msg
    assert ("~/.cache/ampfunc/ext" in msg) == (where != "AMPFUNC_EXT_CACHE")


# ---- leftovers of killed builds ----------------------------------------------------------------


def test_a_build_removes_what_killed_builds_left_and_nothing_in_use(tmp_path, monkeypatch):
    cache, _ = _isolated_cache(tmp_path, monkeypatch, _FakeCompiler())
    entry = _build.cache_dir(False)
    cache.mkdir()
    mine = cache / f".tmp-{entry.name}-k1ll3d_x"  # this entry's: its lock is ours while we build
    free = cache / ".tmp-cpu-torch2.0-cpython-311-0123456789abcdef-abc_1234"  # another entry, lock free
    busy = cache / ".tmp-cpu-torch2.0-cpython-311-fedcba9876543210-def_5678"  # another entry, building now
    for d in (mine, free, busy):
        (d / "sub").mkdir(parents=True)
    with open(cache / ".cpu-torch2.0-cpython-311-fedcba9876543210.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        _build._build(False)
        assert not mine.exists() and not free.exists() and busy.exists()
        old = time.time() - 2 * _build._STALE_S
        os.utime(busy, (old, old))  # a build does not run for hours: that one was killed too
        shutil.rmtree(entry)
        _build._build(False)
        assert not busy.exists()


# ---- ninja -------------------------------------------------------------------------------------


def test_the_build_finds_the_packaged_ninja_when_path_has_none(tmp_path, monkeypatch):
    # torch runs `ninja` from PATH; the ninja package (a dependency) installs it beside the
    # environment's python, off PATH when that python runs without activating the environment.
    import importlib.util

    if importlib.util.find_spec("ninja") is None:
        pytest.skip("the ninja package is not installed in this environment")
    from torch.utils import cpp_extension

    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(cpp_extension.is_ninja_available()))
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    _build._compile(_build.source_dir(), False, ["-O3"], tmp_path)
    assert seen == [True]
    assert os.environ["PATH"] == str(empty)  # restored


# ---- settings ----------------------------------------------------------------------------------


def test_every_switch_takes_the_same_spellings_and_refuses_others_by_name(monkeypatch):
    for value, expected in [("1", True), ("true", True), (" Yes ", True), ("ON", True),
                            ("0", False), ("false", False), ("No", False), (" off", False)]:
        monkeypatch.setenv("AMPFUNC_SOME_SWITCH", value)
        assert _build.env_flag("AMPFUNC_SOME_SWITCH") is expected
        assert _build.env_flag("AMPFUNC_SOME_SWITCH", default=True) is expected
    monkeypatch.setenv("AMPFUNC_SOME_SWITCH", " ")
    assert _build.env_flag("AMPFUNC_SOME_SWITCH", default=True) is True
    for bad in ("2", "maybe", "enabled", "0.0"):
        monkeypatch.setenv("AMPFUNC_SOME_SWITCH", bad)
        with pytest.raises(ValueError, match=f"AMPFUNC_SOME_SWITCH='{bad}'"):
            _build.env_flag("AMPFUNC_SOME_SWITCH")


@pytest.mark.parametrize("name", ["AMPFUNC_DISABLE_EXT", "AMPFUNC_REQUIRE_EXT", "AMPFUNC_EXT_PREBUILT",
                                  "AMPFUNC_EXT_CUDA", "AMPFUNC_EXT_VERBOSE", "AMPFUNC_DIRECT"])
def test_a_misspelt_switch_is_refused_before_anything_is_built_or_loaded(tmp_path, monkeypatch, name):
    compiler = _FakeCompiler()
    cache, loaded = _isolated_cache(tmp_path, monkeypatch, compiler)
    for other in ("AMPFUNC_DISABLE_EXT", "AMPFUNC_REQUIRE_EXT", "AMPFUNC_EXT_PREBUILT", "AMPFUNC_EXT_CUDA",
                  "AMPFUNC_EXT_VERBOSE", "AMPFUNC_DIRECT", "AMPFUNC_CPU_POOL_MB"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "maybe")
    monkeypatch.setattr(ops._loading, "_BACKEND", [None, None])
    monkeypatch.setattr(ops._loading, "_DIRECT", [None])
    with pytest.raises(ValueError, match=f"{name}='maybe'"):
        ops.load()
    assert compiler.builds == 0 and loaded == [] and not cache.exists()


@pytest.mark.parametrize("off", ["0", "false", "no", "off"])
def test_AMPFUNC_DIRECT_is_off_for_every_off_spelling(monkeypatch, off):
    # It took only "0": AMPFUNC_DIRECT=false left the direct door on.
    monkeypatch.setenv("AMPFUNC_DIRECT", off)
    monkeypatch.setattr(ops._loading, "_BACKEND", [None, None])
    monkeypatch.setattr(ops._loading, "_DIRECT", [None])
    monkeypatch.setattr(_build, "load", lambda: ("cpu", None))
    monkeypatch.setattr(_build, "direct_module", lambda: "the direct door")
    assert ops.load() == "cpu" and ops._loading._DIRECT[0] is None
    monkeypatch.setattr(ops._loading, "_BACKEND", [None, None])
    monkeypatch.setenv("AMPFUNC_DIRECT", "on")
    ops.load()
    assert ops._loading._DIRECT[0] == "the direct door"


def test_AMPFUNC_CPU_POOL_MB_is_a_whole_number_of_megabytes(tmp_path, monkeypatch):
    monkeypatch.delenv("AMPFUNC_CPU_POOL_MB", raising=False)
    assert _build.cpu_pool_mb() is None
    for good, mb in [("0", 0), ("512", 512), (" 64 ", 64), ("", None), (str((2**63 - 1) >> 20), (2**63 - 1) >> 20)]:
        monkeypatch.setenv("AMPFUNC_CPU_POOL_MB", good)
        assert _build.cpu_pool_mb() == mb
    # strtoull read these as 0 (pool off), 2, 1, 0, 2**64-1 and a wrapped 0
    for bad in ("abc", "2G", "1.5", "0.5", "-1", "+5", str(2**44), "9" * 5000):
        monkeypatch.setenv("AMPFUNC_CPU_POOL_MB", bad)
        with pytest.raises(ValueError, match=r"AMPFUNC_CPU_POOL_MB='.*': expected a whole number of megabytes"):
            _build.cpu_pool_mb()
    # load() checks it before building or loading anything
    compiler = _FakeCompiler()
    cache, loaded = _isolated_cache(tmp_path, monkeypatch, compiler)
    monkeypatch.delenv("AMPFUNC_DISABLE_EXT", raising=False)
    monkeypatch.setenv("AMPFUNC_CPU_POOL_MB", "2G")
    with pytest.raises(ValueError, match="AMPFUNC_CPU_POOL_MB='2G'"):
        _build.load()
    assert compiler.builds == 0 and loaded == []


@pytest.mark.slow
def test_the_library_keeps_its_default_pool_limit_for_a_bad_value_set_after_loading(tmp_path):
    if ops.backend() == "reference":
        pytest.skip("no compiled kernels in this process: " + str(ops.backend_reason()))
    code = ("import os, ampfunc as af; af.ops.load(); os.environ['AMPFUNC_CPU_POOL_MB'] = {!r}; "
            "print(af.ops.pool_stats()['limit_bytes'])")
    env = {k: v for k, v in os.environ.items() if k not in ("AMPFUNC_CPU_POOL_MB", "AMPFUNC_DIRECT")}
    env.update(AMPFUNC_REQUIRE_EXT="1", AMPFUNC_EXT_CUDA="0")
    for value, limit, warned in [("2G", 2048 << 20, True), (str(2**44), 2048 << 20, True), (" 7 ", 7 << 20, False)]:
        out = subprocess.run([sys.executable, "-c", code.format(value)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout.split()[-1]) == limit, (value, out.stdout)
        assert ("AMPFUNC_CPU_POOL_MB=" in out.stderr) == warned, out.stderr
