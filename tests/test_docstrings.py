"""The public API's docstrings: optax's form plus the line optax lacks, and examples that run.

The public API is ``ampfunc.__all__`` and the ``__all__`` of every public submodule (every
module of the package whose dotted name has no part starting with ``_``, except the example
jobs). Every name listed there resolves, and every function or class has a docstring whose first
line is a summary.

The names a training loop calls (``ampfunc.__all__``) and the ones that left the top level for
their home module (``ampfunc.mixed``, ``ampfunc.optim``, ``ampfunc.functional``,
``ampfunc.monitor``, ``ampfunc.tree``, ``ampfunc.flat``, ``ampfunc.loss_scale``,
``ampfunc.transform``, ``ampfunc.policy``, ``ampfunc.advisor``, ``ampfunc.stateful``) have the
full form. For a function: ``Args:`` (when it takes arguments), ``Returns:``, ``Example:`` and a
``Cost`` line (what it costs and whether it syncs with the host); for a class: ``Attributes:``
or ``Args:`` and ``Example:``.

Every example, in any public docstring (methods included), is a doctest whose printed output is
compared (``NORMALIZE_WHITESPACE`` and ``ELLIPSIS``), run in a namespace holding the module's
globals, ``torch``, ``F`` (``torch.nn.functional``), ``nn`` and ``af``. A fragment that needs
what a docstring cannot build (a file, a CUDA device, a trained model) is marked
``# doctest: +SKIP``.

README.md's API table lists every name in ``ampfunc.__all__``, once, with its kind and the first
paragraph of its docstring (no stale name, no missing one).
"""

import doctest
import importlib
import inspect
import pathlib
import pkgutil
import re
import types

import pytest
import torch

import ampfunc as af

# The modules that hold the names which left the top level: documented in full, like it.
HOMES = ("mixed", "optim", "functional", "monitor", "tree", "flat", "loss_scale", "transform", "policy", "advisor",
         "stateful")


def _public_modules() -> list[str]:
    names = ["ampfunc"]
    for info in pkgutil.walk_packages(af.__path__, "ampfunc."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts) or parts[1] == "examples":
            continue
        names.append(info.name)
    return names


MODULES = _public_modules()


def _full_form(module: str) -> bool:
    return module == "ampfunc" or module.split(".")[1] in HOMES


def _public():
    """``(label, obj, module, full_form)`` per public function or class, each object once,
    labelled by the first module that lists it (the top level first); full form when any
    module that lists it asks for it."""
    found: dict[int, list] = {}
    for module in MODULES:
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name, None)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                entry = found.setdefault(id(obj), [f"{module}.{name}", obj, module, False])
                entry[3] = entry[3] or _full_form(module)
    return [tuple(entry) for entry in found.values()]


PUBLIC = _public()
IDS = [label for label, *_ in PUBLIC]


@pytest.mark.parametrize("module", MODULES)
def test_module_all_resolves(module):
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    assert names is not None, f"{module}: no __all__"
    assert len(names) == len(set(names)), f"{module}.__all__ lists a name twice"
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ lists names it does not have: {missing}"


def test_top_level_covered():
    labels = {id(obj) for _, obj, _, _ in PUBLIC}
    for name in af.__all__:
        obj = getattr(af, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert id(obj) in labels, name


@pytest.mark.parametrize("label,obj,module,full", PUBLIC, ids=IDS)
def test_docstring_form(label, obj, module, full):
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{label}: no docstring"
    summary = doc.splitlines()[0]
    assert summary.strip() and not summary.startswith((" ", "Args")), f"{label}: no summary line"
    if not full:
        return
    if inspect.isfunction(obj):
        takes_args = bool(inspect.signature(obj).parameters)
        need = (["Args:"] if takes_args else []) + ["Returns:", "Example:"]
        missing = [k for k in need if k not in doc]
        assert not missing, f"{label}: docstring lacks {missing}"
        assert "Cost" in doc, f"{label}: docstring lacks the Cost line (what it costs, whether it syncs)"
    else:
        assert "Attributes:" in doc or "Args:" in doc, f"{label}: docstring lists neither Attributes: nor Args:"
        assert "Example:" in doc, f"{label}: docstring lacks Example:"


_FINDER = doctest.DocTestFinder(exclude_empty=True)
_FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def _doctests(label, obj, module):
    home = importlib.import_module(obj.__module__)
    globs = {**vars(home), "torch": torch, "F": torch.nn.functional, "nn": torch.nn, "af": af}
    tests = _FINDER.find(obj, label, module=False, globs=globs)
    return [t for t in tests if t.examples]


@pytest.mark.parametrize("label,obj,module,full", PUBLIC, ids=IDS)
def test_docstring_examples(label, obj, module, full):
    tests = _doctests(label, obj, module)
    if full:
        own = [t for t in tests if t.name == label]
        assert own, f"{label}: no runnable example (>>> lines after Example:)"
    if not tests:
        return
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    report = []
    for test in tests:
        torch.manual_seed(0)
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


_README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _api_table() -> list[tuple[str, str, str]]:
    """``(name, kind, what it is)`` per row of the table under README.md's ``## API``."""
    text = _README.read_text()
    start = text.index("\n## API\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else None]
    return re.findall(r"^\| `([^`]+)` \| (\w+) \| (.*?) \|$", section, re.M)


def _kind(obj) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if inspect.isclass(obj):
        return "class"
    return "function" if callable(obj) else "constant"


def _plain(text: str) -> str:
    """Docstring or markdown text as one line: reST roles and double backticks as markdown's
    single ones, whitespace collapsed, the final period dropped, the first letter lowered."""
    text = re.sub(r":\w+:`~?([^`]*)`", r"`\1`", text).replace("``", "`")
    text = " ".join(text.split()).rstrip(".")
    return text[:1].lower() + text[1:]


def test_the_readme_api_table_lists_every_public_name_once_and_no_other():
    rows = _api_table()
    names = [name for name, _, _ in rows]
    assert len(rows) > 50, "README.md: no API table found under '## API'"
    missing = sorted(set(af.__all__) - set(names), key=str.lower)
    stale = sorted(set(names) - set(af.__all__), key=str.lower)
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not missing and not stale and not twice, (
        f"README.md's API table: missing {missing}, not in ampfunc.__all__ {stale}, listed twice {twice}")


def test_the_readme_api_table_gives_each_name_its_kind_and_docstring_summary():
    wrong = []
    for name, kind, what in _api_table():
        if name not in af.__all__:
            continue  # the test above names it
        obj = getattr(af, name)
        if _kind(obj) != kind:
            wrong.append(f"{name}: kind {kind!r}, is a {_kind(obj)}")
        elif kind != "constant":
            doc = inspect.getdoc(obj) or ""
            summary = doc.split("\n\n")[0]
            if _plain(what) not in (_plain(summary), _plain(doc.splitlines()[0] if doc else "")):
                wrong.append(f"{name}: README says {what!r}, the docstring {' '.join(summary.split())!r}")
    assert not wrong, "README.md's API table is out of date:\n" + "\n".join(wrong)
