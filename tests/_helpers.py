"""Helpers the tests share: small parameter trees, reproducible gradients of a scaled loss with
injected overflows, a way to force the generic path, bit-level comparisons, and the Python blocks
of README.md and docs/ with the way the tests run them. (Fixtures live
in conftest.py; modules import these by name: ``from _helpers import make_params``.)"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

import ampfunc as af

SHAPES = {"enc.w": (33, 17), "enc.b": (33,), "head.w": (5, 33), "tiny": (1,)}
OVERFLOW_STEPS = frozenset({3, 11, 12})


def make_params(dtype=torch.float32, seed=0, shapes=SHAPES) -> dict:
    """A plain dict of random tensors (the layout ``af.params_of(model)`` gives)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}


def grads_at(step: int, scale=1.0, dtype=torch.float32, shapes=SHAPES, overflow_steps=OVERFLOW_STEPS) -> dict:
    """Gradients of a scaled loss for ``step``: random times ``scale``; on ``overflow_steps`` one
    element of ``enc.b`` is inf (odd steps) or NaN (even steps)."""
    gen = torch.Generator().manual_seed(1000 + step)
    g = {k: (torch.randn(s, generator=gen) * float(scale)).to(dtype) for k, s in shapes.items()}
    if step in overflow_steps:
        key = "enc.b" if "enc.b" in g else next(iter(g))
        g[key].view(-1)[-1] = float("inf") if step % 2 else float("nan")
    return g


def random_like(tree, seed: int, scale=1.0):
    """A tree like ``tree`` of fp32 normal samples times ``scale``, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return af.tree.tree_map(lambda p: scale * torch.randn(p.shape, generator=gen), tree)


def unregistered(tx: af.GradientTransformation) -> af.GradientTransformation:
    """``tx`` with an update function the kernel registry does not know: the generic path."""
    update = tx.update

    def generic_update(updates, state, params=None):
        return update(updates, state, params)

    return af.GradientTransformation(tx.init, generic_update)


def clone_tree(tree):
    """Detached copies of every tensor leaf (other leaves as they are)."""
    return af.tree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


def assert_trees_equal(a, b):
    """Bit equality, leaf by leaf (NaN == NaN)."""
    la, lb = af.tree.tree_leaves(a), af.tree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y) or (torch.isnan(x).any() and torch.equal(x.nan_to_num(), y.nan_to_num()))
        else:
            assert x == y


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values, flat (uint8): equal bits compare equal, NaN payloads and
    signed zeros included."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same dtype, shape and bits."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_tree_bits(a, b) -> bool:
    """Whether two pytrees have as many tensor leaves, each of the same dtype, shape and bits."""
    la, lb = af.tree.tree_leaves(a), af.tree.tree_leaves(b)
    return len(la) == len(lb) and all(same_bits(x, y) for x, y in zip(la, lb))


# -- the apex facades' fused steps against their old paths ------------------------------------


def exact(kernels, cls) -> bool:
    """Whether a fused torch step must equal the old path (torch's own step) bit for bit: SGD,
    on either backend. Adam's kernel and its plain-torch reference take a correctly rounded
    square root (ops.sqrt_rounded); torch's CPU sqrt (MKL's) is an ulp off for some inputs, so
    torch's single-tensor Adam differs in the last bit of a few elements."""
    return cls is torch.optim.SGD


def assert_same(a, b, is_exact, what=""):
    """Bit equality, or the tolerance of one kernel against another: a few fp32 ulps; a
    low-precision copy of masters one ulp apart may round to the neighbouring value."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if is_exact:
        assert torch.equal(a, b), what
    elif a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=what)
    else:
        torch.testing.assert_close(a, b, rtol=2 * torch.finfo(a.dtype).eps, atol=1e-5, msg=what)


def assert_states_same(sd_a, sd_b, is_exact):
    """Two torch optimizers' ``state_dict()``s: the same groups, keys, layouts, and values as
    :func:`assert_same` holds them (step counts always exactly)."""
    assert sd_a["param_groups"] == sd_b["param_groups"]
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for i in sd_a["state"]:
        assert sd_a["state"][i].keys() == sd_b["state"][i].keys()
        for k, v in sd_a["state"][i].items():
            w = sd_b["state"][i][k]
            assert (v.dtype, v.device, v.shape, v.stride()) == (w.dtype, w.device, w.shape, w.stride()), (i, k)
            assert_same(v, w, is_exact or k == "step", f"state[{i}][{k!r}]")


def fp16_optimizer_loop(opt, model, data, use_closure, loss_factor=lambda call: 1.0, after_backward=None) -> int:
    """apex's ``FP16_Optimizer`` loop over ``data`` (``(x, y)`` pairs, mean-squared error): with
    ``step(closure)``, or apex's plain loop, where an overflowing backward makes ``step()`` skip
    and the iteration is repeated by hand. ``loss_factor(call)`` multiplies the loss of the
    ``call``-th evaluation (1-based, over the whole run: ``inf`` injects an overflow);
    ``after_backward()`` runs after each backward. Returns the number of evaluations."""
    calls = [0]
    for x, y in data:
        def closure():
            calls[0] += 1
            opt.zero_grad()
            loss = F.mse_loss(model(x), y) * loss_factor(calls[0])
            opt.backward(loss)
            if after_backward is not None:
                after_backward()
            return loss

        if use_closure:
            assert opt.step(closure) is not None
        else:
            closure()
            while opt.overflow:
                assert opt.step() is None  # skipped
                closure()
            opt.step()
    return calls[0]


# -- the Python blocks of README.md and docs/ ------------------------------------------------------
#
# The Python blocks of the README and of the documentation pages, and how the tests run them.
#
# Fence conventions (docs/contributing/docs.md):
#
# - ```python                 runs as it is, alone, in a fresh namespace;
# - ```python continued       runs in the namespace the previous blocks of its page left; the page
#                             says so in its text ("continues the block before it");
# - ```python no-test         is not run (it needs a GPU or several processes);
# - ```python recipe=<pkg>    is run by tests/test_recipes.py when <pkg> imports.

ROOT = Path(__file__).resolve().parent.parent
CONTINUED_PHRASE = "continues the block before it"
_FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```\s*$", re.S | re.M)


class Block(NamedTuple):
    page: str   # path relative to the repository root
    index: int  # 0-based among the page's python blocks
    line: int   # 1-based line of the opening fence
    info: str   # what follows "python" on the fence line, stripped
    code: str


def doc_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    rel = str(path.relative_to(ROOT))
    return [Block(rel, i, text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2))
            for i, m in enumerate(_FENCE.finditer(text))]


def fence_problem(block: Block) -> str | None:
    info = block.info
    if info in ("", "continued", "no-test") or re.fullmatch(r"recipe=\w+", info):
        return None
    return f"{block.page}:{block.line}: unknown fence marker ```python {info}"


def runnable(block: Block) -> bool:
    return block.info in ("", "continued")


def block_groups(page_blocks: list[Block]) -> list[list[Block]]:
    """Each runnable block with the blocks it continues (a block marked `continued` runs after
    every runnable block of its page before it, back to the last one that is not)."""
    out, chain = [], []
    for b in page_blocks:
        if not runnable(b):
            continue
        chain = chain + [b] if b.info == "continued" else [b]
        out.append(list(chain))
    return out


def run_blocks(chain: list[Block], name: str) -> dict:
    """Runs the blocks of ``chain`` in order in one fresh module namespace; returns it."""
    # A real module: torch.compile looks the code's module up in sys.modules.
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        for b in chain:
            exec(compile(b.code, f"{b.page}:{b.line}", "exec"), module.__dict__)
    finally:
        sys.modules.pop(name, None)
    return module.__dict__


class SpyDoor:
    """The loaded direct door, recording which of its functions ampfunc.ops calls and whether
    each took the call (``(name, handled)``; NotImplemented hands it to the dispatcher)."""

    def __init__(self, door):
        self._door, self.calls = door, []

    def __getattr__(self, name):
        fn = getattr(self._door, name)

        def spied(*args):
            out = fn(*args)
            self.calls.append((name, out is not NotImplemented))
            return out

        return spied
