"""A normal (non-editable) install has the kernels: the sdist and the wheel carry ext/'s sources,
and the installed package builds (or, from this test run's cache, loads) them exactly as a
checkout does. ``.ci/run`` goes further: a truly fresh virtual environment, torch from the wheel
on disk, and the whole suite against the installed package (AMPFUNC_EXPECT_INSTALLED=1)."""

import hashlib
import os
import site
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import ampfunc
from ampfunc import _build, ops

CHECKOUT = Path(__file__).resolve().parents[1]
PROJECT_FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE")


def test_the_suite_imports_the_installed_package_when_ci_says_it_does():
    if not os.environ.get("AMPFUNC_EXPECT_INSTALLED"):
        pytest.skip("set by .ci/run, which runs the suite against a wheel installed in a fresh venv")
    here = Path(ampfunc.__file__).resolve()
    assert not here.is_relative_to(CHECKOUT), f"the suite imported the checkout's ampfunc ({here})"
    assert "site-packages" in here.parts
    assert (here.parent / "_ext" / "bindings.cpp").is_file()  # the shipped sources
    assert ops.backend() != "reference", ops.backend_reason()


def _pyproject() -> dict:
    if not (CHECKOUT / "pyproject.toml").is_file():
        pytest.skip("needs a source checkout")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((CHECKOUT / "pyproject.toml").read_text())


def test_a_plain_install_brings_ninja_which_the_kernel_build_needs():
    # torch.utils.cpp_extension builds with ninja; only the extras had it, so a plain
    # `pip install ampfunc` on a machine without a system ninja silently ran the reference.
    deps = _pyproject()["project"]["dependencies"]
    assert any(d.replace(" ", "").lower().startswith("ninja") for d in deps), deps


# The Apache License 2.0 as apache.org publishes it (LICENSE-2.0.txt).
_APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_the_declared_license_ships_in_full():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (CHECKOUT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == _APACHE_2_SHA256, "LICENSE is not the verbatim Apache 2.0 text"


def _copy_project(dst: Path) -> Path:
    """The files a build reads, copied so the build writes nothing into the checkout."""
    import shutil

    dst.mkdir(parents=True)
    for name in PROJECT_FILES:
        shutil.copy2(CHECKOUT / name, dst / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "_kernels.json", "_ext", "*.egg-info")
    shutil.copytree(CHECKOUT / "ampfunc", dst / "ampfunc", ignore=ignore)
    shutil.copytree(CHECKOUT / "ext", dst / "ext", ignore=ignore)
    return dst


def _run(args, **kw):
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, args))}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_sdist_and_wheel_carry_the_sources_and_an_installed_wheel_runs_the_compiled_kernels(tmp_path):
    if not (CHECKOUT / "ext" / "bindings.cpp").is_file() or not (CHECKOUT / "setup.py").is_file():
        pytest.skip("needs a source checkout")
    if ops.backend() == "reference":
        pytest.skip("no compiled kernels in this process: " + str(ops.backend_reason()))
    project = _copy_project(tmp_path / "project")
    dist = tmp_path / "dist"
    # sdist first, then the wheel from the unpacked sdist: the path a `pip install ampfunc.tar.gz` takes.
    _run([sys.executable, "-c", f"from setuptools import build_meta as b; print(b.build_sdist({str(dist)!r}))"],
         cwd=project)
    (sdist,) = dist.glob("ampfunc-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "unpacked", filter="data")
    root = sdist.name.removesuffix(".tar.gz")
    assert f"{root}/ext/bindings.cpp" in names and f"{root}/ext/cpu/kernels.cpp" in names
    assert f"{root}/setup.py" in names and f"{root}/LICENSE" in names
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
          str(tmp_path / "unpacked" / root)], env=dict(os.environ, AMPFUNC_BUILD_EXT="0"))
    (wheel,) = dist.glob("ampfunc-*-py3-none-any.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("ampfunc/_ext/")}
    expected = {"ampfunc/_ext/" + p.relative_to(CHECKOUT / "ext").as_posix()
                for p in (CHECKOUT / "ext").rglob("*") if p.suffix in _build._SOURCE_SUFFIXES}
    assert shipped == expected
    licenses = [n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" in n and n.endswith("/LICENSE")]
    assert licenses and zipfile.ZipFile(wheel).read(licenses[0]) == (CHECKOUT / "LICENSE").read_bytes()
    # One version source (ampfunc.__version__, read by setuptools), and PEP 561's marker.
    assert wheel.name.startswith(f"ampfunc-{ampfunc.__version__}-")
    assert "ampfunc/py.typed" in zipfile.ZipFile(wheel).namelist()

    # Reuses this interpreter's torch (the truly fresh path is .ci/run's); outside the checkout.
    # A .pth line puts this environment's site-packages after the new venv's own, whether this
    # interpreter is a system Python or itself a venv (system_site_packages would reach past a
    # venv to its base, which may have no torch). Lines of a .pth add paths without running the
    # .pth files found there, so an editable ampfunc of this environment stays out of sight.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "_this_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = ["install", "-q", "--no-deps", "--force-reinstall", str(wheel)]
    _run([sys.executable, "-m", "pip", "--python", str(python), *install] if _pip_has_python_option()
         else [str(python), "-m", "pip", *install])
    # This test run's cache: the same sources give the same entry, so the install loads the build
    # this process uses instead of compiling again (one build shared by checkout and wheel).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AMPFUNC_DISABLE_EXT")}
    env.update(AMPFUNC_REQUIRE_EXT="1", AMPFUNC_EXT_CUDA="0")
    cache = _build.cache_dir(with_cuda=False).parent
    env["AMPFUNC_EXT_CACHE"] = str(cache)
    out = _run([str(python), "-c", "import ampfunc as af; print(af.__file__); print(af.ops.backend())"],
               cwd=tmp_path, env=env)
    file, backend = out.stdout.split()
    assert Path(file).is_relative_to(env_dir) and backend == "cpu"
    if _build.cache_dir(with_cuda=False).is_dir():  # this process built from the cache, not a prebuilt
        assert "building" not in out.stderr, out.stderr


def _pip_has_python_option() -> bool:
    out = subprocess.run([sys.executable, "-m", "pip", "--help"], capture_output=True, text=True)
    return "--python" in out.stdout
