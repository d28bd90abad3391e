"""SGD's momentum buffer in low precision: ``af.sgd(..., moments="fp32" | "bf16" | "q8")``.

The reference is written here from its definition, per leaf: ``torch.optim.SGD``'s own step
(single tensor, CPU) on the fp32 master, its momentum buffer loaded from the stored one decoded
(``ampfunc.lowbits.dequantize_q8`` with the signed map, or the bf16 widened) before every step
but the first, and stored again after it (``quantize_q8`` for a leaf of at least 4,096 elements
and a multiple of 256, bf16 by rounding to nearest even, fp32 as it is). No code is written down
here: the quantizer is lowbits', whatever it computes. Every path (``tx.update`` +
``apply_updates``, ``mixed_precision`` ``step``/``step_``/``update`` with ``master="fp32"`` and
``"split"``, ``make_train_step``, ``ModuleTrainer``, ``torch.compile``) is held to it, bit for bit,
on the same gradients.
"""

import io

import pytest
import torch
import torch.nn as nn

import ampfunc as af
import ampfunc.lowmem as lowmem
from _helpers import clone_tree, same_tree_bits
from ampfunc.lowbits import dequantize_q8, q8_eligible, quantize_q8
from ampfunc.lowmem import Q8Moment, SplitMaster, storage_bytes

SCALE = 2.0 ** 4  # a power of two: unscaling a bf16 gradient is exact, so the reference gets the same numbers
HYPERS = {  # the combinations of torch's SGD settings a momentum buffer meets
    "momentum": dict(momentum=0.9),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "dampening": dict(momentum=0.8, dampening=0.5),
    "weight_decay": dict(momentum=0.9, weight_decay=0.01),
    "nesterov_weight_decay_maximize": dict(momentum=0.7, nesterov=True, weight_decay=0.02, maximize=True),
    "dampening_weight_decay": dict(momentum=0.95, dampening=0.1, weight_decay=0.05),
}


def _params(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(32, 256, generator=g).to(dtype),  # 8192: q8 (32 blocks)
            "w": torch.randn(64, 80, generator=g).to(dtype),     # 5120: q8 (20 blocks)
            "b": torch.randn(80, generator=g).to(dtype),         # small: fp32 buffer
            "ln": torch.randn(80, generator=g)}                  # fp32: its own master


def _grads(params, seed, scale=1.0):
    g = torch.Generator().manual_seed(1000 + seed)
    return {k: (torch.randn(v.shape, generator=g) * scale).to(v.dtype) for k, v in params.items()}


def _store(buf, moments):
    if moments == "q8" and q8_eligible(buf.numel()):
        return quantize_q8(buf, True)
    if moments == "bf16":
        return buf.to(torch.bfloat16)
    return buf.clone()


def _load(stored):
    if isinstance(stored, tuple):
        return dequantize_q8(*stored, True)
    return stored.float()


def reference_sgd(masters, grads_seq, *, moments, lr=0.05, via_delta=False, **hypers):
    """Per leaf, torch.optim.SGD on the fp32 master with the buffer stored per ``moments``
    between steps. ``grads_seq``: fp32 gradient trees, or None for a skipped step (nothing
    happens). ``via_delta`` (True, or the keys it applies to): the new master is reached as
    ``apply_updates`` reaches it from an update, ``p + (new_p - p)`` (not always ``new_p`` in
    fp32). Returns, after each
    step, ``(masters, stored buffers)``; a stored q8 buffer is ``(codes, absmax)``."""
    ps = {k: torch.nn.Parameter(m.detach().float().clone()) for k, m in masters.items()}
    opts = {k: torch.optim.SGD([p], lr=lr, foreach=False, **hypers) for k, p in ps.items()}
    stored, out = {}, []
    for grads in grads_seq:
        if grads is not None:
            for k, p in ps.items():
                if k in stored:  # torch starts the buffer at the first step; later steps load ours
                    with torch.no_grad():
                        opts[k].state[p]["momentum_buffer"].copy_(_load(stored[k]))
                p.grad = grads[k].float().clone()
                old = p.detach().clone()
                opts[k].step()
                if via_delta is True or (via_delta and k in via_delta):
                    with torch.no_grad():
                        p.copy_(old + (p - old))
                stored[k] = _store(opts[k].state[p]["momentum_buffer"], moments)
        out.append(({k: p.detach().clone() for k, p in ps.items()}, dict(stored)))
    return out


def _buffer_bits_equal(buf, stored):
    """Whether the library's buffer (a tree or a Q8Moment) holds the reference's stored values."""
    for k, want in stored.items():
        if isinstance(want, tuple):
            if not isinstance(buf, Q8Moment) or not same_tree_bits((buf.codes[k], buf.absmax[k]), want):
                return False
        else:
            got = buf.codes[k] if isinstance(buf, Q8Moment) else buf[k]
            if not same_tree_bits(got, want):
                return False
    return True


def _mp(moments, master, loss_scale=None, clip=False, **hypers):
    opt = af.sgd(0.05, moments=moments, **(hypers or HYPERS["momentum"]))
    inner = af.chain(af.clip_by_global_norm(1.0), opt) if clip else opt
    ls = loss_scale if loss_scale is not None else af.DynamicLossScale(SCALE, growth_interval=1000)
    return af.mixed_precision(inner, ls, master=master)


def _take(tx, path, params, grads, state):
    if path == "update":
        updates, state = tx.update(grads, state, params)
        return af.apply_updates(params, updates), state
    return getattr(tx, path)(params, grads, state)


@pytest.fixture
def no_lowmem_kernel(monkeypatch):
    """Fails the test if the fused low-memory kernel (Adam's) is called."""
    def refuse(*args, **kwargs):
        raise AssertionError("adam_lowmem_step_ ran for sgd")

    monkeypatch.setattr(torch.ops.ampfunc, "adam_lowmem_step_", refuse, raising=False)
    seen = []
    fused = lowmem._fused_step_

    def spy(*args):
        out = fused(*args)
        seen.append(out)
        return out

    monkeypatch.setattr(lowmem, "_fused_step_", spy)
    return seen


# ----------------------------------------------------------------------------------------------
# tx.update + apply_updates, against torch.optim.SGD
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("moments", ["fp32", "bf16", "q8"])
@pytest.mark.parametrize("hyper", list(HYPERS), ids=list(HYPERS))
def test_update_is_torch_sgd_on_the_decoded_buffer_encoded_bit_for_bit(moments, hyper):
    params = _params(torch.float32)
    tx = af.sgd(0.05, moments=moments, **HYPERS[hyper])
    state = tx.init(params)
    grads_seq = [_grads(params, i) for i in range(6)]
    want = reference_sgd(params, grads_seq, moments=moments, via_delta=True, **HYPERS[hyper])
    for i, grads in enumerate(grads_seq):
        updates, state = tx.update(grads, state, params)
        params = af.apply_updates(params, updates)
        masters, stored = want[i]
        assert same_tree_bits(params, masters), f"step {i}"
        assert _buffer_bits_equal(state.momentum_buffer, stored), f"step {i}"
    assert isinstance(state.momentum_buffer, Q8Moment) == (moments == "q8")


def test_the_default_is_the_fp32_setting_with_todays_state_and_registration():
    params = _params(torch.float32)
    for hypers in HYPERS.values():
        default, fp32 = af.sgd(0.1, **hypers), af.sgd(0.1, moments="fp32", **hypers)
        assert af.transform.kernel_spec(default) == af.transform.kernel_spec(fp32)
        assert "moments" not in af.transform.kernel_spec(default).hparams
        a, b = default.init(params), fp32.init(params)
        assert same_tree_bits(a, b) and storage_bytes(a) == storage_bytes(b)
        assert all(v.dtype == torch.float32 for v in b.momentum_buffer.values())


def test_the_q8_buffer_uses_the_signed_map_on_eligible_leaves_only():
    params = dict(_params(torch.float32), odd=torch.randn(4100), d=torch.randn(8192, dtype=torch.float64))
    state = af.sgd(0.1, momentum=0.9, moments="q8").init(params)
    buf = state.momentum_buffer
    assert isinstance(buf, Q8Moment)
    assert buf.codes["emb"].dtype == buf.codes["w"].dtype == torch.uint8
    assert buf.absmax["w"].shape == (5120 // 256,)
    for k, dt in (("b", torch.float32), ("ln", torch.float32), ("odd", torch.float32), ("d", torch.float64)):
        assert buf.codes[k].dtype == dt and buf.absmax[k].shape == (0,), k
    # a buffer of both signs comes back with its signs: the signed map
    tx = af.sgd(0.1, momentum=0.9, moments="q8")
    grads = {k: torch.randn(v.shape, dtype=v.dtype) for k, v in params.items()}
    _, state = tx.update(grads, tx.init(params), params)
    codes, absmax = state.momentum_buffer.codes["w"], state.momentum_buffer.absmax["w"]
    assert same_tree_bits((codes, absmax), quantize_q8(grads["w"], True))
    back = dequantize_q8(codes, absmax, True)
    assert bool(((back < 0) == (grads["w"] < 0)).all())


def test_bytes_per_element_of_the_buffer_from_storage():
    n = 1 << 20
    params = {"w": torch.zeros(n)}
    per = {m: storage_bytes(af.sgd(0.1, momentum=0.9, moments=m).init(params).momentum_buffer) / n
           for m in ("fp32", "bf16", "q8")}
    assert per == {"fp32": 4.0, "bf16": 2.0, "q8": 1 + 4 / 256}
    # the whole persistent state of a bf16 model: params + split master + buffer
    params = {"w": torch.zeros(1024, 1024, dtype=torch.bfloat16), "ln": torch.zeros(1024)}
    total = sum(v.numel() for v in params.values())
    got = {}
    for master, moments in (("fp32", "fp32"), ("split", "fp32"), ("split", "bf16"), ("split", "q8")):
        state = _mp(moments, master).init(params)
        got[(master, moments)] = storage_bytes(params, state.master, state.inner) / total
    assert 9.9 < got[("fp32", "fp32")] < 10.1 and 7.9 < got[("split", "fp32")] < 8.1
    assert 5.9 < got[("split", "bf16")] < 6.1 and got[("split", "q8")] <= 5.1, got
    # and a step keeps them so (no kept-fp32 leaf pins a larger buffer)
    tx = af.sgd(0.1, momentum=0.9, moments="q8")
    small = _params(torch.float32)
    state = tx.init(small)
    before = storage_bytes(state)
    _, state = tx.update(_grads(small, 0), state, small)
    assert storage_bytes(state) == before


# ----------------------------------------------------------------------------------------------
# mixed_precision: step, step_, update; master fp32 and split; the plain low-memory road
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["update", "step", "step_"])
@pytest.mark.parametrize("master", ["fp32", "split"])
@pytest.mark.parametrize("moments", ["bf16", "q8"])
def test_mixed_precision_is_the_reference_bit_for_bit_with_a_skip(moments, master, path, no_lowmem_kernel):
    params = _params()
    tx = _mp(moments, master)
    p, s = clone_tree(params), tx.init(clone_tree(params))
    if master == "split":
        assert isinstance(s.master, SplitMaster)
    grads_seq = [_grads(params, i, scale=SCALE) for i in range(6)]
    grads_seq[3]["w"][1, 2] = float("inf")
    scales = [SCALE] * 4 + [SCALE / 2] * 2  # the skip halves the dynamic scale
    ref_grads = [None if i == 3 else {k: g.float() / scales[i] for k, g in gs.items()}
                 for i, gs in enumerate(grads_seq)]
    # update + apply_updates with a split master: an fp32 param (its own master) moves by the fp32
    # delta; a bf16 one lands on its new high half exactly, its low half in the state. (With
    # master="fp32" the state's copies are the masters.)
    via_delta = [k for k, v in params.items() if v.dtype == torch.float32] if (path, master) == ("update", "split") \
        else False
    want = reference_sgd(af.master_params(params, s), ref_grads, moments=moments, via_delta=via_delta,
                         **HYPERS["momentum"])
    for i, grads in enumerate(grads_seq):
        assert float(s.loss_scale.loss_scale) == scales[i]
        p, s = _take(tx, path, p, clone_tree(grads), s)
        masters, stored = want[i]
        assert bool(s.finite) == (i != 3)
        assert same_tree_bits(af.master_params(p, s), masters), f"step {i}"
        assert _buffer_bits_equal(s.inner.momentum_buffer, stored), f"step {i}"
    assert int(s.skipped) == 1
    assert all(out is None for out in no_lowmem_kernel)  # the Adam kernel never takes an sgd step


@pytest.mark.parametrize("hyper", list(HYPERS), ids=list(HYPERS))
def test_every_setting_combination_on_the_in_place_split_q8_step(hyper):
    params = _params()
    tx = _mp("q8", "split", **HYPERS[hyper])
    p, s = clone_tree(params), tx.init(clone_tree(params))
    grads_seq = [_grads(params, i, scale=SCALE) for i in range(4)]
    want = reference_sgd(af.master_params(params, s), [{k: g.float() / SCALE for k, g in gs.items()}
                                                       for gs in grads_seq], moments="q8", **HYPERS[hyper])
    for i, grads in enumerate(grads_seq):
        p, s = tx.step_(p, grads, s)
        assert same_tree_bits(af.master_params(p, s), want[i][0]), f"step {i}"
        assert _buffer_bits_equal(s.inner.momentum_buffer, want[i][1]), f"step {i}"


@pytest.mark.parametrize("moments", ["bf16", "q8"])
def test_with_clipping_the_step_is_the_fp32_step_on_the_decoded_buffer_encoded(moments):
    # chain(clip_by_global_norm, sgd): the engine's fp32 step (the fp32 twin) on the decoded
    # buffer, then encoded, bit for bit.
    params = _params()
    low, full = _mp(moments, "split", clip=True), _mp("fp32", "split", clip=True)
    p, s = clone_tree(params), low.init(clone_tree(params))
    keys = sorted(params)
    for i in range(5):
        grads = _grads(params, i, scale=SCALE * 4)
        buf = s.inner[1].momentum_buffer
        ref_state = s._replace(inner=(s.inner[0], s.inner[1]._replace(
            momentum_buffer=dict(zip(keys, lowmem.decode_moment(buf, True))))))
        p_ref, s_ref = full.step(clone_tree(p), clone_tree(grads), clone_tree(ref_state))
        p, s = low.step_(p, grads, s)
        want = lowmem.encode_moment([s_ref.inner[1].momentum_buffer[k] for k in keys], s.inner[1].momentum_buffer,
                                    True)
        assert same_tree_bits(want, s.inner[1].momentum_buffer), f"step {i}"
        assert same_tree_bits(af.master_params(p_ref, s_ref), af.master_params(p, s)), f"step {i}"


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "in_place"])
@pytest.mark.parametrize("master", ["fp32", "split"])
@pytest.mark.parametrize("moments", ["bf16", "q8"])
def test_a_skipped_step_writes_nothing_codes_and_absmax_included(moments, master, inplace):
    params = _params()
    tx = _mp(moments, master, **HYPERS["dampening_weight_decay"])
    p, s = clone_tree(params), tx.init(clone_tree(params))
    for i in range(3):
        p, s = tx.step_(p, _grads(params, i, scale=SCALE), s)
    before_p, before_s = clone_tree(p), clone_tree(s)
    bad = _grads(params, 9, scale=SCALE)
    bad["emb"][3, 3] = float("nan")
    p2, s2 = (tx.step_ if inplace else tx.step)(p, bad, s)
    assert not bool(s2.finite) and int(s2.skipped) == 1
    assert same_tree_bits(p2, before_p)
    assert same_tree_bits((s2.master, s2.inner), (before_s.master, before_s.inner))
    if moments == "q8":
        buf, old = s2.inner.momentum_buffer, before_s.inner.momentum_buffer
        assert same_tree_bits((buf.codes["emb"], buf.absmax["emb"]), (old.codes["emb"], old.absmax["emb"]))
    assert float(s2.loss_scale.loss_scale) == SCALE / 2


@pytest.mark.parametrize("moments", ["fp32", "bf16", "q8"])
def test_moment_overflows_reads_no_momentum_buffer_in_any_setting(moments):
    # moment_overflows names second moments (Adam's exp_avg_sq); SGD keeps none. A q8 buffer is
    # looked through like an fp32 one: nothing is named, nothing fails.
    params = _params()
    tx = _mp(moments, "split", loss_scale=af.NoOpLossScale())
    p, s = clone_tree(params), tx.init(clone_tree(params))
    grads = _grads(params, 0)
    grads["w"] = grads["w"].float().mul(1e30).bfloat16()
    p, s = tx.step_(p, grads, s)
    assert af.monitor.moment_overflows(s) == []
    assert af.monitor.moment_overflows(s.inner) == []


def test_checkpoint_round_trips_and_the_resumed_run_continues_bit_for_bit():
    params = _params()
    tx = _mp("q8", "split", **HYPERS["nesterov"])
    p, s = clone_tree(params), tx.init(clone_tree(params))
    for i in range(3):
        p, s = tx.step_(p, _grads(params, i, scale=SCALE), s)
    buf = io.BytesIO()
    torch.save((p, s), buf)
    buf.seek(0)
    p2, s2 = torch.load(buf, weights_only=True)
    assert isinstance(s2.master, SplitMaster) and isinstance(s2.inner.momentum_buffer, Q8Moment)
    assert same_tree_bits((p, s), (p2, s2))
    for i in range(3, 6):
        grads = _grads(params, i, scale=SCALE)
        if i == 4:
            grads["b"][0] = float("inf")
        p, s = tx.step_(p, clone_tree(grads), s)
        p2, s2 = tx.step_(p2, clone_tree(grads), s2)
    assert same_tree_bits(p, p2) and same_tree_bits(s, s2)
    # the optimizer's own state too (tx.update's road)
    opt = af.sgd(0.05, momentum=0.9, moments="bf16")
    fp = _params(torch.float32)
    state = opt.init(fp)
    _, state = opt.update(_grads(fp, 0), state, fp)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert same_tree_bits(torch.load(buf, weights_only=True), state)


# ----------------------------------------------------------------------------------------------
# make_train_step, ModuleTrainer, torch.compile
# ----------------------------------------------------------------------------------------------


def _model(seed=0, d=64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 2 * d), nn.LayerNorm(2 * d), nn.Linear(2 * d, d))


def _loss(fwd, x, y):
    return torch.nn.functional.mse_loss(fwd(x), y)


def _autograd_grads(model, params, x, y):
    """The fp32 gradients of the loss at ``params`` by the module's own backward."""
    with torch.no_grad():
        for k, t in model.named_parameters():
            t.copy_(params[k])
    model.zero_grad()
    _loss(model, x, y).backward()
    return {k: t.grad.clone() for k, t in model.named_parameters()}


@pytest.mark.parametrize("path", ["step", "step_"])
@pytest.mark.parametrize("moments", ["bf16", "q8"])
def test_make_train_step_is_the_reference_on_the_modules_gradients(moments, path):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)) for _ in range(4)]
    model = _model()
    train = af.make_train_step(model, _loss, af.sgd(0.05, moments=moments, **HYPERS["nesterov"]), "p=f32,c=f32,o=f32")
    state = train.init()
    assert isinstance(state.opt_state.momentum_buffer, Q8Moment) == (moments == "q8")
    p0 = clone_tree(state.params)
    grads_seq, p = [], clone_tree(p0)
    ref_model = _model()
    for x, y in batches:  # the reference walks its own trajectory, reading the gradients there
        grads_seq.append(_autograd_grads(ref_model, p, x, y))
        p = reference_sgd(p0, grads_seq, moments=moments, **HYPERS["nesterov"])[-1][0]
    want = reference_sgd(p0, grads_seq, moments=moments, **HYPERS["nesterov"])
    for i, (x, y) in enumerate(batches):
        state, out = getattr(train, path)(state, x, y)
        assert bool(out.finite)
        assert same_tree_bits(state.params, want[i][0]), f"step {i}"
        assert _buffer_bits_equal(state.opt_state.momentum_buffer, want[i][1]), f"step {i}"


def test_make_train_step_split_q8_step_and_step_agree_and_skip_writing_nothing():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
    train = af.make_train_step(_model(), _loss, af.sgd(0.05, momentum=0.9, moments="q8"), "p=bf16,c=bf16,o=f32",
                               loss_scale=af.DynamicLossScale(SCALE), master="split")
    a, b = train.init(), train.init()
    assert isinstance(a.master, SplitMaster) and isinstance(a.opt_state.momentum_buffer, Q8Moment)
    for _ in range(3):
        a, _ = train.step(a, x, y)
        b, _ = train.step_(b, x, y)
        assert same_tree_bits(a, b)
    before = clone_tree(b)
    b, out = train.step_(b, x * float("inf"), y)
    assert not bool(out.finite)
    assert same_tree_bits((b.params, b.master, b.opt_state), (before.params, before.master, before.opt_state))


@pytest.mark.parametrize("moments", ["bf16", "q8"])
def test_module_trainer_is_the_reference_on_the_modules_gradients(moments):
    model = _model()
    trainer = af.ModuleTrainer(model, af.sgd(0.05, moments=moments, **HYPERS["dampening_weight_decay"]))
    p0 = {k: t.detach().clone() for k, t in model.named_parameters()}
    g = torch.Generator().manual_seed(2)
    grads_seq = []
    for _ in range(3):
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)
        trainer.scale(_loss(model, x, y)).backward()
        grads_seq.append({k: t.grad.clone() for k, t in model.named_parameters()})
        assert bool(trainer.step())
    masters, stored = reference_sgd(p0, grads_seq, moments=moments, **HYPERS["dampening_weight_decay"])[-1]
    assert same_tree_bits({k: t.detach() for k, t in model.named_parameters()}, masters)
    assert _buffer_bits_equal(trainer.state.opt_state.momentum_buffer, stored)


def test_module_trainer_split_q8_trains_and_refuses_flat_and_another_setting():
    model = _model().to(torch.bfloat16)
    model[1].float()
    trainer = af.ModuleTrainer(model, af.sgd(0.05, momentum=0.9, moments="q8"), master="split")
    assert isinstance(trainer.state.master, SplitMaster)
    w0 = model[0].weight.detach().clone()
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    out = model[2](model[1](model[0](x).float()).to(torch.bfloat16))
    trainer.scale(out.float().square().mean()).backward()
    assert bool(trainer.step())
    assert not same_tree_bits(w0, model[0].weight.detach())
    with pytest.raises(ValueError, match="flat=True.*low-memory"):
        af.ModuleTrainer(nn.Linear(64, 64), af.sgd(0.05, momentum=0.9, moments="q8"), flat=True)
    other = af.ModuleTrainer(model, af.sgd(0.05, momentum=0.9), master="split")
    before = clone_tree(other.state)
    with pytest.raises(ValueError, match=r"opt_state.momentum_buffer is a Q8Moment \(moments='q8'\)"):
        other.state = trainer.state
    assert same_tree_bits(other.state, before)


@pytest.mark.slow
def test_compiled_split_q8_step_is_one_graph_and_gives_the_eager_bits():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    params = _params()
    tx = _mp("q8", "split", **HYPERS["dampening"])
    p_e, s_e = clone_tree(params), tx.init(clone_tree(params))
    p_c, s_c = clone_tree(params), tx.init(clone_tree(params))
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(tx.step_, fullgraph=True, backend=counter)
    for i in range(3):
        grads = _grads(params, i, scale=SCALE)
        if i == 1:
            grads["w"][0, 0] = float("inf")
        p_e, s_e = tx.step_(p_e, clone_tree(grads), s_e)
        p_c, s_c = compiled(p_c, clone_tree(grads), s_c)
    assert counter.frame_count == 1
    assert same_tree_bits(p_e, p_c) and same_tree_bits(s_e, s_c)
    assert int(s_c.skipped) == 1


# ----------------------------------------------------------------------------------------------
# Bad inputs, refused by name before any write
# ----------------------------------------------------------------------------------------------


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="moments must be one of 'fp32', 'bf16', 'q8', got 'int8'"):
        af.sgd(0.1, momentum=0.9, moments="int8")
    for moments in ("bf16", "q8"):
        with pytest.raises(ValueError, match=f"moments='{moments}' stores the momentum buffer, but momentum == 0"):
            af.sgd(0.1, moments=moments)
    af.sgd(0.1, moments="fp32")  # no momentum, no buffer: the default setting stays valid
    with pytest.raises(TypeError, match="'i'"):
        af.sgd(0.1, momentum=0.9, moments="q8").init({"w": torch.ones(4096), "i": torch.ones(4096, dtype=torch.int32)})


@pytest.mark.parametrize("made,used,what", [("fp32", "q8", "not the Q8Moment"), ("bf16", "q8", "not the Q8Moment"),
                                            ("q8", "bf16", "made with moments='q8'"),
                                            ("fp32", "bf16", "leaf 'b' is torch.float32"),
                                            ("q8", "fp32", "made with moments='q8'")])
def test_tx_update_refuses_a_buffer_of_another_setting_naming_it(made, used, what):
    params = _params(torch.float32)
    state = af.sgd(0.1, momentum=0.9, moments=made).init(params)
    snapshot = clone_tree(state)
    with pytest.raises((ValueError, TypeError), match=what):
        af.sgd(0.1, momentum=0.9, moments=used).update(_grads(params, 0), state, params)
    assert same_tree_bits(state, snapshot)
    with pytest.raises(ValueError, match="momentum_buffer is None"):
        af.sgd(0.1, momentum=0.9, moments=used).update(_grads(params, 0), af.sgd(0.1).init(params), params)


@pytest.mark.parametrize("path", ["update", "step", "step_"])
@pytest.mark.parametrize("master", ["fp32", "split"])
@pytest.mark.parametrize("made,used,what", [("q8", "fp32", " is a Q8Moment but moments='fp32'"),
                                            ("bf16", "fp32", " leaf '.*' is torch.bfloat16"),
                                            ("fp32", "q8", " is dict, not the Q8Moment"),
                                            ("q8", "bf16", " is a Q8Moment but moments='bf16'"),
                                            ("fp32", "bf16", " leaf '.*' is torch.float32")])
def test_mixed_precision_refuses_a_state_of_another_setting_before_any_write(made, used, what, master, path):
    params = _params()
    state = _mp(made, master).init(clone_tree(params))
    tx = _mp(used, master)
    p = clone_tree(params)
    snapshot_p, snapshot_s = clone_tree(p), clone_tree(state)
    with pytest.raises((ValueError, TypeError), match=f"state.inner.momentum_buffer{what}"):
        if path == "update":
            tx.update(_grads(params, 0, scale=SCALE), state, p)
        else:
            getattr(tx, path)(p, _grads(params, 0, scale=SCALE), state)
    assert same_tree_bits(p, snapshot_p) and same_tree_bits(state, snapshot_s)


# ----------------------------------------------------------------------------------------------
# ampfunc.lowmem's public names
# ----------------------------------------------------------------------------------------------


def test_lowmem_all_lists_the_public_concepts_and_the_helpers_stay_importable():
    assert sorted(lowmem.__all__) == ["MASTERS", "MOMENTS", "Q8Moment", "SplitMaster", "storage_bytes"]
    from ampfunc.lowmem import (  # noqa: F401 - the library's own modules import these by name
        MOMENT_FIELDS,
        check_moment,
        decode_state,
        encode_state_,
        init_moment,
        lowmem_step,
    )
    assert MOMENT_FIELDS["momentum_buffer"] is True  # the engine treats sgd's buffer as a signed moment
