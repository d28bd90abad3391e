"""The public API's docstrings are in optax's form, plus the line optax lacks.

For every function in ``ampfunc.__all__``: a summary line, ``Args:`` (when it takes
arguments), ``Returns:``, ``Example:`` and a ``Cost`` line (what it costs and whether it syncs
with the host). For every class: a summary line, its fields or arguments (``Attributes:`` or
``Args:``) and ``Example:``. Every example runs: its ``>>>``/``...`` lines are executed in a
fresh namespace holding ``torch``, ``F`` (``torch.nn.functional``), ``nn`` and ``af``; the
printed results are for the reader and are not compared (tensor reprs vary across versions).

README.md's API table lists every name in ``ampfunc.__all__``, once, with its kind and the first
paragraph of its docstring (no stale name, no missing one).
"""

import inspect
import pathlib
import re
import textwrap
import types

import pytest
import torch

import ampfunc as af


def _public():
    out = []
    for name in af.__all__:
        obj = getattr(af, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            out.append((name, obj))
    return out


PUBLIC = _public()


def _example_code(doc: str) -> str:
    """The ``>>>``/``...`` lines after ``Example:`` (or ``Examples:``), without the prompts."""
    lines, inside = [], False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Example:", "Examples:"):
            inside = True
            continue
        if not inside:
            continue
        if stripped.startswith(">>> ") or stripped == ">>>":
            lines.append(stripped[4:])
        elif stripped.startswith("... ") or stripped == "...":
            lines.append(stripped[4:])
    return textwrap.dedent("\n".join(lines))


def test_the_public_api_is_listed():
    assert len(PUBLIC) > 50


@pytest.mark.parametrize("name,obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_docstring_has_optax_sections_and_a_cost_line(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name}: no docstring"
    summary = doc.splitlines()[0]
    assert summary.strip() and not summary.startswith((" ", "Args")), f"{name}: no summary line"
    if inspect.isfunction(obj):
        takes_args = bool(inspect.signature(obj).parameters)
        need = (["Args:"] if takes_args else []) + ["Returns:", "Example:"]
        missing = [k for k in need if k not in doc]
        assert not missing, f"{name}: docstring lacks {missing}"
        assert "Cost" in doc, f"{name}: docstring lacks the Cost line (what it costs, whether it syncs)"
    else:
        assert "Attributes:" in doc or "Args:" in doc, f"{name}: docstring lists neither Attributes: nor Args:"
        assert "Example:" in doc, f"{name}: docstring lacks Example:"


@pytest.mark.parametrize("name,obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_docstring_example_runs(name, obj):
    code = _example_code(inspect.getdoc(obj) or "")
    if not code.strip():
        pytest.fail(f"{name}: no runnable example (>>> lines after Example:)")
    namespace = {"torch": torch, "F": torch.nn.functional, "nn": torch.nn, "af": af}
    torch.manual_seed(0)
    exec(compile(code, f"{name} docstring example", "exec"), namespace)


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
