"""recommend_policy: one test per branch (this CPU, native-bf16 CPUs, sm80+, pre-sm80, bad input)."""

import pytest
import torch

import ampfunc as af
from ampfunc.advisor import Recommendation, cpu_bf16_flags, recommend_policy


def test_on_this_cpu_a_policy_with_a_reason():
    rec = recommend_policy("cpu")
    assert isinstance(rec, Recommendation) and isinstance(rec.policy, af.Policy)
    assert rec.device == "cpu" and rec.reason.endswith(".") and len(rec.reason) > 40
    assert all(isinstance(r, str) for r in rec.requirements) and rec.requirements
    # the branch follows this CPU's flags: bf16 only with native bf16 instructions
    native = bool(cpu_bf16_flags())
    assert rec.precision == ("bf16" if native else "fp32")
    assert rec.policy.compute_dtype == (torch.bfloat16 if native else torch.float32)
    assert isinstance(rec.loss_scale, af.NoOpLossScale)


def test_default_device_here_is_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert recommend_policy().device == "cpu"


@pytest.mark.parametrize("flags, precision", [(["avx512f", "avx512_bf16"], "bf16"), (["amx_bf16"], "bf16"),
                                              (["bf16", "asimd"], "bf16"), (["avx2", "avx512f"], "fp32")])
def test_cpu_bf16_only_with_native_bf16_instructions(flags, precision):
    rec = recommend_policy("cpu", cpu_flags=flags)
    assert rec.precision == precision and isinstance(rec.loss_scale, af.NoOpLossScale)
    assert str(rec.policy) == ("p=f32,c=bf16,o=f32" if precision == "bf16" else "p=f32,c=f32,o=f32")


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert cpu_bf16_flags(str(info)) == ["avx512_bf16", "amx_bf16"]
    assert cpu_bf16_flags(str(tmp_path / "missing")) == []


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0), (10, 0)])
def test_sm80_and_later_bf16_without_scaling(capability):
    rec = recommend_policy("cuda", capability=capability, n_params=10**6)  # too small for fp8
    assert rec.precision == "bf16" and rec.policy.compute_dtype == torch.bfloat16
    assert rec.policy.param_dtype == torch.float32 and isinstance(rec.loss_scale, af.NoOpLossScale)
    assert rec.capability == capability and "no loss scaling" in rec.reason


def test_fp8_capable_gpu_says_why_fp8_is_not_advised():
    rec = recommend_policy(capability=(9, 0), n_params=10**6)  # device defaults to cuda when planning a capability
    assert rec.device == "cuda" and rec.precision == "bf16"
    assert any("fp8" in r for r in rec.requirements)
    assert not any("fp8" in r for r in recommend_policy("cuda", capability=(8, 0)).requirements)


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_fp8_advised_on_fp8_hardware_for_large_models(capability):
    rec = recommend_policy("cuda", capability=capability, n_params=10**9)
    assert rec.precision == "fp8" and rec.policy.compute_dtype == torch.bfloat16
    assert isinstance(rec.loss_scale, af.NoOpLossScale) and any("fp8_policy" in r for r in rec.requirements)
    assert recommend_policy("cuda", capability=capability, n_params=10**9, stability="high").precision == "bf16"
    assert recommend_policy("cuda", capability=(8, 6), n_params=10**9).precision == "bf16"


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (6, 1)])
def test_before_sm80_fp16_with_dynamic_loss_scale(capability):
    rec = recommend_policy("cuda", capability=capability)
    assert rec.precision == "fp16" and rec.policy.compute_dtype == torch.float16
    assert isinstance(rec.loss_scale, af.DynamicLossScale) and rec.loss_scale.hysteresis == 1
    assert "65504" in rec.reason and any("DynamicLossScale" in r for r in rec.requirements)
    stable = recommend_policy("cuda", capability=capability, stability="high")
    assert stable.loss_scale.hysteresis == 2


@pytest.mark.parametrize("capability", [(5, 2), (5, 0), (3, 5), (1, 0)])
def test_before_sm60_fp32_since_there_is_no_fast_fp16(capability):
    rec = recommend_policy("cuda", capability=capability, n_params=10**9)
    assert rec.precision == "fp32" and rec.policy.compute_dtype == torch.float32
    assert isinstance(rec.loss_scale, af.NoOpLossScale) and rec.capability == capability
    sm = f"sm{capability[0]}{capability[1]}"
    assert f"{sm} has neither bf16 nor fast fp16" in rec.reason
    assert any(">= 6.0 for fast fp16" in r for r in rec.requirements)
    # the first capability with fast fp16 gets it
    assert recommend_policy("cuda", capability=(6, 0)).precision == "fp16"


@pytest.mark.parametrize("capability", [(0, 0), (0, 5), (-1, 0), (8, -1), (8, 10), (-7, -7)])
def test_impossible_capabilities_are_refused_naming_the_setting(capability):
    with pytest.raises(ValueError, match=r"capability=\(.*\) is no CUDA compute capability \(major >= 1, minor 0-9"):
        recommend_policy("cuda", capability=capability)


@pytest.mark.parametrize("capability", [(8.0, 0), (8, 0.5), ("8", "0"), (True, 0), "80", 80])
def test_non_integer_capabilities_are_refused_naming_the_setting(capability):
    with pytest.raises(TypeError, match="capability must be a \\(major, minor\\) pair of ints"):
        recommend_policy("cuda", capability=capability)


def test_the_advice_trains():
    rec = recommend_policy("cuda", capability=(7, 0), n_params=10)
    assert any("MiB" in r for r in rec.requirements)
    tx = af.mixed_precision(af.sgd(0.1), loss_scale=rec.loss_scale)
    params = {"w": torch.ones(3)}
    state = tx.init(params)
    grads = {"w": af.loss_scale_of(state).loss_scale * torch.ones(3)}
    params, state = tx.step(params, grads, state)
    assert torch.allclose(params["w"], torch.full((3,), 0.9))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="stability"):
        recommend_policy("cpu", stability="max")
    with pytest.raises(ValueError, match="capability"):
        recommend_policy("cuda", capability=(8,))
    with pytest.raises(ValueError, match="device type 'meta'"):
        recommend_policy("meta")
    with pytest.raises(ValueError, match="n_params"):
        recommend_policy("cpu", n_params=-1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="capability="):
            recommend_policy("cuda")
