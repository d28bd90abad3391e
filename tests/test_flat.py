"""Flat buffers: one contiguous buffer per (device, dtype), views back to the tree."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from ampfunc import ops
from ampfunc.flat import FlatTree, flatten, unflatten


def _tree():
    return {
        "enc": {"w": torch.randn(4, 3), "b": torch.randn(4)},
        "norm": torch.randn(4, dtype=torch.float16),
        "steps": torch.tensor(7),  # an integer buffer: kept as it is
        "skip": None,
        "head": [torch.randn(2, 4), torch.randn(2, dtype=torch.float16)],
    }


def test_flatten_packs_float_leaves_per_dtype_in_tree_order_and_views_them_back():
    tree = _tree()
    flat = flatten(tree)
    assert isinstance(flat, FlatTree)
    assert [k[1] for k in flat.keys] == [torch.float32, torch.float16]
    assert [b.numel() for b in flat.buffers] == [12 + 4 + 8, 4 + 2]
    back = flat.tree
    assert torch.equal(back["enc"]["w"], tree["enc"]["w"]) and torch.equal(back["head"][1], tree["head"][1])
    assert back["steps"] is tree["steps"] and back["skip"] is None
    # the leaves are views: writing the buffer writes the tree and the other way round
    flat.buffers[0].zero_()
    assert float(back["enc"]["b"].abs().sum()) == 0.0
    back["norm"].fill_(2.0)
    # optree orders dict keys: head[1] (2 elements) comes before norm (4)
    assert torch.equal(flat.buffers[1][2:], torch.full((4,), 2.0, dtype=torch.float16))


def test_flatten_copies_so_the_original_tree_is_left_alone():
    tree = _tree()
    w = tree["enc"]["w"].clone()
    flatten(tree).buffers[0].fill_(0.0)
    assert torch.equal(tree["enc"]["w"], w)


def test_unflatten_over_other_buffers_and_flatten_like_round_trip():
    tree = _tree()
    flat = flatten(tree)
    zeros = flat.zeros_like()
    assert all(float(b.abs().sum()) == 0 for b in flat.unflatten(zeros)["head"])
    copied = flat.flatten_like(tree)
    assert all(torch.equal(a, b) for a, b in zip(copied, flat.buffers))
    assert unflatten(flat)["enc"]["b"].data_ptr() == flat.buffers[0].data_ptr()  # "b" sorts first


def test_unflatten_refuses_buffers_of_the_wrong_size_naming_the_group():
    flat = flatten(_tree())
    with pytest.raises(ValueError, match=r"buffer 1 \(cpu/float16\) has shape \(5,\), expected \(6,\)"):
        flat.unflatten((flat.buffers[0], torch.zeros(5, dtype=torch.float16)))
    with pytest.raises(ValueError, match="expected 2 buffers"):
        flat.unflatten(flat.buffers[:1])


def test_grad_with_respect_to_the_flat_buffer_is_the_flat_gradient():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    params = {k: v.detach() for k, v in model.named_parameters()}
    flat = flatten(params)
    x, y = torch.randn(11, 5), torch.randint(0, 3, (11,))

    def loss_of_tree(p):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    def loss_of_buffers(buffers):
        return loss_of_tree(flat.unflatten(buffers))

    flat_grads = torch.func.grad(loss_of_buffers)(flat.buffers)
    tree_grads = torch.func.grad(loss_of_tree)(params)
    assert len(flat_grads) == 1 and flat_grads[0].shape == flat.buffers[0].shape
    for k, g in flat.unflatten(flat_grads).items():
        torch.testing.assert_close(g, tree_grads[k])


def test_kernels_give_the_same_answer_on_a_buffer_and_on_its_views():
    tree = {f"l{i}": torch.randn(i % 7 + 1) for i in range(500)}
    flat = flatten(tree)
    views = flat.leaves()
    a = ops.check(views)
    b = ops.check(flat.buffers)
    assert bool(a[0]) and bool(b[0])
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=0)
    views[321][-1] = float("nan")  # a view writes through to the buffer
    assert not bool(ops.check(flat.buffers)[0])
    assert ops.check(views, per_leaf=True)[2].nonzero().flatten().tolist() == [321]
