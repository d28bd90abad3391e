"""Combinators: chain, named_chain, masked, partition, apply_updates."""

import collections
from typing import NamedTuple

import pytest
import torch

import ampfunc as af


class CountState(NamedTuple):
    count: torch.Tensor


def scale_by(c):
    def init(params):
        return CountState(torch.zeros((), dtype=torch.int32))

    def update(updates, state, params=None):
        return af.tree.tree_map(lambda u: u * c, updates), CountState(state.count + 1)

    return af.GradientTransformation(init, update)


def test_chain_applies_in_order_and_keeps_one_state_per_transform():
    tx = af.chain(scale_by(2.0), scale_by(3.0))
    state = tx.init({"w": torch.ones(1)})
    u, state = tx.update({"w": torch.ones(1)}, state)
    assert u["w"].item() == 6.0 and [s.count.item() for s in state] == [1, 1]


def test_chain_rejects_non_transforms_by_position():
    with pytest.raises(TypeError, match="argument 1"):
        af.chain(scale_by(1.0), lambda g: g)


def test_named_chain_exposes_states_by_name():
    tx = af.transform.named_chain(("clip", scale_by(1.0)), ("opt", scale_by(-0.1)))
    state = tx.init({"w": torch.ones(1)})
    assert set(state) == {"clip", "opt"}
    with pytest.raises(ValueError, match="unique"):
        af.transform.named_chain(("a", scale_by(1.0)), ("a", scale_by(1.0)))


def test_masked_applies_inner_only_to_selected_leaves():
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    tx = af.masked(scale_by(10.0), lambda p: {"w": True, "b": False})
    state = tx.init(params)
    u, state = tx.update({"w": torch.ones(2), "b": torch.ones(2)}, state, params)
    assert torch.equal(u["w"], torch.full((2,), 10.0)) and torch.equal(u["b"], torch.ones(2))


def test_masked_mask_must_hold_bools():
    with pytest.raises(TypeError, match="'w'"):
        af.masked(scale_by(1.0), {"w": 1}).init({"w": torch.ones(1)})


def test_partition_routes_each_label_to_its_transform():
    params = {"w": torch.ones(1), "norm": {"weight": torch.ones(1)}}
    labels = {"w": "decay", "norm": {"weight": "no_decay"}}
    tx = af.partition({"decay": scale_by(-1.0), "no_decay": scale_by(0.5)}, labels)
    state = tx.init(params)
    u, state = tx.update(params, state, params)
    assert u["w"].item() == -1.0 and u["norm"]["weight"].item() == 0.5
    with pytest.raises(ValueError, match=r"'norm\.weight'.*'other'"):
        af.partition({"decay": scale_by(1.0)}, {"w": "decay", "norm": {"weight": "other"}}).init(params)


def test_apply_updates_keeps_each_param_dtype_and_rounds_low_precision_once():
    params = {"h": torch.tensor([1.0], dtype=torch.float16), "f": torch.tensor([1.0])}
    updates = {"h": torch.tensor([1e-4]), "f": torch.tensor([1e-4])}
    out = af.apply_updates(params, updates)
    assert out["h"].dtype == torch.float16 and out["f"].dtype == torch.float32
    assert out["h"].item() == torch.tensor(1.0 + 1e-4).half().item()
    assert torch.equal(params["h"], torch.tensor([1.0], dtype=torch.float16))  # pure


def test_apply_updates_names_structure_mismatch():
    with pytest.raises(ValueError, match="'b'"):
        af.apply_updates({"w": torch.ones(1), "b": torch.ones(1)}, {"w": torch.ones(1)})


def test_chains_of_registered_transforms_are_registered_as_typed_specs():
    from ampfunc.transform import ChainSpec, FusedSpec, kernel_spec

    clip, opt = af.clip_by_global_norm(1.0), af.adamw(1e-3)
    spec = kernel_spec(af.chain(clip, opt))
    assert isinstance(spec, ChainSpec) and spec.specs == (clip.fused, opt.fused) and spec.names is None
    assert isinstance(spec.specs[1], FusedSpec) and spec.specs[1].hparams["weight_decay"] == 1e-2
    named = kernel_spec(af.transform.named_chain(("clip", clip), ("opt", opt)))
    assert named.names == ("clip", "opt") and named.specs == spec.specs
    # one unregistered member: the chain is not registered (the generic path runs it)
    assert kernel_spec(af.chain(af.optim.scale(0.5), opt)) is None
    assert kernel_spec(af.from_torch(torch.optim.SGD, lr=0.1)) is None
    # the registry is keyed by the update function: rebuilding the pair keeps it
    init, update = opt
    assert kernel_spec(af.GradientTransformation(init, update)) == opt.fused
    with pytest.raises(TypeError, match="FusedSpec or ChainSpec"):
        af.transform.register_kernel(af.identity(), ("chain", ()))


def test_optax_options_add_decayed_weights_mask_and_scale_by_learning_rate_flip_sign():
    import numpy as np

    params = {"w": torch.ones(2), "b": torch.ones(2)}
    zeros = {"w": torch.zeros(2), "b": torch.zeros(2)}
    for mask in ({"w": True, "b": False}, {"w": np.bool_(True), "b": np.bool_(False)},
                 lambda p: {k: k == "w" for k in p}):
        tx = af.add_decayed_weights(0.5, mask=mask)
        updates, _ = tx.update(zeros, tx.init(params), params)
        assert updates["w"].tolist() == [0.5, 0.5] and updates["b"].tolist() == [0.0, 0.0]
    for lr in (0.25, af.optim.constant_schedule(0.25)):
        tx = af.optim.scale_by_learning_rate(lr, flip_sign=False)
        up, _ = tx.update(params, tx.init(params))
        down, _ = af.optim.scale_by_learning_rate(lr).update(params, af.optim.scale_by_learning_rate(lr).init(params))
        assert up["w"].tolist() == [0.25, 0.25] and down["w"].tolist() == [-0.25, -0.25]
    with pytest.raises(TypeError, match="flip_sign"):
        af.optim.scale_by_learning_rate(0.1, flip_sign=1)


def test_masked_takes_a_prefix_mask_as_optax_does():
    params = {"enc": {"w": torch.ones(2), "b": torch.ones(2)}, "dec": {"w": torch.ones(2)}}
    grads = af.tree.tree_map(torch.ones_like, params)
    tx = af.masked(af.sgd(0.5), {"enc": False, "dec": True})  # a bool for each whole subtree
    updates, _ = tx.update(grads, tx.init(params), params)
    assert updates["dec"]["w"].tolist() == [-0.5, -0.5] and updates["enc"]["w"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="masked: mask and params have different tree structures"):
        af.masked(af.sgd(0.5), {"enc": False}).init(params)  # not a prefix: the keys differ


def test_partition_takes_prefix_labels_as_optax_multi_transform_does():
    # optax.multi_transform: param_labels "the same shape or a prefix" of the params, or a
    # function returning one.
    params = {"enc": {"w": torch.ones(2), "b": torch.ones(2)}, "head": {"w": torch.ones(2)}}
    grads = af.tree.tree_map(torch.ones_like, params)
    for labels in ({"enc": "fast", "head": "slow"}, lambda p: {"enc": "fast", "head": "slow"}):
        tx = af.partition({"fast": af.sgd(1.0), "slow": af.sgd(0.25)}, labels)  # a label per subtree
        updates, _ = tx.update(grads, tx.init(params), params)
        assert updates["enc"]["w"].tolist() == updates["enc"]["b"].tolist() == [-1.0, -1.0]
        assert updates["head"]["w"].tolist() == [-0.25, -0.25]


def test_partition_labels_that_do_not_fit_name_the_path():
    params = {"enc": {"w": torch.ones(2), "b": torch.ones(2)}, "head": {"w": torch.ones(2)}}
    tx = {"a": af.sgd(1.0)}
    with pytest.raises(ValueError, match=r"partition: .*at 'enc' labels lacks keys \['b'\]"):
        af.partition(tx, {"enc": {"w": "a"}, "head": "a"}).init(params)
    with pytest.raises(ValueError, match=r"partition: .*at the root labels lacks keys \['head'\]"):
        af.partition(tx, {"enc": "a"}).init(params)
    with pytest.raises(ValueError, match=r"partition: .*at 'head\.w' labels has a dict where params have a leaf"):
        af.partition(tx, {"enc": "a", "head": {"w": {"x": "a"}}}).init(params)
    with pytest.raises(ValueError, match=r"'head\.w' has label 'b'"):
        af.partition(tx, {"enc": "a", "head": "b"}).init(params)


def test_a_dict_of_labels_or_mask_pairs_with_ordereddict_params_by_key_not_by_position():
    # a dict's leaves come sorted, an OrderedDict's in insertion order: paired by position, the
    # labels of 'a' went to 'b'
    params = collections.OrderedDict(b=torch.ones(2), a=torch.ones(3))
    grads = collections.OrderedDict(b=torch.ones(2), a=torch.ones(3))
    tx = af.partition({"slow": af.sgd(0.1), "fast": af.sgd(1.0)}, {"a": "slow", "b": "fast"})
    updates, _ = tx.update(grads, tx.init(params), params)
    assert torch.equal(updates["b"], -torch.ones(2)) and torch.allclose(updates["a"], torch.full((3,), -0.1))
    tx = af.masked(af.sgd(1.0), {"a": True, "b": False})
    updates, _ = tx.update(grads, tx.init(params), params)
    assert torch.equal(updates["a"], -torch.ones(3)) and torch.equal(updates["b"], torch.ones(2))
    nested = {"enc": collections.OrderedDict(w=torch.ones(2), b=torch.ones(1)), "dec": {"w": torch.ones(2)}}
    tx = af.partition({"x": af.sgd(1.0), "y": af.sgd(0.5)}, {"enc": {"b": "y", "w": "x"}, "dec": "x"})
    updates, _ = tx.update(nested, tx.init(nested), nested)
    assert torch.equal(updates["enc"]["b"], torch.full((1,), -0.5)) and torch.equal(updates["enc"]["w"], -torch.ones(2))
