"""Policies: jmp's shorthand, casting rules, params as pytrees, norm layers kept fp32, autocast."""

import collections
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad

import ampfunc as af
from ampfunc.policy import NORM_LAYER_TYPES, Policy, get_policy, parse_dtype

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FLOATS = [F16, BF16, F32, F64]


def dtypes(policy):
    return policy.param_dtype, policy.compute_dtype, policy.output_dtype


# ----------------------------------------------------------------------------------------------
# get_policy: jmp's grammar
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [
    ("f16", F16), ("float16", F16), ("half", F16), ("fp16", F16),
    ("bf16", BF16), ("bfloat16", BF16),
    ("f32", F32), ("float32", F32), ("full", F32), ("fp32", F32),
    ("f64", F64), ("float64", F64), ("double", F64),
    ("BF16", BF16), ("torch.float16", F16),
])
def test_get_policy_single_dtype_name_sets_all_three(name, dtype):
    assert dtypes(get_policy(name)) == (dtype, dtype, dtype)


def test_get_policy_half_preset_is_all_fp16_and_full_is_all_fp32():
    assert get_policy("half") == Policy(F16, F16, F16)
    assert get_policy("full") == Policy(F32, F32, F32)


@pytest.mark.parametrize("spec", [
    "p=f32,c=bf16,o=f32",
    "params=float32,compute=bfloat16,output=float32",
    "o=full,c=bf16,p=f32",
    " p = f32 , c = bf16 , o = f32 ",
    "param=fp32,compute=bf16,output=f32",
])
def test_get_policy_shorthand_and_full_names_agree(spec):
    assert dtypes(get_policy(spec)) == (F32, BF16, F32)


def test_get_policy_jmp_readme_example():
    assert dtypes(get_policy("params=float32,compute=float16,output=float32")) == (F32, F16, F32)


@pytest.mark.parametrize("d", ["f16", "bf16", "f64"])
def test_get_policy_compute_only_defaults_params_to_f32_and_output_to_compute(d):
    dt = parse_dtype(d)
    assert dtypes(get_policy(f"c={d}")) == (F32, dt, dt)


def test_get_policy_params_only_compute_and_output_follow_params():
    assert dtypes(get_policy("p=bf16")) == (BF16, BF16, BF16)


def test_get_policy_output_follows_compute_not_params():
    assert dtypes(get_policy("p=f32,c=f16")) == (F32, F16, F16)


def test_get_policy_explicit_output_overrides_default():
    assert dtypes(get_policy("c=f16,o=full")) == (F32, F16, F32)


def test_get_policy_accepts_dtype_and_policy():
    assert get_policy(BF16) == Policy(BF16, BF16, BF16)
    p = Policy(F32, F16, F32)
    assert get_policy(p) is p


@pytest.mark.parametrize("spec,named", [
    ("compute_float16", "compute_float16"),      # jmp: almost a dtype is not one
    ("p=f32,c=f17", "f17"),
    ("q=f32", "'q'"),
    ("p=f32,c=f16,c=f32", "compute given twice"),
    ("p=f32,,o=f16", "empty entry"),
    ("p=", "'p='"),
    ("=f16", "'=f16'"),
    ("", "empty policy"),
    ("f", "'f'"),                                 # jmp's error text promises contractions it lacks
])
def test_get_policy_bad_string_raises_value_error_naming_the_bad_part(spec, named):
    with pytest.raises(ValueError, match=named):
        get_policy(spec)


def test_get_policy_rejects_non_string():
    with pytest.raises(TypeError):
        get_policy(16)


def test_get_policy_rejects_non_floating_dtype():
    with pytest.raises(ValueError, match="int32"):
        get_policy(torch.int32)


# ----------------------------------------------------------------------------------------------
# Policy object
# ----------------------------------------------------------------------------------------------


def test_policy_str_round_trips_through_get_policy():
    for p in [Policy(F32, BF16, F32), Policy(F16, F16, F32), Policy(F64, F32, F16)]:
        assert get_policy(str(p)) == p
    assert str(Policy(F32, BF16, F32)) == "p=f32,c=bf16,o=f32"


def test_policy_repr_names_the_dtypes():
    assert repr(get_policy("c=bf16,o=f32")) == (
        "Policy(param_dtype=torch.float32, compute_dtype=torch.bfloat16, output_dtype=torch.float32)")


def test_policy_is_frozen_hashable_and_picklable():
    p = get_policy("p=f32,c=f16,o=f32")
    with pytest.raises(AttributeError):
        p.compute_dtype = BF16
    assert {p: 1}[get_policy("params=float32,compute=half,output=full")] == 1
    assert pickle.loads(pickle.dumps(p)) == p


def test_policy_fields_accept_names_and_reject_non_floats():
    assert Policy("f32", "bf16", "f32") == Policy(F32, BF16, F32)
    with pytest.raises(ValueError, match="compute_dtype"):
        Policy(F32, torch.int8, F32)


def test_policy_with_dtype_returns_new_policy_and_leaves_original():
    p = get_policy("p=f32,c=f16,o=f16")
    assert p.with_output_dtype(F32) == Policy(F32, F16, F32)
    assert p.with_compute_dtype("bf16") == Policy(F32, BF16, F16)
    assert p.with_param_dtype(F64) == Policy(F64, F16, F16)
    assert p == Policy(F32, F16, F16)


# ----------------------------------------------------------------------------------------------
# Casting trees
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("method,field", [
    ("cast_to_param", "param_dtype"), ("cast_to_compute", "compute_dtype"), ("cast_to_output", "output_dtype")])
def test_policy_cast_methods_cast_floating_tensors_to_their_dtype(dtype, method, field):
    policy = Policy(**{"param_dtype": F32, "compute_dtype": F32, "output_dtype": F32, field: dtype})
    x = torch.randn(3, dtype=F32)
    y = getattr(policy, method)({"x": x})["x"]
    assert y.dtype == dtype
    torch.testing.assert_close(y, x.to(dtype))


def test_cast_passes_ints_bools_numpy_strings_numbers_and_none_through():
    ints = torch.arange(3)
    flags = torch.tensor([True, False])
    arr = np.ones(3, dtype=np.float32)
    tree = {"ints": ints, "flags": flags, "arr": arr, "name": "bert", "n": 3, "lr": 0.5, "nothing": None}
    out = get_policy("half").cast_to_compute(tree)
    assert out["ints"] is ints and out["flags"] is flags
    assert out["arr"] is arr and out["arr"].dtype == np.float32
    assert out["name"] == "bert" and out["n"] == 3 and out["lr"] == 0.5 and out["nothing"] is None


def test_cast_leaves_already_in_target_dtype_untouched():
    x = torch.randn(4, dtype=F16)
    assert get_policy("half").cast_to_compute([x])[0] is x


def test_cast_calls_to_on_objects_that_have_it():
    class Boxed:
        def __init__(self, dtype=F32):
            self.dtype = dtype

        def to(self, dtype):
            return Boxed(dtype)

    box = Boxed()
    out = get_policy("bf16").cast_to_compute({"box": box})["box"]
    assert isinstance(out, Boxed) and out.dtype == BF16
    assert box.dtype == F32


def test_cast_leaves_modules_alone_because_module_to_is_in_place():
    lin = nn.Linear(2, 2)
    out = get_policy("half").cast_to_compute({"m": lin})
    assert out["m"] is lin and lin.weight.dtype == F32


def test_cast_leaves_loss_scales_alone():
    ls = af.DynamicLossScale()
    out = get_policy("half").cast_to_compute((torch.ones(2), ls))
    assert out[1] is ls and ls.loss_scale.dtype == F32
    assert out[0].dtype == F16


def test_cast_recurses_into_namedtuples_lists_tuples_and_dicts():
    Batch = collections.namedtuple("Batch", "x mask")
    tree = {"batch": Batch(torch.ones(2), torch.ones(2, dtype=torch.bool)), "seq": [torch.ones(1), (torch.ones(1),)]}
    out = get_policy("p=f32,c=bf16,o=f32").cast_to_compute(tree)
    assert isinstance(out["batch"], Batch)
    assert out["batch"].x.dtype == BF16 and out["batch"].mask.dtype == torch.bool
    assert isinstance(out["seq"], list) and isinstance(out["seq"][1], tuple)
    assert out["seq"][0].dtype == BF16 and out["seq"][1][0].dtype == BF16


def test_cast_is_differentiable_and_grads_come_back_in_the_input_dtype():
    x = torch.randn(3, requires_grad=True)
    y = get_policy("bf16").cast_to_compute(x)
    (y.float() * 2).sum().backward()
    assert x.grad.dtype == F32
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_cast_does_not_mutate_its_input():
    tree = {"w": torch.ones(2)}
    get_policy("half").cast_to_compute(tree)
    assert tree["w"].dtype == F32


# ----------------------------------------------------------------------------------------------
# params_of / buffers_of
# ----------------------------------------------------------------------------------------------


class ConvNet(nn.Module):
    """A small conv + BatchNorm + LayerNorm model: the norm-keeping case of apex O2."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 8), nn.LayerNorm(8), nn.ReLU())
        self.groups = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.body(torch.relu(self.bn(self.conv(x))))
        return self.head(self.groups(h.unsqueeze(-1)).squeeze(-1))


NORM_PATHS = {
    "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
    "body.2.weight", "body.2.bias", "groups.weight", "groups.bias",
}


def test_params_of_is_a_dict_of_plain_tensors_sharing_storage_with_the_module():
    model = ConvNet()
    params = af.params_of(model)
    assert list(params) == [n for n, _ in model.named_parameters()]
    assert "body.1.weight" in params
    for name, p in model.named_parameters():
        assert type(params[name]) is torch.Tensor and not params[name].requires_grad
        assert params[name].data_ptr() == p.data_ptr()


def test_buffers_of_lists_running_stats():
    buffers = af.policy.buffers_of(ConvNet())
    assert set(buffers) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    assert buffers["bn.num_batches_tracked"].dtype == torch.int64


def test_params_of_feeds_functional_call_and_grad():
    torch.manual_seed(0)
    model = ConvNet().eval()
    params, buffers = af.params_of(model), af.policy.buffers_of(model)
    x = torch.randn(2, 1, 4, 4)
    torch.testing.assert_close(functional_call(model, {**params, **buffers}, (x,)), model(x))
    g = grad(lambda p: functional_call(model, {**p, **buffers}, (x,)).sum())(params)
    assert set(g) == set(params)


def test_params_of_lists_tied_parameters_once():
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    model[1].weight = model[0].weight
    assert list(af.params_of(model)) == ["0.weight"]


def test_params_of_rejects_non_modules():
    with pytest.raises(TypeError, match="Module"):
        af.params_of({"w": torch.ones(1)})


# ----------------------------------------------------------------------------------------------
# norm_layers
# ----------------------------------------------------------------------------------------------


def test_norm_layers_names_params_and_buffers_of_batchnorm_layernorm_groupnorm():
    assert af.norm_layers(ConvNet()) == NORM_PATHS


@pytest.mark.parametrize("norm", [
    nn.BatchNorm1d(4), nn.BatchNorm3d(4), nn.SyncBatchNorm(4), nn.InstanceNorm2d(4, affine=True),
    nn.LocalResponseNorm(2), nn.LazyBatchNorm1d(),
] + ([nn.RMSNorm(4)] if hasattr(nn, "RMSNorm") else []))
def test_norm_layers_covers_every_torch_norm_type(norm):
    model = nn.Sequential(nn.Linear(4, 4), norm)
    expected = {f"1.{n}" for n, _ in norm.named_parameters()} | {f"1.{n}" for n, _ in norm.named_buffers()}
    assert isinstance(norm, NORM_LAYER_TYPES)
    assert af.norm_layers(model) == expected
    assert not any(p.startswith("0.") for p in af.norm_layers(model))


def test_norm_layers_counts_subclasses_and_custom_types():
    class MyBN(nn.BatchNorm1d):
        pass

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(2))

    model = nn.Sequential(MyBN(2), Scale())
    assert "0.weight" in af.norm_layers(model)
    assert af.norm_layers(model, types=(Scale,)) == {"1.gain"}
    assert af.norm_layers(model, types=NORM_LAYER_TYPES + (Scale,)) >= {"0.weight", "1.gain"}
    with pytest.raises(TypeError, match="Module"):
        af.norm_layers(model, types=(int,))


def test_norm_layers_with_batch_norm_types_keeps_only_what_apex_o2_keeps():
    assert af.norm_layers(ConvNet(), types=af.policy.BATCH_NORM_TYPES) == {
        "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}


def test_norm_layers_of_a_model_without_norms_is_empty():
    assert af.norm_layers(nn.Linear(2, 2)) == frozenset()


# ----------------------------------------------------------------------------------------------
# cast_params
# ----------------------------------------------------------------------------------------------


def test_cast_params_keeps_norm_layers_fp32_and_casts_the_rest():
    model = ConvNet()
    tree = {**af.params_of(model), **af.policy.buffers_of(model)}
    out = af.cast_params(tree, F16, keep=af.norm_layers(model))
    for path, leaf in out.items():
        if path == "bn.num_batches_tracked":
            assert leaf.dtype == torch.int64
        elif path in NORM_PATHS:
            assert leaf.dtype == F32 and leaf is tree[path], path
        else:
            assert leaf.dtype == F16, path


def test_cast_params_keep_accepts_paths_prefixes_a_single_string_and_a_predicate():
    params = af.params_of(ConvNet())
    by_list = af.cast_params(params, BF16, keep=["head.weight"])
    assert by_list["head.weight"].dtype == F32 and by_list["head.bias"].dtype == BF16
    by_prefix = af.cast_params(params, BF16, keep={"body"})
    assert all(v.dtype == F32 for k, v in by_prefix.items() if k.startswith("body."))
    assert by_prefix["conv.weight"].dtype == BF16
    by_str = af.cast_params(params, BF16, keep="conv.bias")
    assert by_str["conv.bias"].dtype == F32 and by_str["conv.weight"].dtype == BF16
    biases_kept = af.cast_params(params, BF16, keep=lambda path, leaf: path.endswith("bias"))
    assert {k for k, v in biases_kept.items() if v.dtype == F32} == {k for k in params if k.endswith("bias")}


def test_cast_params_prefix_does_not_match_a_longer_name():
    params = {"head": torch.ones(1), "header.weight": torch.ones(1)}
    out = af.cast_params(params, F16, keep={"head"})
    assert out["head"].dtype == F32 and out["header.weight"].dtype == F16


def test_cast_params_without_keep_casts_every_floating_leaf_and_no_other():
    tree = {"w": torch.ones(2), "step": torch.tensor(3), "opt": (torch.ones(1, dtype=F64), None), "tag": "x"}
    out = af.cast_params(tree, "bf16")
    assert out["w"].dtype == BF16 and out["opt"][0].dtype == BF16
    assert out["step"] is tree["step"] and out["opt"][1] is None and out["tag"] == "x"


def test_cast_params_returns_leaves_already_in_dtype_as_is_and_does_not_mutate():
    w16, w32 = torch.ones(2, dtype=F16), torch.ones(2)
    params = {"a": w16, "b": w32}
    out = af.cast_params(params, F16)
    assert out["a"] is w16 and out["b"] is not w32
    assert params["b"] is w32 and w32.dtype == F32


def test_cast_params_inside_grad_gives_fp32_grads_for_fp32_params():
    torch.manual_seed(0)
    model = ConvNet().eval()
    params, buffers = af.params_of(model), af.policy.buffers_of(model)
    keep = af.norm_layers(model)
    x = torch.randn(2, 1, 4, 4)

    def loss_fn(p):
        p = af.cast_params({**p, **buffers}, BF16, keep=keep)
        with torch.autocast("cpu", enabled=False):
            out = functional_call(model, p, (x.to(BF16),))
        return out.float().square().mean()

    # Mixed-dtype modules (fp32 BatchNorm fed bf16 activations) work under CPU kernels, as in
    # apex O2; the grads w.r.t. the fp32 master params are fp32.
    g = grad(loss_fn)(params)
    assert all(v.dtype == F32 for v in g.values())
    assert all(torch.isfinite(v).all() for v in g.values())


def test_cast_params_kept_batchnorm_buffers_receive_running_stat_updates_under_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    params, buffers = af.params_of(model), af.policy.buffers_of(model)

    def loss_fn(p, b, x):
        p = af.cast_params({**p, **b}, BF16, keep=af.norm_layers(model))
        return functional_call(model, p, (x.to(BF16),)).float().square().sum()

    grad(loss_fn)(params, buffers, torch.randn(8, 4))
    assert model[1].num_batches_tracked.item() == 1
    assert model[1].running_mean.abs().sum() > 0
    assert model[1].running_mean.dtype == F32


def test_cast_params_of_params_and_buffers_keeps_each_parts_norm_paths():
    # The (params, buffers) pair functional_call takes: "1.weight" names the norm weight in the
    # params dict, not "0.1.weight" in the pair.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    p, b = af.cast_params((af.params_of(model), af.policy.buffers_of(model)), torch.bfloat16,
                          keep=af.norm_layers(model))
    assert p["0.weight"].dtype == torch.bfloat16 and p["1.weight"].dtype == torch.float32
    assert b["1.running_var"].dtype == torch.float32
    # a list of tensors keeps its index paths
    w, v = af.cast_params([torch.ones(2), torch.ones(2)], torch.bfloat16, keep="1")
    assert w.dtype == torch.bfloat16 and v.dtype == torch.float32


def test_cast_params_leaves_a_loss_scale_alone():
    tree = {"w": torch.ones(2), "ls": af.DynamicLossScale()}
    out = af.cast_params(tree, torch.float16)
    assert out["w"].dtype == torch.float16 and out["ls"] is tree["ls"]
    assert float(out["ls"].loss_scale) == 2.0 ** 16  # cast to fp16 it was inf


def test_cast_params_rejects_bad_dtype_and_bad_keep():
    with pytest.raises(ValueError, match="int8"):
        af.cast_params({"w": torch.ones(1)}, torch.int8)
    with pytest.raises(ValueError, match="f17"):
        af.cast_params({"w": torch.ones(1)}, "f17")
    with pytest.raises(TypeError, match="keep"):
        af.cast_params({"w": torch.ones(1)}, F16, keep=3)


# ----------------------------------------------------------------------------------------------
# autocast bridge
# ----------------------------------------------------------------------------------------------


def _cpu_autocast_supports(dtype) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            with torch.autocast("cpu", dtype=dtype):
                return torch.is_autocast_enabled("cpu") if _has_device_arg() else torch.is_autocast_cpu_enabled()
        except (UserWarning, RuntimeError, AssertionError):
            return False


def _has_device_arg() -> bool:
    try:
        torch.is_autocast_enabled("cpu")
        return True
    except TypeError:
        return False


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_policy_autocast_runs_matmuls_in_compute_dtype(dtype):
    if not _cpu_autocast_supports(dtype):
        pytest.skip(f"this torch's CPU autocast does not support {dtype}")
    policy = Policy(F32, dtype, F32)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with policy.autocast("cpu"):
        out = a @ b
    assert out.dtype == dtype
    assert (a @ b).dtype == F32


@pytest.mark.parametrize("spec", ["full", "f64", "p=f16,c=f32"])
def test_policy_autocast_is_a_disabled_region_for_full_precision_compute(spec):
    policy = get_policy(spec)
    assert not policy.autocast_enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with policy.autocast("cpu"):
            out = torch.randn(2, 2) @ torch.randn(2, 2)
    assert out.dtype == F32


def test_policy_autocast_disabled_region_turns_off_an_outer_autocast():
    with torch.autocast("cpu", dtype=BF16):
        with get_policy("full").autocast("cpu"):
            out = torch.randn(2, 2) @ torch.randn(2, 2)
    assert out.dtype == F32


def test_policy_autocast_and_cast_to_output_drive_a_module_forward():
    policy = get_policy("p=f32,c=bf16,o=f32")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with policy.autocast("cpu"):
        hidden = model[0](x)
        out = policy.cast_to_output(model(x))
    assert hidden.dtype == BF16 and out.dtype == F32
    assert model[0].weight.dtype == F32  # autocast casts on the fly; the params stay fp32
    torch.testing.assert_close(out, model(x), atol=5e-2, rtol=5e-2)
