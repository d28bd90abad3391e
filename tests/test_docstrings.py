"""The public API's docstrings are in optax's form, plus the line optax lacks.

For every function in ``ampfunc.__all__``: a summary line, ``Args:`` (when it takes
arguments), ``Returns:``, ``Example:`` and a ``Cost`` line (what it costs and whether it syncs
with the host). For every class: a summary line, its fields or arguments (``Attributes:`` or
``Args:``) and ``Example:``. Every example runs: its ``>>>``/``...`` lines are executed in a
fresh namespace holding ``torch``, ``F`` (``torch.nn.functional``), ``nn`` and ``af``; the
printed results are for the reader and are not compared (tensor reprs vary across versions).
"""

import inspect
import textwrap

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
