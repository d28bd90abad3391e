"""Pytree helpers: paths, selection, finiteness, casting."""

import collections

import numpy as np
import pytest
import torch

import ampfunc as af
from ampfunc.tree import check_same_structure, float_leaves_with_paths, tree_cast, tree_map


def test_leaf_paths_are_dotted_and_printable():
    Pair = collections.namedtuple("Pair", "mu nu")
    tree = {"encoder": {"layers": [{"weight": torch.zeros(1)}, None]}, "opt": Pair(torch.ones(1), torch.ones(1))}
    assert [p for p, _ in af.tree.leaves_with_paths(tree)] == [
        "encoder.layers.0.weight", "opt.mu", "opt.nu"]
    assert af.tree.leaves_with_paths(torch.ones(1))[0][0] == "<root>"


def test_none_leaves_survive_maps():
    tree = {"a": torch.ones(2), "b": None}
    out = tree_map(lambda x: x * 2, tree)
    assert out["b"] is None and torch.equal(out["a"], torch.full((2,), 2.0))


def test_all_finite_ignores_integer_and_bool_leaves_and_is_true_for_empty_trees():
    assert bool(af.tree.all_finite({}))
    assert bool(af.tree.all_finite({"steps": torch.tensor(3), "mask": torch.tensor([True]), "w": torch.ones(2)}))
    assert not bool(af.tree.all_finite({"w": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)}))
    assert af.tree.all_finite({"w": torch.ones(1)}).dtype == torch.bool


def test_select_tree_picks_on_the_device_and_checks_python_leaves():
    new = {"w": torch.ones(2), "lr": 0.1}
    old = {"w": torch.zeros(2), "lr": 0.1}
    assert torch.equal(af.tree.select_tree(torch.tensor(False), new, old)["w"], torch.zeros(2))
    assert torch.equal(af.tree.select_tree(torch.tensor(True), new, old)["w"], torch.ones(2))
    with pytest.raises(ValueError, match="'lr'"):
        af.tree.select_tree(torch.tensor(True), {"lr": 0.1}, {"lr": 0.2})


def test_structure_mismatch_names_the_leaves():
    with pytest.raises(ValueError, match=r"decoder\.bias"):
        check_same_structure({"w": 1, "decoder": {"bias": 2}}, {"w": 1}, "grads", "params")


def test_float_leaves_with_paths_names_the_non_floating_leaf_and_dtype():
    with pytest.raises(TypeError, match=r"'bn\.num_batches_tracked'.*torch\.int64"):
        float_leaves_with_paths({"w": torch.ones(1), "bn": {"num_batches_tracked": torch.tensor(1)}}, "grads")


def test_tree_cast_touches_only_floating_tensors():
    tree = {"w": torch.ones(2), "n": torch.tensor(3), "a": np.ones(2), "s": "x"}
    out = tree_cast(tree, torch.float16)
    assert out["w"].dtype == torch.float16 and out["n"].dtype == torch.int64
    assert out["a"] is tree["a"] and out["s"] == "x"
