"""The build cache (ampfunc/_build.py): keyed by content, shared across paths, one build at a time.

Only the subprocess test loads the real extension (from the cache this session already built);
the others replace the compiler with a stand-in, so nothing here compiles.
"""

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
    monkeypatch.setattr(_build, "_compile", compiler)
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
