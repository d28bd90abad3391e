"""The per-structure shortcuts of the step paths never serve a stale tree.

The engine validates the params/master/state lists once per set of tensors (compared by
identity), takes a plain dict's values as its leaves without optree, and leaves the gradients'
dtypes to the kernels; the pure updates and ``apply_updates`` do the same with dicts. These
specs change the trees between steps in every way a user can and check that the change is
seen: the numbers, the errors naming the leaf, and nothing written before an error.
"""

from __future__ import annotations

import pytest
import torch

import ampfunc as af
from ampfunc.transform import GradientTransformation
from ampfunc.tree import tree_leaves

SHAPES = {"enc.w": (6, 4), "enc.b": (6,), "head.w": (3, 6), "tiny": (1,)}


def _params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()}


def _grads(step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in SHAPES.items()}


def _generic(tx):
    # the same transform, unregistered: the engine runs it through the pure primitives
    return GradientTransformation(tx.init, lambda u, s, p=None: tx.update(u, s, p))


def _copy(tree):
    return {k: v.clone() for k, v in tree.items()}


def _snapshot(*trees):
    return [t.clone() for t in tree_leaves(trees) if isinstance(t, torch.Tensor)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_in_place_step_sees_a_leaf_replaced_between_steps():
    tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
    params = _params()
    state = tx.init(params)
    params, state = tx.step_(params, _grads(0), state)
    fresh = torch.full(SHAPES["enc.b"], 0.5)
    params["enc.b"] = fresh  # same dict object, a new tensor in it
    params, state = tx.step_(params, _grads(1), state)
    assert params["enc.b"] is fresh and not torch.equal(fresh, torch.full(SHAPES["enc.b"], 0.5))
    # the reference: the same two steps without any cache in between
    ref_tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
    p2 = _params()
    s2 = ref_tx.init(p2)
    p2, s2 = ref_tx.step(p2, _grads(0), s2)
    p2 = dict(p2, **{"enc.b": torch.full(SHAPES["enc.b"], 0.5)})
    p2, s2 = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale()).step(p2, _grads(1), s2)
    assert all(torch.equal(params[k], p2[k]) for k in SHAPES)


def test_in_place_step_refuses_a_replaced_leaf_of_the_wrong_shape_naming_it_and_writing_nothing():
    tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
    params = _params()
    state = tx.init(params)
    params, state = tx.step_(params, _grads(0), state)
    params["head.w"] = torch.zeros(4, 4)
    before = _snapshot(params, state)
    with pytest.raises(ValueError, match="head.w"):
        tx.step_(params, _grads(1), state)
    assert _same(_snapshot(params, state), before)


def test_in_place_step_refuses_a_leaf_made_to_alias_another_after_the_first_step():
    tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
    params = _params()
    state = tx.init(params)
    params, state = tx.step_(params, _grads(0), state)
    params["tiny"] = params["enc.b"][:1]  # a view into another leaf: written twice
    before = _snapshot(params, state)
    with pytest.raises(ValueError, match="tiny"):
        tx.step_(params, _grads(1), state)
    assert _same(_snapshot(params, state), before)


def test_in_place_step_sees_a_key_added_between_steps():
    tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
    params = _params()
    state = tx.init(params)
    params, state = tx.step_(params, _grads(0), state)
    params["extra"] = torch.zeros(2)
    grads = dict(_grads(1), extra=torch.zeros(2))
    before = _snapshot(params, state)
    with pytest.raises(ValueError, match="extra"):
        tx.step_(params, grads, state)
    assert _same(_snapshot(params, state), before)


def test_a_grads_dict_in_another_key_order_is_matched_by_key():
    params = _params()
    g = _grads(0)
    reordered = {k: g[k] for k in reversed(list(g))}
    a_tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
    b_tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
    a, _ = a_tx.step(params, g, a_tx.init(params))
    b, _ = b_tx.step(params, reordered, b_tx.init(params))
    assert list(a) == list(params) and all(torch.equal(a[k], b[k]) for k in params)
    # and the pure updates
    tx = af.adamw(1e-2)
    s = tx.init(params)
    ua, _ = tx.update(g, s, params)
    ub, _ = tx.update(reordered, s, params)
    assert all(torch.equal(ua[k], ub[k]) for k in params)


def test_pure_steps_fed_their_own_outputs_match_in_place_steps_bit_for_bit():
    for inner in (af.adamw(1e-2), af.chain(af.clip_by_global_norm(0.5), af.sgd(0.1, momentum=0.9))):
        for dtype in (torch.float32, torch.bfloat16):
            pure, inplace = af.mixed_precision(inner, af.NoOpLossScale()), af.mixed_precision(inner, af.NoOpLossScale())
            p1, p2 = _params(dtype=dtype), _params(dtype=dtype)
            s1, s2 = pure.init(p1), inplace.init(p2)
            for step in range(4):
                p1, s1 = pure.step(p1, _grads(step, dtype), s1)
                p2, s2 = inplace.step_(p2, _grads(step, dtype), s2)
                if step == 1:  # the user edits the pure step's output: seen on the next step
                    p1["enc.w"] = p1["enc.w"] * 0.5
                    p2["enc.w"].mul_(0.5)
            assert all(torch.equal(p1[k], p2[k]) for k in SHAPES)
            assert _same(tree_leaves(s1), tree_leaves(s2))


def test_a_pure_step_after_a_state_of_another_device_or_dtype_is_revalidated():
    tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
    params = _params()
    state = tx.init(params)
    params, state = tx.step(params, _grads(0), state)
    f64 = {k: v.double() for k, v in params.items()}  # fp64 params: not the kernels' (generic path)
    state64 = tx.init(f64)
    new, _ = tx.step(f64, _grads(1), state64)
    assert all(v.dtype == torch.float64 for v in new.values())


def test_one_fp64_gradient_among_fp32_ones_takes_the_generic_path_with_its_numbers():
    params = _params()
    grads = _grads(0)
    grads["head.w"] = grads["head.w"].double()
    tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
    ref = af.mixed_precision(_generic(af.adamw(1e-2)), af.NoOpLossScale())
    a, sa = tx.step(params, grads, tx.init(params))
    b, sb = ref.step(params, grads, ref.init(params))
    assert all(torch.equal(a[k], b[k]) for k in SHAPES)
    p_in = _copy(params)
    s_in = tx.init(p_in)
    p_in, s_in = tx.step_(p_in, grads, s_in)
    assert all(torch.equal(p_in[k], b[k]) for k in SHAPES)
    assert _same(tree_leaves(s_in), tree_leaves(sb))


def test_an_integer_gradient_is_refused_naming_the_leaf_and_nothing_is_written():
    tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
    params = _params()
    state = tx.init(params)
    params, state = tx.step_(params, _grads(0), state)
    grads = _grads(1)
    grads["enc.b"] = torch.ones(SHAPES["enc.b"], dtype=torch.int64)
    before = _snapshot(params, state)
    with pytest.raises(TypeError, match="enc.b"):
        tx.step_(params, grads, state)
    assert _same(_snapshot(params, state), before)


def test_pure_update_and_apply_updates_on_a_dict_equal_the_nested_tree_path():
    flat = _params()
    nested = {"enc": {"w": flat["enc.w"], "b": flat["enc.b"]}, "head": {"w": flat["head.w"]}, "tiny": flat["tiny"]}
    g = _grads(0)
    g_nested = {"enc": {"w": g["enc.w"], "b": g["enc.b"]}, "head": {"w": g["head.w"]}, "tiny": g["tiny"]}
    for tx in (af.adamw(1e-2), af.sgd(0.1, momentum=0.9, weight_decay=0.01)):
        u, s = tx.update(g, tx.init(flat), flat)
        new = af.apply_updates(flat, u)
        un, sn = tx.update(g_nested, tx.init(nested), nested)
        new_n = af.apply_updates(nested, un)
        assert list(new) == list(flat)
        pairs = {"enc.w": new_n["enc"]["w"], "enc.b": new_n["enc"]["b"], "head.w": new_n["head"]["w"],
                 "tiny": new_n["tiny"]}
        assert all(torch.equal(new[k], pairs[k]) for k in SHAPES)


def test_apply_updates_names_a_bad_update_and_broadcasts_a_scalar_one():
    params = _params()
    updates = {k: torch.zeros(s) for k, s in SHAPES.items()}
    updates["head.w"] = torch.zeros(6, 3)
    with pytest.raises(ValueError, match="head.w"):
        af.apply_updates(params, updates)
    updates["head.w"] = torch.tensor(1.0)  # 0-d: broadcasts onto its param
    new = af.apply_updates(params, updates)
    assert torch.equal(new["head.w"], params["head.w"] + 1.0) and new["head.w"].shape == params["head.w"].shape
    updates["head.w"] = 1.0
    with pytest.raises(TypeError, match="head.w"):
        af.apply_updates(params, updates)
    updates["head.w"] = None  # an empty node in optree: another structure
    with pytest.raises(ValueError, match="structure"):
        af.apply_updates(params, updates)


def test_pure_update_state_replaced_by_a_non_tensor_is_refused_by_the_generic_path():
    params = _params()
    tx = af.adamw(1e-2)
    state = tx.init(params)
    bad = state._replace(exp_avg=dict(state.exp_avg, **{"enc.b": {"nested": torch.zeros(6)}}))
    with pytest.raises(ValueError, match="enc.b"):
        tx.update(_grads(0), bad, params)


def test_module_trainer_reads_fresh_grads_each_step_and_zero_fills_a_missing_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    twin.load_state_dict(model.state_dict())
    trainer = af.ModuleTrainer(model, af.adamw(1e-2))
    tx = af.mixed_precision(af.adamw(1e-2), af.NoOpLossScale())
    params = {n: p.detach().clone() for n, p in twin.named_parameters()}
    state = tx.init(params)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        if step == 1:
            grads["1.bias"] = torch.zeros(2)  # the trainer's zero fill for a missing .grad
        for n, p in model.named_parameters():
            p.grad = None if (step == 1 and n == "1.bias") else grads[n].clone()
        trainer.step()
        assert all(p.grad is None for p in model.parameters())
        params, state = tx.step_(params, grads, state)
    assert all(torch.equal(p.detach(), params[n]) for n, p in model.named_parameters())
