"""The layers of DESIGN.md import one way: no cycles, no import (top-level or inside a function)
that reaches up to a higher layer. Checked on the source with ``ast`` (no import side effects),
plus one fresh interpreter importing the lowest layers alone."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "ampfunc"

# Lower number = lower layer. A module may import its own layer or below, never above.
LAYERS = [
    ("ampfunc._build", 0), ("ampfunc.ops", 0), ("ampfunc.lowbits", 0),
    ("ampfunc.tree", 1),
    ("ampfunc.flat", 2), ("ampfunc.loss_scale", 2), ("ampfunc.policy", 2), ("ampfunc.monitor", 2), ("ampfunc.fp8", 2),
    ("ampfunc.transform", 2), ("ampfunc.checkpoint", 2), ("ampfunc.lowmem", 2),
    ("ampfunc.dist", 3), ("ampfunc.shards", 3), ("ampfunc.advisor", 3),
    ("ampfunc.optim", 4),  # the package and everything in it
    ("ampfunc.fused", 5),
    ("ampfunc.engine", 6),
    ("ampfunc.mixed", 7),
    ("ampfunc.functional", 8), ("ampfunc.stateful", 8),
    ("ampfunc.compat", 9), ("ampfunc.examples", 9),
]


def layer_of(module: str):
    best = None
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    return None if best is None else best[1]


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(path: pathlib.Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """``(imported ampfunc module, line, at module level)`` for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(n) for n in tree.body}
    for node in tree.body:  # `try:` / `if:` blocks at module level are module level too
        if isinstance(node, (ast.Try, ast.If)):
            top_level |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            names += [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
        for name in names:
            if name == "ampfunc" or not name.startswith("ampfunc."):
                continue
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            out.append((name, node.lineno, id(node) in top_level))
    return out


def graph():
    mods = modules()
    known = set(mods)
    return mods, {m: imports_of(p, known) for m, p in mods.items()}


def test_every_module_has_a_layer():
    mods, _ = graph()
    missing = [m for m in mods if m != "ampfunc" and layer_of(m) is None]
    assert not missing, f"modules without a layer in tests/test_imports.py (add them to LAYERS): {missing}"


def test_no_import_reaches_up_a_layer():
    mods, edges = graph()
    bad = []
    for m, imps in edges.items():
        if m == "ampfunc":
            continue
        for target, line, _ in imps:
            lt, lm = layer_of(target), layer_of(m)
            if lt is not None and lm is not None and lt > lm:
                bad.append(f"{m}:{line} imports {target} (layer {lt} > {lm})")
    assert not bad, "imports reaching upward:\n" + "\n".join(bad)


def test_no_import_cycle():
    mods, edges = graph()
    adj = {m: sorted({t for t, _, _ in imps if t != m and t != "ampfunc"})
           for m, imps in edges.items() if m != "ampfunc"}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in adj.get(m, []):
            # a package importing its own submodules is how packages work, not a cycle
            if m.startswith(t + ".") and t in adj:
                continue
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if state.get(t) is None:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in adj:
        if state.get(m) is None:
            visit(m)


def test_a_cycle_would_be_caught(tmp_path, monkeypatch):
    # The checker itself: two modules importing each other are reported.
    pkg = tmp_path / "ampfunc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tree.py").write_text("from ampfunc import ops\n")
    (pkg / "ops.py").write_text("def f():\n    from ampfunc.tree import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    try:
        test_no_import_cycle()
    except AssertionError as e:
        assert "ampfunc.ops" in str(e) and "ampfunc.tree" in str(e)
    else:
        raise AssertionError("the cycle checker missed a cycle")
    try:
        test_no_import_reaches_up_a_layer()
    except AssertionError as e:
        assert "ampfunc.ops:2 imports ampfunc.tree" in str(e)
    else:
        raise AssertionError("the layer checker missed an upward import")


def test_engine_imports_alone():
    # Importing a low layer first must work (a cycle through ampfunc/__init__ would break here)
    # and must not pull torch.distributed.tensor (about a second) into every import.
    code = ("import sys, ampfunc.engine, ampfunc.fused, ampfunc.dist;"
            "print('torch.distributed.tensor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**__import__('os').environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_top_level_size():
    import ampfunc as af

    assert len(af.__all__) == len(set(af.__all__)) <= 50
    for name in af.__all__:
        assert hasattr(af, name), name


# Names that left the top level, and the module that holds each now.
MOVED = {
    "tree": ["tree_map", "tree_cast", "leaves_with_paths", "all_finite"],
    "transform": ["EmptyState", "FusedSpec", "ChainSpec", "named_chain"],
    "loss_scale": ["LossScale", "DynamicConfig"],
    "mixed": ["unscale", "unscale_and_check_", "skip_or_apply_", "update_scale_", "MixedPrecision"],
    "dist": ["agree_finite"],
    "policy": ["cast_floating", "buffers_of", "BATCH_NORM_TYPES", "NORM_LAYER_TYPES"],
    "monitor": ["StepStats", "init_stats", "record", "skip_rate", "health", "nonfinite_paths", "leaf_nonfinite",
                "MonitorConfig"],
    "advisor": ["Recommendation"],
    "optim": ["SgdState", "AdamState", "scale_by_adam", "TorchOptimizerState", "global_norm", "AccumulateState",
              "scale", "scale_by_learning_rate", "scale_by_schedule", "constant_schedule", "linear_schedule",
              "cosine_decay_schedule", "warmup_cosine_decay_schedule", "exponential_decay", "FusedSpec"],
    "functional": ["apply_module", "ValueAndGrad", "clip_per_example", "StepOutput", "TrainStep", "copy_to_module"],
    "stateful": ["TrainerState"],
    "flat": ["FlatTree", "flatten"],
}


def test_moved_names_homes():
    import importlib

    import ampfunc as af

    for module, names in MOVED.items():
        mod = importlib.import_module(f"ampfunc.{module}")
        for name in names:
            assert name in mod.__all__, f"ampfunc.{module}.__all__ lacks {name}"
            assert name not in af.__all__ and not hasattr(af, name), f"ampfunc.{name} is still at the top level"


def test_no_deprecation_shims():
    # Nothing was released, so nothing is kept under an old name: no module-level __getattr__
    # that answers for removed names, no DeprecationWarning anywhere in the package.
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        if "DeprecationWarning" in text or re.search(r"^def __getattr__\(", text, re.M):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders
