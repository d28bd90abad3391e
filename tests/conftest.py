"""Shared fixtures and helpers for the tests: small parameter trees, reproducible gradients of a
scaled loss with injected overflows, and a way to force the generic path."""

from __future__ import annotations

import pytest
import torch

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
    return af.tree_map(lambda p: scale * torch.randn(p.shape, generator=gen), tree)


def unregistered(tx: af.GradientTransformation) -> af.GradientTransformation:
    """``tx`` with an update function the kernel registry does not know: the generic path."""
    update = tx.update

    def generic_update(updates, state, params=None):
        return update(updates, state, params)

    return af.GradientTransformation(tx.init, generic_update)


def clone_tree(tree):
    """Detached copies of every tensor leaf (other leaves as they are)."""
    return af.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, tree)


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


@pytest.fixture
def params():
    """A fresh :func:`make_params` tree for each test that asks for it."""
    return make_params()
