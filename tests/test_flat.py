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


def test_flatten_refuses_a_tensor_listed_twice_rather_than_untie_it():
    w = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"'emb\.weight' and 'head\.weight' share memory"):
        af.flat.flatten({"emb.weight": w, "head.weight": w})
    with pytest.raises(ValueError, match=r"'a' and 'b' share memory"):
        af.flat.flatten({"a": w, "b": w.t()})
    # views that share no element are distinct leaves
    cols = torch.randn(5, 2)
    flat = af.flat.flatten({"q": cols[:, 0], "k": cols[:, 1]})
    assert torch.equal(flat.tree["q"], cols[:, 0]) and torch.equal(flat.tree["k"], cols[:, 1])
    # meta tensors hold no memory (every data_ptr is 0): nothing is shared
    meta = af.flat.flatten({"a": torch.empty(3, device="meta"), "b": torch.empty(2, 2, device="meta")})
    assert meta.buffers[0].device.type == "meta" and meta.buffers[0].numel() == 7


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


# -- optimizer state packed into one buffer (zeros_packed) --------------------------------------

import io  # noqa: E402

import ampfunc as af  # noqa: E402
from ampfunc.flat import zeros_packed  # noqa: E402


def _many(n=37):
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.w": torch.randn(3 + i % 5, 2 + i % 3, generator=g) for i in range(n)}


def test_adam_moments_are_views_of_one_aligned_buffer_per_moment():
    params = _many()
    state = af.adamw(1e-3).init(params)
    for moment in (state.exp_avg, state.exp_avg_sq):
        leaves = list(moment.values())
        assert all(float(t.abs().sum()) == 0.0 and t.dtype == torch.float32 for t in leaves)
        assert [t.shape for t in leaves] == [p.shape for p in params.values()]
        storage = {t.untyped_storage().data_ptr() for t in leaves}
        assert len(storage) == 1  # one buffer
        assert all(t.data_ptr() % 64 == 0 for t in leaves)  # every CPU view starts on a cache line
    # the two moments are two buffers, not one
    assert state.exp_avg["layer0.w"].untyped_storage().data_ptr() != \
        state.exp_avg_sq["layer0.w"].untyped_storage().data_ptr()
    # SGD's momentum buffers too
    buf = af.sgd(0.1, momentum=0.9).init(params).momentum_buffer
    assert len({t.untyped_storage().data_ptr() for t in buf.values()}) == 1


def test_a_step_on_packed_moments_is_the_step_on_separate_ones_bit_for_bit():
    params = _many()
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = af.mixed_precision(af.adamw(1e-2, weight_decay=0.1), af.NoOpLossScale())
    packed = tx.init(params)
    apart = tx.init(params)
    apart = apart._replace(inner=apart.inner._replace(
        exp_avg={k: v.clone() for k, v in packed.inner.exp_avg.items()},
        exp_avg_sq={k: v.clone() for k, v in packed.inner.exp_avg_sq.items()}))
    assert len({t.untyped_storage().data_ptr() for t in apart.inner.exp_avg.values()}) == len(params)
    p1 = {k: v.clone() for k, v in params.items()}
    p2 = {k: v.clone() for k, v in params.items()}
    for _ in range(3):
        tx.step_(p1, grads, packed)
        tx.step_(p2, grads, apart)
    assert all(torch.equal(p1[k], p2[k]) for k in params)
    assert all(torch.equal(packed.inner.exp_avg_sq[k], apart.inner.exp_avg_sq[k]) for k in params)


def test_packed_state_saves_once_and_resumes_bit_for_bit():
    params = _many()
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = af.mixed_precision(af.adam(1e-2), af.NoOpLossScale())
    state = tx.init(params)
    params = {k: v.clone() for k, v in params.items()}
    tx.step_(params, grads, state)
    blob = io.BytesIO()
    torch.save((params, state), blob)
    blob.seek(0)
    params2, state2 = torch.load(blob)
    # still one buffer per moment after the round trip
    assert len({t.untyped_storage().data_ptr() for t in state2.inner.exp_avg.values()}) == 1
    tx.step_(params, grads, state)
    tx.step_(params2, grads, state2)
    assert all(torch.equal(params[k], params2[k]) for k in params)


def test_leaves_that_cannot_be_views_of_a_plain_buffer_get_their_own_zeros():
    w = torch.randn(4, 6)
    tree = {"t": w.t(), "plain": torch.randn(5), "half": torch.randn(3, dtype=torch.float16)}
    z = zeros_packed(tree)
    assert z["t"].shape == (6, 4) and z["t"].stride() == w.t().stride()  # zeros_like keeps the layout
    assert z["plain"].untyped_storage().data_ptr() == z["half"].untyped_storage().data_ptr()  # packed, fp32
    assert z["half"].dtype == torch.float32
    assert z["t"].untyped_storage().data_ptr() != z["plain"].untyped_storage().data_ptr()


def test_init_under_vmap_gives_batched_zeros_not_a_shared_buffer():
    params = {"w": torch.randn(5, 3), "b": torch.randn(5, 2)}  # a batch of 5 models
    exp_avg = torch.func.vmap(lambda p: af.adam(1e-3).init(p).exp_avg)(params)
    assert exp_avg["w"].shape == (5, 3) and exp_avg["b"].shape == (5, 2)
    assert float(exp_avg["w"].abs().sum()) == 0.0
    # a buffer made inside vmap would be unbatched and come back expanded (stride 0): every
    # model's moments one shared memory
    assert exp_avg["w"].stride()[0] != 0 and exp_avg["b"].stride()[0] != 0


def test_packed_leaves_are_views_sharing_their_buffer_version_counter():
    z = zeros_packed({"a": torch.ones(4), "b": torch.ones(2, 2)})
    before = z["b"]._version
    z["a"].add_(1)  # as for any views of one tensor
    assert z["b"]._version == before + 1 and torch.equal(z["b"], torch.zeros(2, 2))


def test_copy_packed_copies_each_leaf_into_one_buffer_per_device_and_dtype():
    from ampfunc.flat import copy_packed
    tree = {"a": torch.randn(3, dtype=torch.float16), "b": torch.randn(5), "c": torch.randn(2, dtype=torch.float64),
            "t": torch.randn(3, 2).t()}
    out = copy_packed(tree, lambda d: torch.float32 if d.itemsize < 4 else d)
    assert out["a"].dtype == torch.float32 and out["c"].dtype == torch.float64
    assert all(torch.equal(out[k], tree[k].to(out[k].dtype)) for k in tree)
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()  # fp32 buffer
    assert out["c"].untyped_storage().data_ptr() != out["b"].untyped_storage().data_ptr()  # fp64 apart
    assert out["t"].untyped_storage().data_ptr() != out["b"].untyped_storage().data_ptr()  # non-contiguous apart
    tree["b"].add_(1.0)
    assert not torch.equal(out["b"], tree["b"])  # a copy, not a view of the input


def test_the_engine_keeps_fp32_masters_of_half_params_in_one_buffer():
    params = {k: v.half() for k, v in _many().items()}
    state = af.mixed_precision(af.adamw(1e-3), af.DynamicLossScale()).init(params)
    masters = list(state.master.values())
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(torch.equal(m, p.float()) for m, p in zip(masters, params.values()))
    assert len({m.untyped_storage().data_ptr() for m in masters}) == 1


def test_unpacked_gives_each_shared_leaf_its_own_storage_and_keeps_the_rest_as_they_are():
    from ampfunc.flat import unpacked
    state = af.mixed_precision(af.adamw(1e-3), af.DynamicLossScale()).init({k: v.half() for k, v in _many().items()})
    own = unpacked(state)
    assert type(own) is type(state)
    moments = list(own.inner.exp_avg.values()) + list(own.inner.exp_avg_sq.values()) + list(own.master.values())
    assert len({t.untyped_storage().data_ptr() for t in moments}) == len(moments)  # none shared any more
    packed = list(state.inner.exp_avg.values()) + list(state.inner.exp_avg_sq.values()) + list(state.master.values())
    assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(moments, packed))
    assert own.inner.step is state.inner.step  # alone in its storage: the same tensor, no copy
    assert own.loss_scale.loss_scale is state.loss_scale.loss_scale
    for t in packed:
        t.add_(1.0)
    assert all(not torch.equal(a, b) for a, b in zip(moments, packed))  # copies, not views


def test_make_train_step_state_shares_no_storage_between_leaves_so_a_compiled_step_writes_them_directly():
    # torch.compile rebuilds inputs that share a storage and are written in place from one
    # base per call, copying the buffer once per leaf (ampfunc.flat.unpacked says why).
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    train = af.make_train_step(model, lambda fwd, x: fwd(x).square().mean(), af.adamw(1e-3),
                               "p=f32,c=bf16,o=f32", loss_scale=af.DynamicLossScale())
    state = train.init()
    leaves = [t for t in af.tree.tree_leaves(state) if isinstance(t, torch.Tensor) and t.numel() > 0]
    assert len({t.untyped_storage().data_ptr() for t in leaves}) == len(leaves)
    # A plain optimizer's init does pack its moments (eager steps read them as one stream).
    opt = af.adamw(1e-3).init(dict(model.named_parameters()))
    assert len({t.untyped_storage().data_ptr() for t in opt.exp_avg.values()}) == 1
