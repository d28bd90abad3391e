"""The fused low-memory Adam/AdamW step (``ampfunc::adam_lowmem_step_``): its spec entry and C++
table, the compiled CPU kernel against its plain-torch reference twin and against
ampfunc.lowmem's plain-torch path, bit for bit; bad inputs refused by name before any write; and
the op inside ``torch.compile(fullgraph=True)``."""

import re
from pathlib import Path

import pytest
import torch

import ampfunc as af
from _helpers import clone_tree, same_tree_bits
from ampfunc import lowmem, ops
from ampfunc.lowbits import q8_lookup, split_bf16
from ampfunc.ops import _spec
from ampfunc.ops._lowmem_reference import _ref_adam_lowmem_step_

_OP = "adam_lowmem_step_"


def _compiled():
    if ops.backend() == "reference":
        pytest.skip("compiled kernels not built")
    return torch.ops.ampfunc.adam_lowmem_step_


# ------------------------------------------------------------------------------------------------
# The spec
# ------------------------------------------------------------------------------------------------


def test_the_schema_derived_from_the_spec():
    want = ("adam_lowmem_step_(Tensor(a!)[] params, Tensor(b!)[] remainders, Tensor[] grads, "
            "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_absmax, Tensor(e!)[] exp_avg_sqs, "
            "Tensor(f!)[] exp_avg_sq_absmax, Tensor(g!) step, Tensor grad_scale, Tensor finite, Tensor qmaps, "
            "Tensor qbases, float lr, Tensor? lr_tensor, float beta1, float beta2, float eps, float weight_decay, "
            "bool decoupled_weight_decay, bool maximize) -> ()")
    derived = torch._C.parse_schema("ampfunc::" + _spec.OPS[_OP].schema())
    assert str(derived) == str(torch._C.parse_schema("ampfunc::" + want))
    assert str(torch.ops.ampfunc.adam_lowmem_step_.default._schema) == str(derived)


def test_the_cpp_list_table_is_the_python_one():
    header = (Path(__file__).resolve().parents[1] / "ext" / "cpu" / "lowmem_spec.h").read_text()
    start = header.index("kAdamLowmemLists[] = {")
    body = header[start:header.index("};", start)]
    cpp = [(n, tuple(d.split(",")), s or None, o or None)
           for n, d, s, o in re.findall(r'\{"(\w+)", "([\w,]+)", "(\w*)", "(\w*)"\}', body)]
    python = [(a.name, tuple(str(d).removeprefix("torch.") for d in a.dtypes), a.shape, a.of)
              for a in _spec.OPS[_OP].lists]
    assert cpp == python
    assert "lowmem_spec.h" in (Path(__file__).resolve().parents[1] / "ext" / "glue" / "spec.h").read_text()


# ------------------------------------------------------------------------------------------------
# The kernel against its reference twin
# ------------------------------------------------------------------------------------------------


def _op_args(seed, grad_dtype=torch.bfloat16):
    """A mixed call: bf16 params with nonzero remainders, an fp32 param, moments in q8, bf16 and
    fp32, the q8 ones after a few updates (nonzero codes and absmax)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(32, 256), (4096,), (80,), (64, 80), (300,)]
    kinds = ["q8", "q8", "fp32", "bf16", "fp32"]
    p_dtypes = [torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32]
    params, rems, m, ma, v, va = [], [], [], [], [], []
    for shape, kind, pd in zip(shapes, kinds, p_dtypes):
        master = torch.randn(shape, generator=g)
        if pd == torch.bfloat16:
            hi, lo = split_bf16(master)
            params.append(hi)
            rems.append(lo)
        else:
            params.append(master)
            rems.append(torch.zeros(0, dtype=torch.int16))
        m32 = torch.randn(shape, generator=g) * 1e-2
        v32 = torch.rand(shape, generator=g) * 1e-3
        if kind == "q8":
            (c1, a1), (c2, a2) = af.lowbits.quantize_q8(m32, True), af.lowbits.quantize_q8(v32, False)
            m.append(c1), ma.append(a1), v.append(c2), va.append(a2)
        else:
            dt = torch.bfloat16 if kind == "bf16" else torch.float32
            m.append(m32.to(dt)), v.append(v32.to(dt))
            ma.append(torch.zeros(0)), va.append(torch.zeros(0))
    return params, rems, m, ma, v, va


def _with(state, grads):
    """The op's lists in schema order: ``state`` is ``(params, remainders, m, m_absmax, v, v_absmax)``."""
    return [state[0], state[1], grads, *state[2:]]


def _grads(params, seed, dtype):
    g = torch.Generator().manual_seed(10_000 + seed)
    return [torch.randn(p.shape, generator=g).to(dtype) for p in params]


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_kernel_is_its_reference_twin_bit_for_bit_over_20_steps_with_a_skip(decoupled, grad_dtype):
    op = _compiled()
    state = _op_args(0)
    ref_state = clone_tree(list(state))
    step, ref_step = torch.zeros(()), torch.zeros(())
    maps, bases = q8_lookup()
    lr_tensor = torch.tensor(3e-3)
    for i in range(20):
        grads = _grads(state[0], i, grad_dtype)
        finite = torch.tensor(i != 9)
        scale = torch.tensor(0.5)
        lr = (0.0, lr_tensor) if i % 2 else (1e-2, None)
        hyper = (0.9, 0.999, 1e-8, 0.05, decoupled, i == 4)
        before = clone_tree(list(state))
        op(*_with(state, grads), step, scale, finite, maps, bases, *lr, *hyper)
        _ref_adam_lowmem_step_(*_with(ref_state, grads), ref_step, scale, finite, maps, bases, *lr, *hyper)
        assert same_tree_bits(list(state), ref_state), f"step {i}"
        assert same_tree_bits(step, ref_step)
        if i == 9:
            assert same_tree_bits(list(state), before) and float(step) == 9.0
    assert float(step) == 19.0


def test_the_kernel_is_its_twin_when_a_q8_second_moment_overflows():
    # A finite gradient of 1e30 squares past fp32's max: the q8 second moment's block has absmax
    # inf, the overflowed element keeps the last code and its neighbours the code of 0.
    op = _compiled()
    state = _op_args(1)
    ref_state = clone_tree(list(state))
    step, ref_step = torch.zeros(()), torch.zeros(())
    maps, bases = q8_lookup()
    for i in range(4):
        grads = _grads(state[0], i, torch.float32)
        if i == 1:
            grads[0][2, 9] = 1e30
            grads[1][300] = -1e30
        args = (step, torch.tensor(1.0), torch.tensor(True), maps, bases, 1e-2, None, 0.9, 0.999, 1e-8, 0.0, True,
                False)
        op(*_with(state, grads), *args)
        _ref_adam_lowmem_step_(*_with(ref_state, grads), ref_step, *args[1:])
        assert same_tree_bits(list(state), ref_state), f"step {i}"
    v_absmax = state[5]
    assert v_absmax[0][2].item() == float("inf") and v_absmax[1][1].item() == float("inf")
    for k in range(2):  # the overflow stays in its block: no NaN anywhere, the other blocks finite
        assert not bool(state[0][k].isnan().any()) and int(torch.isinf(v_absmax[k]).sum()) == 1


# ------------------------------------------------------------------------------------------------
# The engine's fused path against its plain-torch path
# ------------------------------------------------------------------------------------------------


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(32, 256, generator=g).to(torch.bfloat16),   # q8 (32 blocks)
            "w": torch.randn(64, 80, generator=g).to(torch.bfloat16),      # 5120: q8
            "b": torch.randn(80, generator=g).to(torch.bfloat16),          # small: fp32 moments
            "odd": torch.randn(7, 37, generator=g).to(torch.bfloat16),     # 259: a 3-element tail
            "ln": torch.randn(80, generator=g)}                            # fp32: its own master


def _tree_grads(params, seed, scale=16.0):
    g = torch.Generator().manual_seed(1000 + seed)
    return {k: (torch.randn(v.shape, generator=g) * scale).to(v.dtype) for k, v in params.items()}


def _tx(kind, moments, clip):
    opt = af.adamw(1e-2, weight_decay=0.1, moments=moments) if kind == "adamw" else \
        af.adam(af.optim.linear_schedule(1e-2, 1e-3, 20), weight_decay=0.01, moments=moments)
    inner = af.chain(af.clip_by_global_norm(1.0), opt) if clip else opt
    return af.mixed_precision(inner, af.DynamicLossScale(2.0 ** 4, growth_interval=3), master="split")


def _counting_fused_step():
    """``(calls, spy)``: the spy runs the fused step and records whether it took the call."""
    calls, real = [], lowmem._fused_step_

    def counting(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    return calls, counting


@pytest.mark.parametrize("moments", ["fp32", "bf16", "q8"])
@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_the_fused_path_is_the_plain_torch_path_bit_for_bit(kind, moments, monkeypatch):
    _compiled()
    params = _params()
    tx = _tx(kind, moments, clip=kind == "adamw")
    p_fused, s_fused = clone_tree(params), tx.init(clone_tree(params))
    p_plain, s_plain = clone_tree(params), tx.init(clone_tree(params))
    fused_calls, counting = _counting_fused_step()
    for i in range(20):
        grads = _tree_grads(params, i)
        if i == 10:
            grads["w"][1, 2] = float("inf")  # a skipped step in the middle
        monkeypatch.setattr(lowmem, "_fused_step_", counting)
        p_fused, s_fused = tx.step_(p_fused, clone_tree(grads), s_fused)
        monkeypatch.setattr(lowmem, "_fused_step_", lambda *a: None)
        p_plain, s_plain = tx.step_(p_plain, clone_tree(grads), s_plain)
        assert same_tree_bits(p_fused, p_plain), f"step {i}"
        assert same_tree_bits((s_fused.master, s_fused.inner, s_fused.loss_scale, s_fused.finite, s_fused.skipped),
                     (s_plain.master, s_plain.inner, s_plain.loss_scale, s_plain.finite, s_plain.skipped)), f"step {i}"
    assert fused_calls == [True] * 20
    assert int(s_fused.skipped) >= 1


@pytest.mark.parametrize("moments", ["bf16", "q8"])
def test_the_state_is_checked_once_per_set_of_tensors_and_the_kernel_still_refuses_a_swapped_one(moments, monkeypatch):
    # The in-place step looks at the layout of the params and the state once (then by identity);
    # new tensors are checked again, and a tensor swapped inside the same object (`.data = ...`)
    # is refused by the kernel, which validates every call, before anything is written.
    _compiled()
    tx = _tx("adamw", moments, clip=False)
    params = _params()
    state = tx.init(params)
    looked = []
    real = lowmem.check_moment
    monkeypatch.setattr(lowmem, "check_moment", lambda *a, **k: (looked.append(1), real(*a, **k))[1])
    for i in range(3):
        params, state = tx.step_(params, _tree_grads(params, i), state)
    assert len(looked) == 2  # the first step's two moments, not again
    reloaded = clone_tree(state)  # a state loaded from a checkpoint: other tensors, checked again
    params, reloaded = tx.step_(params, _tree_grads(params, 3), reloaded)
    assert len(looked) == 4
    codes = reloaded.inner.exp_avg.codes["w"] if moments == "q8" else reloaded.inner.exp_avg["w"]
    codes.data = torch.zeros(3, dtype=codes.dtype)  # same object, another shape
    before = clone_tree((params, reloaded))
    with pytest.raises((ValueError, RuntimeError), match="exp_avgs"):
        tx.step_(params, _tree_grads(params, 4), reloaded)
    assert same_tree_bits(before, (params, reloaded))


@pytest.mark.parametrize("moments", ["fp32", "bf16", "q8"])
def test_the_pure_step_is_the_kernel_on_fresh_copies_and_leaves_its_inputs_alone(moments, monkeypatch):
    # tx.step runs the in-place kernel over copies: the plain road's bits, one kernel pass, and the
    # params and state passed in keep every bit (the loss scale's tensors included).
    _compiled()
    params = _params()
    tx = _tx("adamw", moments, clip=True)
    p_fused, s_fused = clone_tree(params), tx.init(clone_tree(params))
    p_plain, s_plain = clone_tree(params), tx.init(clone_tree(params))
    fused_calls, counting = _counting_fused_step()
    for i in range(12):
        grads = _tree_grads(params, i)
        if i == 6:
            grads["emb"][0, 0] = float("nan")
        before = clone_tree((p_fused, s_fused))
        monkeypatch.setattr(lowmem, "_fused_step_", counting)
        new_p, new_s = tx.step(p_fused, clone_tree(grads), s_fused)
        assert same_tree_bits((p_fused, s_fused), before), f"step {i}: the inputs changed"
        p_fused, s_fused = new_p, new_s
        monkeypatch.setattr(lowmem, "_fused_step_", lambda *a: None)
        p_plain, s_plain = tx.step(p_plain, clone_tree(grads), s_plain)
        assert same_tree_bits(p_fused, p_plain), f"step {i}"
        assert same_tree_bits((s_fused.master, s_fused.inner, s_fused.loss_scale, s_fused.finite, s_fused.skipped),
                              (s_plain.master, s_plain.inner, s_plain.loss_scale, s_plain.finite, s_plain.skipped))
    assert fused_calls == [True] * 12
    assert int(s_fused.skipped) == 1


# ------------------------------------------------------------------------------------------------
# On a GPU (ext/cuda/lowmem.cu; its host emulation is tests/test_cuda.py's test_emulated_lowmem_*)
# ------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_op():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if ops.load() != "cpu+cuda":
        pytest.skip("the CUDA kernels are not built")
    return torch.ops.ampfunc.adam_lowmem_step_


def _fp32_cuda_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step, grad_scale, finite,
                    lr, beta1, beta2, eps, weight_decay, amsgrad, decoupled_weight_decay, maximize, lr_tensor=None):
    """The twin's fp32 step served by the fp32 CUDA kernel (what ampfunc.lowmem's plain road runs)."""
    torch.ops.ampfunc.adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, step,
                                 grad_scale, finite, lr, lr_tensor, beta1, beta2, eps, weight_decay, amsgrad,
                                 decoupled_weight_decay, maximize)


@needs_cuda
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_cuda_kernel_is_its_twin_bit_for_bit_with_the_fp32_cuda_step(decoupled, monkeypatch):
    # The CUDA kernel's fp32 numbers are the fp32 CUDA kernel's (adam_element.cuh): bit for bit the
    # twin whose fp32 step is that kernel, and within fp32 rounding of the plain twin (torch's CUDA
    # ops round addcmul and the bias correction's division otherwise).
    from ampfunc.lowbits import join_bf16
    from ampfunc.ops import _lowmem_reference as twin
    op = _cuda_op()
    dev = torch.device("cuda")
    state = [[t.to(dev) for t in ts] for ts in _op_args(2)]
    ref_state, plain = clone_tree(state), clone_tree(state)
    step, ref_step, plain_step = (torch.zeros((), device=dev) for _ in range(3))
    maps, bases = q8_lookup(dev)
    lr_tensor = torch.tensor(3e-3, device=dev)
    for i in range(8):
        dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.float16]
        grads = [g.to(dt).to(dev) for g, dt in zip(_grads(state[0], i, torch.float32), dtypes)]
        if i == 5:
            grads[1][300] = 1e30  # a q8 second moment overflows (its block's absmax inf)
        finite = torch.tensor(i != 3, device=dev)
        scale = torch.tensor(0.5, device=dev)
        lr = (0.0, lr_tensor) if i % 2 else (1e-2, None)
        hyper = (0.9, 0.999, 1e-8, 0.05, decoupled, i == 4)
        before = clone_tree(state)
        op(*_with(state, grads), step, scale, finite, maps, bases, *lr, *hyper)
        monkeypatch.setattr(twin, "_ref_adam_step_", _fp32_cuda_step)
        twin._ref_adam_lowmem_step_(*_with(ref_state, grads), ref_step, scale, finite, maps, bases, *lr, *hyper)
        assert same_tree_bits(state, ref_state), f"step {i}"
        assert same_tree_bits(step, ref_step)
        if i == 3:
            assert same_tree_bits(state, before) and float(step) == 3.0
        if i == 0:  # one step from the same state: the plain twin within fp32 rounding
            monkeypatch.undo()
            twin._ref_adam_lowmem_step_(*_with(plain, grads), plain_step, scale, finite, maps, bases, *lr, *hyper)
            for k, (p, r) in enumerate(zip(state[0], state[1])):
                got = join_bf16(p, r) if p.dtype == torch.bfloat16 else p
                want = join_bf16(plain[0][k], plain[1][k]) if p.dtype == torch.bfloat16 else plain[0][k]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(step) == 7.0


@needs_cuda
def test_cuda_kernel_refuses_bad_inputs_by_name_before_any_write():
    op = _cuda_op()
    dev = torch.device("cuda")
    state = [[t.to(dev) for t in ts] for ts in _op_args(3)]
    grads = [g.to(dev) for g in _grads(state[0], 0, torch.float32)]
    maps, bases = q8_lookup(dev)
    step = torch.zeros((), device=dev)
    before = clone_tree(state)
    rest = (step, torch.tensor(1.0, device=dev), torch.tensor(True, device=dev), maps, bases, 1e-3, None, 0.9, 0.999,
            1e-8, 0.0, True, False)
    with pytest.raises(ValueError, match=r"exp_avgs\[4\] and exp_avg_sqs\[4\] overlap"):
        op(state[0], state[1], grads, state[2][:4] + [state[4][4]], *state[3:], *rest)
    with pytest.raises(ValueError, match=r"grads\[2\] is on cpu"):
        op(state[0], state[1], grads[:2] + [grads[2].cpu()] + grads[3:], *state[2:], *rest)
    with pytest.raises(ValueError, match=r"qmaps is on cpu"):
        op(state[0], state[1], grads, *state[2:], *rest[:3], q8_lookup()[0], *rest[4:])
    assert same_tree_bits(state, before) and float(step) == 0.0


@needs_cuda
@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_cuda_engine_split_q8_step__is_the_plain_road_bit_for_bit_and_sync_free(kind, monkeypatch):
    _cuda_op()
    dev = torch.device("cuda")
    params = {k: v.to(dev) for k, v in _params().items()}
    tx = _tx(kind, "q8", clip=kind == "adamw")
    p_fused, s_fused = clone_tree(params), tx.init(clone_tree(params))
    p_plain, s_plain = clone_tree(params), tx.init(clone_tree(params))
    fused_calls, counting = _counting_fused_step()
    for i in range(12):
        grads = {k: v.to(dev) for k, v in _tree_grads(params, i).items()}
        if i == 6:
            grads["w"][1, 2] = float("inf")  # a skipped step in the middle
        monkeypatch.setattr(lowmem, "_fused_step_", counting)
        previous = torch.cuda.get_sync_debug_mode()
        if i >= 2:  # warm (the kernels loaded, the q8 tables on the device): no host sync
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            p_fused, s_fused = tx.step_(p_fused, clone_tree(grads), s_fused)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        monkeypatch.setattr(lowmem, "_fused_step_", lambda *a: None)
        p_plain, s_plain = tx.step_(p_plain, clone_tree(grads), s_plain)
        assert same_tree_bits(p_fused, p_plain), f"step {i}"
        assert same_tree_bits((s_fused.master, s_fused.inner, s_fused.loss_scale, s_fused.finite, s_fused.skipped),
                              (s_plain.master, s_plain.inner, s_plain.loss_scale, s_plain.finite, s_plain.skipped)), \
            f"step {i}"
    assert fused_calls == [True] * 12
    assert int(s_fused.skipped) >= 1


# ------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------


def _bad_calls():
    # each spoils one argument of the schema-ordered lists and returns the name the error must give
    def absmax_shape(a):
        a[4][0] = torch.zeros(5)
        return "exp_avg_absmax[0]"

    def remainder_dtype(a):
        a[1][1] = a[1][1].to(torch.int32)
        return "remainders[1]"

    def remainder_of_fp32(a):
        a[1][4] = torch.zeros(300, dtype=torch.int16)
        return "remainders[4]"

    def moments_unlike(a):
        a[5][3] = a[5][3].float()
        return "exp_avg_sqs[3]"

    def fp16_param(a):
        a[0][2] = a[0][2].half()
        return "params[2]"

    def short_list(a):
        a[6] = a[6][:-1]
        return "exp_avg_sq_absmax"

    def grad_shape(a):
        a[2][1] = torch.zeros(4095, dtype=torch.bfloat16)
        return "grads[1]"

    def q8_absmax_dtype(a):
        a[6][1] = a[6][1].double()
        return "exp_avg_sq_absmax[1]"

    def aliased_params(a):
        a[0][1] = a[0][0].view(-1)[4096:]
        return "params[0] and params[1] overlap in memory"

    def one_tensor_for_both_moments(a):
        a[5][2] = a[3][2]
        return "exp_avgs[2] and exp_avg_sqs[2] overlap in memory"

    def shared_absmax(a):
        a[6][0] = a[4][0]
        return "exp_avg_absmax[0] and exp_avg_sq_absmax[0] overlap in memory"

    return [absmax_shape, remainder_dtype, remainder_of_fp32, moments_unlike, fp16_param, short_list, grad_shape,
            q8_absmax_dtype, aliased_params, one_tensor_for_both_moments, shared_absmax]


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("spoil", _bad_calls(), ids=lambda f: f.__name__)
def test_bad_inputs_are_refused_by_name_before_any_write(backend, spoil):
    op = _compiled() if backend == "compiled" else ops.references()[_OP]
    state = _op_args(1)
    args = _with(list(state), _grads(state[0], 0, torch.bfloat16))
    name = spoil(args)
    before = clone_tree(args)
    step = torch.zeros(())
    maps, bases = q8_lookup()
    with pytest.raises((ValueError, TypeError, RuntimeError), match=re.escape(name)):
        op(*args, step, torch.tensor(1.0), torch.tensor(True), maps, bases, 1e-2, None, 0.9, 0.999, 1e-8, 0.0,
           False, False)
    assert same_tree_bits(args, before) and float(step) == 0.0


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["compiled", "reference"])
@pytest.mark.parametrize("hyper, value, message", [
    ("lr", float("nan"), "lr must be in [0, 3.4028235e+38], got nan"),
    ("lr", -1.0, "lr must be in [0, 3.4028235e+38], got -1.0"),
    ("beta1", 1.0, "beta1 must be in [0, 1), got 1.0"),
    ("beta2", -0.1, "beta2 must be in [0, 1), got -0.1"),
    ("eps", float("nan"), "eps must be >= 0, got nan"),
    ("weight_decay", -1.0, "weight_decay must be >= 0, got -1.0"),
])
def test_hyper_parameters_out_of_range_are_refused_by_name_before_any_write(backend, hyper, value, message):
    op = _compiled() if backend == "compiled" else ops.references()[_OP]
    state = _op_args(1)
    args = _with(list(state), _grads(state[0], 0, torch.bfloat16))
    before = clone_tree(args)
    hypers = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, hyper: value}
    maps, bases = q8_lookup()
    with pytest.raises(ValueError, match=re.escape(f"ampfunc: {message} ({_OP})")):
        op(*args, torch.zeros(()), torch.tensor(1.0), torch.tensor(True), maps, bases, hypers["lr"], None,
           hypers["beta1"], hypers["beta2"], hypers["eps"], hypers["weight_decay"], False, False)
    assert same_tree_bits(args, before)


def test_both_backends_take_one_element_scalars_and_refuse_strided_lists_alike():
    op, ref = _compiled(), ops.references()[_OP]
    maps, bases = q8_lookup()
    outs = []
    for fn in (op, ref):
        state = _op_args(2)
        args = _with(list(state), _grads(state[0], 0, torch.float32))
        step = torch.zeros(1)
        fn(*args, step, torch.ones(1), torch.ones(1, dtype=torch.bool), maps, bases, 0.0, torch.tensor([1e-2]), 0.9,
           0.999, 1e-8, 0.0, True, False)
        outs.append((args, step))
    assert same_tree_bits(outs[0], outs[1]) and float(outs[0][1]) == 1.0
    for fn in (op, ref):
        state = _op_args(2)
        args = _with(list(state), _grads(state[0], 0, torch.float32))
        args[3][3] = args[3][3].t().contiguous().t()  # a transposed fp32-or-bf16 moment
        with pytest.raises(ValueError, match=re.escape(f"exp_avgs[3] is not contiguous; the low-memory step takes "
                                                       f"contiguous tensors ({_OP})")):
            fn(*args, torch.zeros(()), torch.ones(()), torch.tensor(True), maps, bases, 1e-2, None, 0.9, 0.999, 1e-8,
               0.0, True, False)


def test_the_op_compiles_fullgraph_and_gives_the_eager_numbers():
    op = _compiled()
    maps, bases = q8_lookup()

    def step(state, grads, step_t, finite):
        params, rems, m, ma, v, va = state
        torch.ops.ampfunc.adam_lowmem_step_(params, rems, grads, m, ma, v, va, step_t, torch.ones(()), finite, maps,
                                            bases, 1e-2, None, 0.9, 0.999, 1e-8, 0.1, True, False)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    state, eager = _op_args(2), _op_args(2)
    s1, s2 = torch.zeros(()), torch.zeros(())
    for i in range(3):
        grads = _grads(state[0], i, torch.float32)
        compiled(state, grads, s1, torch.tensor(i != 1))
        op(*_with(eager, clone_tree(grads)), s2, torch.ones(()), torch.tensor(i != 1), maps, bases, 1e-2, None, 0.9,
           0.999, 1e-8, 0.1, True, False)
        assert same_tree_bits(list(state), list(eager)) and same_tree_bits(s1, s2)


def test_the_q8_codes_at_the_maps_midpoints_and_their_neighbours_are_the_reference_codes():
    # beta1 = 0 makes the new first moment the gradient itself, and a 1.0 in every block makes its
    # absmax 1: the values the kernel encodes are exactly these, ties and specials included.
    op = _compiled()
    mids = af.lowbits.map_midpoints(True)
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.full_like(mids, -float("inf")))
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-30, -1e-30, 1.0, -1.0, 0.999999, -0.999999])
    # every exponent from 2**-149 to 1, both signs, at 8 mantissas: each row of the encoder's tables
    powers = torch.ldexp(torch.tensor(1.0), torch.arange(-149, 1))
    sweep = (powers[:, None] * (1 + torch.arange(8) / 8)[None, :]).reshape(-1)
    vals = torch.cat([mids, up, down, af.lowbits.dynamic_map(True), specials, sweep, -sweep])
    vals = vals.clamp(-1.0, 1.0)
    blocks = -(-vals.numel() // 255)
    vals = torch.cat([vals, torch.zeros(blocks * 255 - vals.numel())]).reshape(blocks, 255)
    g = torch.cat([torch.ones(blocks, 1), vals], dim=1).reshape(-1)
    g = torch.cat([g, torch.ones(4096 - g.numel() % 4096 if g.numel() < 4096 else 0)])
    n = g.numel()
    assert n % 256 == 0 and n >= 4096
    maps, bases = q8_lookup()

    def fresh():
        c1, a1 = af.lowbits.quantize_q8(torch.zeros(n), True)
        c2, a2 = af.lowbits.quantize_q8(torch.zeros(n), False)
        return [torch.zeros(n).bfloat16()], [torch.zeros(n, dtype=torch.int16)], [c1], [a1], [c2], [a2]

    a, b = fresh(), fresh()
    hyper = (0.0, 0.5, 1e-8, 0.0, False, False)
    op(*_with(a, [g]), torch.zeros(()), torch.ones(()), torch.tensor(True), maps, bases, 1e-3, None, *hyper)
    _ref_adam_lowmem_step_(*_with(b, [g]), torch.zeros(()), torch.ones(()), torch.tensor(True), maps, bases, 1e-3,
                           None, *hyper)
    assert torch.equal(a[2][0], af.lowbits.quantize_q8(g, True)[0])
    assert same_tree_bits(list(a), list(b))
