"""The documentation site (docs/): every Python block of every page runs as written, and the API
reference covers the public API.

Each ```python block runs alone in a fresh namespace; a block fenced ```python continued runs
after the blocks before it on its page, and only on a page that says so (fence markers:
tests/_helpers.py). The API reference: every name of ``ampfunc.__all__`` is in an autosummary
of docs/api/index.md or, for a submodule, has its own page; every public submodule (each
``ampfunc.<name>`` without a leading underscore, and the modules their ``__all__`` lists) has a
page that documents its whole ``__all__``.
"""

import importlib
import os
import pkgutil
import re
import subprocess
import sys
import types

import pytest

import ampfunc
from _helpers import CONTINUED_PHRASE, ROOT, block_groups, doc_blocks, fence_problem, run_blocks

DOCS = ROOT / "docs"
API = DOCS / "api"
_SKIP_DIRS = {"_build", "generated", "notebooks"}


def _pages():
    return sorted(p for p in DOCS.rglob("*.md")
                  if not _SKIP_DIRS.intersection(p.relative_to(DOCS).parts))


PAGES = _pages()
BLOCKS = {p: doc_blocks(p) for p in PAGES}
GROUPS = [g for p in PAGES for g in block_groups(BLOCKS[p])]


def test_the_site_has_its_pages():
    names = {str(p.relative_to(DOCS)) for p in PAGES}
    for page in ("index.md", "getting_started.md", "recipes.md", "api/index.md", "contributing/index.md",
                 "guides/loss_scaling.md", "migration/torch_amp.md", "migration/apex.md",
                 "design/engine.md", "design/kernels.md", "design/benchmarks.md",
                 "reference/guarantees.md", "reference/errors.md", "reference/faq.md", "reference/limits.md"):
        assert page in names, page
    assert len(GROUPS) >= 30


def test_fences_are_known():
    problems = [p for page in PAGES for b in BLOCKS[page] if (p := fence_problem(b))]
    assert not problems, problems


def test_continued_blocks_are_announced_on_their_page():
    quiet = [str(p.relative_to(ROOT)) for p in PAGES
             if any(b.info == "continued" for b in BLOCKS[p]) and CONTINUED_PHRASE not in p.read_text()]
    assert not quiet, f"pages with ```python continued blocks that do not say so: {quiet}"


def test_recipes_live_on_the_recipes_page():
    recipes = {b.info for b in BLOCKS[DOCS / "recipes.md"] if b.info.startswith("recipe=")}
    assert recipes == {"recipe=lightning", "recipe=timm", "recipe=transformers"}


@pytest.mark.parametrize("chain", GROUPS, ids=[f"{g[-1].page[5:]}:{g[-1].line}" for g in GROUPS])
def test_docs_block_runs(chain, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_blocks(chain, "ampfunc_docs_block")


# -- the API reference ---------------------------------------------------------------------------

def _autosummary_names(text: str) -> set[str]:
    """Fully qualified names listed by the autosummary directives of a page."""
    out, module = set(), None
    for block in re.findall(r"```\{eval-rst\}\n(.*?)^```", text, re.S | re.M):
        module = (re.findall(r"^\.\. currentmodule:: (\S+)", block, re.M) or [module])[-1]
        for body in re.findall(r"^\.\. autosummary::\n((?:^(?:   .*)?\n)*)", block, re.M):
            for line in body.splitlines():
                entry = line.strip()
                if entry and not entry.startswith(":"):
                    out.add(entry.lstrip("~") if "." in entry else f"{module}.{entry}")
    return out


def _automodule_pages() -> dict[str, str]:
    """module name -> the options of the automodule directive documenting it."""
    out = {}
    for page in API.glob("*.md"):
        for name, options in re.findall(r"^\.\. automodule:: (\S+)\n((?:^   :.*\n)*)", page.read_text(), re.M):
            out[name] = options
    return out


def _public_modules() -> list[str]:
    found = []

    def visit(name):
        if name in found:
            return
        found.append(name)
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if isinstance(obj, types.ModuleType) and obj.__name__.startswith(name + "."):
                visit(obj.__name__)

    for info in pkgutil.iter_modules(ampfunc.__path__):
        if not info.name.startswith("_") and info.name != "examples":
            visit(f"ampfunc.{info.name}")
    return found


def test_the_api_reference_lists_every_top_level_name():
    listed = _autosummary_names((API / "index.md").read_text())
    pages = _automodule_pages()
    missing = []
    for name in ampfunc.__all__:
        obj = getattr(ampfunc, name)
        if isinstance(obj, types.ModuleType):
            if obj.__name__ not in pages:
                missing.append(f"{name} (a module: no page with '.. automodule:: {obj.__name__}')")
        elif f"ampfunc.{name}" not in listed:
            missing.append(name)
    stale = sorted(n for n in listed if n.startswith("ampfunc.") and n.count(".") == 1
                   and n.split(".")[1] not in ampfunc.__all__)
    assert not missing and not stale, f"missing from docs/api: {missing}; listed but not public: {stale}"


def test_the_api_reference_documents_every_public_submodule():
    pages = _automodule_pages()
    public = _public_modules()
    missing = [m for m in public if m not in pages]
    partial = [m for m in public if m in pages and not {":members:", ":undoc-members:"} <= set(pages[m].split())]
    stale = [m for m in pages if m not in public]
    assert not missing and not partial and not stale, (
        f"no page: {missing}; a page without :members: and :undoc-members: {partial}; "
        f"pages of no public module: {stale}")
    for m in public:  # the page documents __all__, so every name in it must exist
        module = importlib.import_module(m)
        absent = [n for n in getattr(module, "__all__", []) if not hasattr(module, n)]
        assert not absent, f"{m}.__all__ names what it does not have: {absent}"


@pytest.mark.slow
def test_the_site_builds_without_a_warning(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_nb")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "html" / "api" / "index.html").is_file()
