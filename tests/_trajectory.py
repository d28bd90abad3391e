"""Shared by the optimizer tests: a deterministic gradient trajectory, the same trajectory
driven through a pure transform and through a real torch.optim optimizer, and the 1e-6
relative comparison they are judged by."""

import torch

import ampfunc as af
from ampfunc.tree import tree_leaves


class Trajectory:
    """Gradients ``pull * p + noise(seed + k)`` at step ``k``: they depend on the params (a
    quadratic pull), so a trajectory that drifts from torch's keeps drifting and is caught."""

    def __init__(self, seed: int, pull: float, steps: int):
        self.seed, self.pull, self.steps = seed, pull, steps

    def grads_at(self, params, k):
        g = torch.Generator().manual_seed(self.seed + k)
        return af.tree.tree_map(lambda p: self.pull * p + torch.randn(p.shape, generator=g), params)

    def run_pure(self, tx, params, steps=None, state=None, start=0):
        """``steps`` updates of the pure transform ``tx``; returns ``(params, state)``."""
        state = tx.init(params) if state is None else state
        for k in range(start, start + (self.steps if steps is None else steps)):
            updates, state = tx.update(self.grads_at(params, k), state, params)
            params = af.apply_updates(params, updates)
        return params, state

    def run_torch(self, cls, params, steps=None, lr_at=None, **kw):
        """The same trajectory through ``cls(params, **kw)``; returns ``(params, optimizer)``."""
        params = af.tree.tree_map(lambda p: p.clone(), params)
        leaves = tree_leaves(params)
        opt = cls(leaves, **kw)
        for k in range(self.steps if steps is None else steps):
            if lr_at is not None:
                for group in opt.param_groups:
                    group["lr"] = lr_at(k)
            for p, g in zip(leaves, tree_leaves(self.grads_at(params, k))):
                p.grad = g
            opt.step()
        return params, opt


    def run_both_on(self, device, tx, cls, params, state=None, **kw):
        """The trajectory on ``device`` through the pure ``tx`` and through ``cls(**kw)`` side by
        side (gradients drawn on the CPU, then moved); returns ``(ours, theirs)``."""
        params = af.tree.tree_map(lambda p: p.to(device), params)
        state = tx.init(params) if state is None else state
        ours, theirs = params, af.tree.tree_map(lambda p: p.clone(), params)
        leaves = tree_leaves(theirs)
        opt = cls(leaves, **kw)
        for k in range(self.steps):
            grads = self.grads_at(af.tree.tree_map(lambda p: p.cpu(), ours), k)
            updates, state = tx.update(af.tree.tree_map(lambda g: g.to(device), grads), state, ours)
            ours = af.apply_updates(ours, updates)
            for p, g in zip(leaves, tree_leaves(self.grads_at(af.tree.tree_map(lambda p: p.cpu(), theirs), k))):
                p.grad = g.to(device)
            opt.step()
        return ours, theirs


def assert_rel_close(actual, expected, rel=1e-6, initial=None):
    """Every leaf within ``rel`` of the leaf's magnitude (the 1e-6 relative contract).

    The magnitude is the larger of the expected leaf and, when given, the leaf at the start of
    the trajectory: updates are deltas added to the params, and fp32 cannot always represent
    ``new - old`` exactly, so a param that wandered close to zero carries an error of an ulp
    of the size it had, not of its current size.
    """
    refs = tree_leaves(initial) if initial is not None else [None] * len(tree_leaves(expected))
    for a, e, r in zip(tree_leaves(actual), tree_leaves(expected), refs):
        assert a.dtype == e.dtype and a.shape == e.shape
        size = max(e.abs().max().item(), r.abs().max().item() if r is not None else 0.0, 1e-30)
        err = (a - e).abs().max().item()
        assert err <= rel * size, f"max |diff| {err} vs leaf magnitude {size}"
