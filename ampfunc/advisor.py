"""Which precision to train in, from the hardware: a policy, a loss scale, a reason, requirements.

    rec = af.recommend_policy()                          # this machine
    rec = af.recommend_policy("cuda", capability=(7, 0)) # plan for a V100 you do not have
    print(rec.reason)
    tx = af.mixed_precision(af.adamw(1e-3), loss_scale=rec.loss_scale)

The rules (the practice guide's, made concrete):

* CUDA from sm80 (Ampere, Ada, Hopper, Blackwell): bf16 compute, fp32 params, no loss scaling
  (bf16 has fp32's exponent range).
* CUDA from sm60 to before sm80 (Pascal without tensor cores, Volta, Turing): fp16 compute
  with ``DynamicLossScale`` (fp16 tops out at 65504 and flushes gradients below ~6e-8 to zero).
* CUDA before sm60 (Maxwell, Kepler): fp32, with no loss scaling: they have neither bf16 nor
  fast fp16 arithmetic.
* fp8 (sm89 / sm90+ only) is offered only when this ampfunc ships ``ampfunc.fp8``.
* CPU: bf16 where the CPU has native bf16 instructions (AVX512-BF16, AMX-BF16, Arm BF16),
  else fp32: elsewhere bf16 is emulated and slower than fp32.
"""

from __future__ import annotations

import importlib.util
import numbers
import platform
import re
from collections import abc
from typing import NamedTuple, Optional, Sequence, Union

import torch

from ampfunc.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from ampfunc.policy import Policy, get_policy

__all__ = ["Recommendation", "recommend_policy"]

# Instruction-set flags (Linux /proc/cpuinfo names) that execute bf16 arithmetic natively.
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX512-BF16, x86 AMX, Arm FEAT_BF16
# Below this many parameters fp8's per-tensor scaling bookkeeping costs more than its matmuls save.
_FP8_MIN_PARAMS = 100_000_000


class Recommendation(NamedTuple):
    """The advice of :func:`recommend_policy`: a policy, a loss scale, the reason, requirements.

    Attributes:
      policy: the :class:`Policy` to train with.
      loss_scale: a fresh loss scale instance (``DynamicLossScale`` for fp16,
        ``NoOpLossScale`` otherwise).
      reason: one sentence saying why.
      requirements: what must hold for the advice to work (a list of strings).
      precision: the compute format's short name (``"fp32"``, ``"bf16"``, ``"fp16"``,
        ``"fp8"``).
      device: the device type planned for (``"cpu"`` or ``"cuda"``).
      capability: the CUDA capability planned for, or ``None`` (CPU).
      master: the ``master=`` to pass to :func:`ampfunc.mixed_precision` (``"split"`` when
        memory is the constraint, else ``"fp32"``).
      moments: the ``moments=`` to pass to ``af.adamw`` (``"q8"`` when memory is the
        constraint, else ``"fp32"``).

    Example:
      >>> rec = af.recommend_policy("cpu", cpu_flags=[])
      >>> rec.precision, str(rec.policy), rec.device, rec.capability
      ('fp32', 'p=f32,c=f32,o=f32', 'cpu', None)
    """

    policy: Policy
    loss_scale: LossScale
    reason: str
    requirements: list
    precision: str
    device: str
    capability: Optional[tuple] = None
    master: str = "fp32"
    moments: str = "fp32"


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The native-bf16 instruction flags this CPU reports (``[]`` when none, or off Linux).

    Reads ``cpuinfo``'s ``flags`` (x86) or ``Features`` (Arm) line once; no torch involved.
    """
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags = set(value.lower().split())
                    return [flag for flag in _CPU_BF16_FLAGS if flag in flags]
    except OSError:
        pass
    return []


def _fp8_available() -> bool:
    # Look for the module without importing it: a half-built ampfunc.fp8 must not break advice.
    return importlib.util.find_spec("ampfunc.fp8") is not None


def _flag_set(cpu_flags) -> set:
    """``cpu_flags`` (a string of flags separated by whitespace or commas, as /proc/cpuinfo's
    ``flags`` line, or an iterable of such strings) as a set of lower-case flag names."""
    if isinstance(cpu_flags, str):
        items = [cpu_flags]
    elif isinstance(cpu_flags, (bytes, bytearray)) or not isinstance(cpu_flags, abc.Iterable):
        raise TypeError("recommend_policy: cpu_flags must be a string of flags (e.g. /proc/cpuinfo's 'flags' "
                        f"line) or a list of flag strings, got {type(cpu_flags).__name__}")
    else:
        items = list(cpu_flags)
        bad = [f for f in items if not isinstance(f, str)]
        if bad:
            raise TypeError(f"recommend_policy: cpu_flags must hold strings, got {bad[0]!r} "
                            f"({type(bad[0]).__name__})")
    return {flag.lower() for item in items for flag in re.split(r"[\s,]+", item) if flag}


def _check_capability(capability) -> tuple:
    if isinstance(capability, (str, bytes)) or not isinstance(capability, abc.Sequence):
        raise TypeError(f"recommend_policy: capability must be a (major, minor) pair of ints, got "
                        f"{type(capability).__name__} {capability!r}")
    if len(capability) != 2:
        raise ValueError(f"recommend_policy: capability must be a (major, minor) pair of ints, got {capability!r}")
    for c in capability:
        if isinstance(c, bool) or not isinstance(c, numbers.Integral):
            raise TypeError(f"recommend_policy: capability must be a (major, minor) pair of ints, got "
                            f"{capability!r} (holding a {type(c).__name__})")
    major, minor = int(capability[0]), int(capability[1])
    # Every CUDA compute capability so far is major >= 1 with a one-digit minor (1.0 .. 12.1).
    if major < 1 or not 0 <= minor <= 9:
        raise ValueError(f"recommend_policy: capability={capability!r} is no CUDA compute capability (major >= 1, "
                         "minor 0-9, e.g. (7, 0) for a V100, (8, 0) for an A100): pass the GPU's "
                         "torch.cuda.get_device_capability()")
    return (major, minor)


def recommend_policy(device: Union[str, torch.device, None] = None, *,
                     capability: Optional[Sequence[int]] = None,
                     cpu_flags: Union[str, Sequence[str], None] = None,
                     n_params: Optional[int] = None,
                     stability: str = "normal",
                     device_memory: Optional[int] = None) -> Recommendation:
    """The precision to train in on ``device``, with the reason and the requirements.

    Args:
      device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``, or ``None`` (``"cuda"``
        when ``capability`` is given, ``"cpu"`` when ``cpu_flags`` is given, else CUDA when
        available, else CPU).
      capability: ``(major, minor)`` CUDA compute capability (two ints, ``major >= 1`` and
        ``minor`` in 0-9; bools are not ints) to plan for a GPU you do not have; by default the
        device's own. Refused
        (``ValueError``) for a CPU plan, where it has no meaning.
      cpu_flags: instruction flags to plan for a CPU you do not have: a list of flags (e.g.
        ``["avx512_bf16"]``) or one string of them separated by whitespace or commas (e.g.
        /proc/cpuinfo's ``flags`` line), matched case-insensitively; by default this machine's
        (:func:`cpu_bf16_flags`). Refused (``ValueError``) for a CUDA plan.
      n_params: the model's parameter count (an int >= 0, not a bool), when known. It sizes
        the master-weight requirement, and fp8 is only advised from 100M parameters.
      device_memory: the bytes of device memory to plan for (an int >= 1, not a bool; by
        default a CUDA device's own total; unknown for a CPU or a planned GPU). With ``n_params``: where the persistent
        state of an fp32-master Adam step (14 bytes per parameter: bf16 params, fp32 master, two
        fp32 moments) would not fit, and the low-memory one (about 6: split master, 8-bit
        moments) would, that is advised (``master="split"``, ``moments="q8"``, bf16 params).
      stability: ``"normal"`` or ``"high"``. ``"high"`` never advises fp8, and before sm80
        advises a dynamic scale that tolerates one overflow before backing off (hysteresis 2).

    Returns:
      A :class:`Recommendation` (``policy``, ``loss_scale``, ``reason``, ``requirements``, ...).

    Raises:
      TypeError: ``capability``, ``cpu_flags``, ``n_params`` or ``device_memory`` of the wrong
        type (named).
      ValueError: a value out of range, an unknown ``stability`` or device type, or a setting
        that does not apply to the device planned for (named).

    Example:
      >>> rec = af.recommend_policy("cuda", capability=(8, 0))
      >>> str(rec.policy), type(rec.loss_scale).__name__
      ('p=f32,c=bf16,o=f32', 'NoOpLossScale')
      >>> af.recommend_policy("cpu", cpu_flags="fpu sse avx512_bf16").precision
      'bf16'

    Cost: no tensor work, no host sync. At most ``torch.cuda.is_available()`` (no
    ``capability`` given), ``get_device_capability`` (CUDA without ``capability``) and one read
    of ``/proc/cpuinfo`` (CPU without ``cpu_flags``).
    """
    if stability not in ("normal", "high"):
        raise ValueError(f"recommend_policy: stability must be 'normal' or 'high', got {stability!r}")
    n_params = _count("n_params", n_params, "a non-negative int", 0)
    device_memory = _count("device_memory", device_memory, "a positive int (bytes)", 1)
    if capability is not None:
        capability = _check_capability(capability)
    flags = None if cpu_flags is None else _flag_set(cpu_flags)
    if device is None:
        if capability is not None and flags is not None:
            raise ValueError("recommend_policy: capability= plans for a CUDA GPU and cpu_flags= for a CPU; pass "
                             "one of them (or device=)")
        device = ("cuda" if capability is not None else "cpu" if flags is not None
                  else "cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cpu" and capability is not None:
        raise ValueError(f"recommend_policy: capability={capability!r} is a CUDA compute capability and does not "
                         "apply to a CPU plan (device='cpu'); drop it, or plan for device='cuda'")
    if dev.type == "cuda" and flags is not None:
        raise ValueError("recommend_policy: cpu_flags= describes a CPU and does not apply to a CUDA plan "
                         f"(device={str(device)!r}); drop it, or plan for device='cpu'")
    requirements = []
    if n_params is not None:
        requirements.append(f"{_MASTER_REQUIREMENT}: {4 * n_params / 2**20:.0f} MiB besides the optimizer state "
                            "(keep them: updates smaller than half a low-precision ulp would be lost)")
    if dev.type == "cpu":
        return _low_memory(_recommend_cpu(flags, requirements), n_params, device_memory)
    if dev.type != "cuda":
        raise ValueError(f"recommend_policy: device type {dev.type!r} is not planned for; use 'cpu' or 'cuda' "
                         "(with capability=(major, minor) for a GPU you do not have)")
    if capability is None:
        if not torch.cuda.is_available():
            raise ValueError("recommend_policy: no CUDA device here; pass capability=(major, minor) to plan "
                             "for a GPU you do not have, e.g. capability=(8, 0) for an A100")
        capability = _check_capability(tuple(torch.cuda.get_device_capability(dev)))
        if device_memory is None:
            device_memory = torch.cuda.get_device_properties(dev).total_memory
    return _low_memory(_recommend_cuda(capability, n_params, stability, requirements), n_params, device_memory)


def _count(name: str, value, what: str, least: int) -> Optional[int]:
    """``value`` as an int of at least ``least``, or None; TypeError / ValueError naming it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"recommend_policy: {name} must be {what}, got {type(value).__name__} {value!r}")
    if not least <= value < 2 ** 63:  # a count of elements or bytes that any machine can hold
        raise ValueError(f"recommend_policy: {name} must be {what} below 2**63, got {value!r}")
    return int(value)


_MASTER_REQUIREMENT = "fp32 master weights"
_FP32_MASTER_BYTES = 14  # bf16 param + fp32 master + two fp32 Adam moments, per parameter
_LOW_MEMORY_BYTES = 6.1  # bf16 param + int16 low half + two 8-bit moments + block absmaxes


def _low_memory(rec: Recommendation, n_params, device_memory) -> Recommendation:
    """``rec`` turned to the low-memory setting where memory is the constraint: a bf16 plan
    whose fp32-master state would not fit ``device_memory`` while the low-memory state would."""
    if n_params is None or device_memory is None or rec.precision not in ("bf16", "fp8"):
        return rec
    need, low = _FP32_MASTER_BYTES * n_params, _LOW_MEMORY_BYTES * n_params
    if need <= device_memory or low > device_memory:
        return rec
    gib = 2**30
    return rec._replace(
        policy=get_policy("p=bf16,c=bf16,o=f32"),
        reason=(f"{rec.reason} Memory is the constraint: an fp32-master Adam state takes {need / gib:.1f} GiB "
                f"({_FP32_MASTER_BYTES} bytes per parameter) of the device's {device_memory / gib:.1f} GiB, so keep "
                f"the fp32 master split (the bf16 param is its high half, 2 bytes more, exact) and Adam's moments "
                f"in 8 bits: about {low / gib:.1f} GiB ({_LOW_MEMORY_BYTES} bytes per parameter)."),
        # The split master replaces the fp32 copy the generic requirement sized.
        requirements=[r for r in rec.requirements if not r.startswith(_MASTER_REQUIREMENT)] + [
            f"{_MASTER_REQUIREMENT}: kept split, {2 * n_params / 2**20:.0f} MiB of int16 low halves besides the "
            "bf16 params (exact fp32 masters)",
            "af.mixed_precision(af.adamw(lr, moments='q8'), ..., master='split') (or make_train_step / "
            "ModuleTrainer with master='split') on bf16 params; norm layers may stay fp32",
            "activations, gradients and temporaries need memory beyond this persistent state"],
        master="split", moments="q8")


def _recommend_cpu(flag_set, requirements) -> Recommendation:
    flags = cpu_bf16_flags() if flag_set is None else [f for f in _CPU_BF16_FLAGS if f in flag_set]
    cpu = f"this CPU ({platform.machine() or 'unknown'})"
    if flags:
        return Recommendation(
            get_policy("p=f32,c=bf16,o=f32"), NoOpLossScale(),
            f"{cpu[0].upper()}{cpu[1:]} executes bf16 natively ({', '.join(flags)}): bf16 compute halves "
            "activation memory and bandwidth, and bf16 keeps fp32's exponent range, so no loss scaling is needed.",
            requirements + ["norm layers' params in fp32 (cast_params(..., keep=af.norm_layers(model)))",
                            "torch CPU build with oneDNN (torch.backends.mkldnn.is_available())"],
            "bf16", "cpu")
    return Recommendation(
        get_policy("full"), NoOpLossScale(),
        f"{cpu[0].upper()}{cpu[1:]} has no native bf16 instructions (avx512_bf16, amx_bf16 or Arm bf16): "
        "bf16 and fp16 would be emulated and slower than fp32, so train in fp32.",
        requirements + ["for bf16 on CPU: a CPU with AVX512-BF16 (Cooper Lake, Zen 4+), AMX (Sapphire Rapids+) "
                        "or Arm BF16 (Neoverse V1+, Apple M2+)"],
        "fp32", "cpu")


def _fast_fp16(capability: tuple) -> bool:
    """Whether fp16 arithmetic runs at least at the fp32 rate: sm53 and sm62 (Tegra), sm60 (P100),
    and every part from sm70 (tensor cores). sm61 (GP10x consumer and Tesla P4/P40) runs fp16 at
    1/64 of its fp32 rate, and the other sm5x/sm3x parts have no fp16 arithmetic units."""
    return capability in ((5, 3), (6, 0), (6, 2)) or capability >= (7, 0)


def _recommend_cuda(capability, n_params, stability, requirements) -> Recommendation:
    major, minor = capability
    sm = f"sm{major}{minor}"
    fp8_hardware = capability >= (8, 9)
    # fp8 is advised only where the hardware runs it and this ampfunc trains in it: the fp8 branch
    # (ampfunc.fp8's policy and scaling recipe) returns here, before bf16, when fp8_candidate.
    fp8_candidate = (fp8_hardware and _fp8_available() and stability != "high"
                     and (n_params is None or n_params >= _FP8_MIN_PARAMS))
    if fp8_candidate:
        return Recommendation(
            get_policy("p=f32,c=bf16,o=f32"), NoOpLossScale(),
            f"{sm} runs fp8 matmuls at twice the bf16 rate: run the Linear layers as scaled fp8 matmuls "
            "(e4m3 forward, e5m2 gradients, delayed scaling; ampfunc.fp8) and everything else in bf16; "
            "no loss scaling is needed.",
            requirements + [f"CUDA capability >= 8.9 (this plan: {sm})",
                            "fp8 = af.fp8.fp8_policy(model, exclude=(<output head>,)); state8 = fp8.init('cuda'); "
                            "differentiate the state too (grad(loss_fn, argnums=(0, 1))) or "
                            "make_train_step(..., fp8=fp8)",
                            "Linear in/out features multiples of 16 (other shapes are padded)",
                            "compile the step (torch.compile): eager fp8 adds quantisation passes"],
            "fp8", "cuda", capability)
    if capability >= (8, 0):
        reqs = requirements + [f"CUDA capability >= 8.0 (this plan: {sm})",
                               "torch.cuda.is_bf16_supported() is True",
                               "norm layers in fp32 under torch.autocast (policy.autocast('cuda'))"]
        if fp8_hardware and not fp8_candidate:
            reqs.append(f"{sm} also runs fp8 matmuls; fp8 is not advised here ("
                        + ("this ampfunc has no ampfunc.fp8" if not _fp8_available() else
                           "stability='high'" if stability == "high" else
                           f"models under {_FP8_MIN_PARAMS // 10**6}M parameters gain little") + ")")
        return Recommendation(
            get_policy("p=f32,c=bf16,o=f32"), NoOpLossScale(),
            f"{sm} has bf16 tensor cores: bf16 compute runs at fp16 speed with fp32's exponent range, "
            "so gradients neither overflow nor flush to zero and no loss scaling is needed.",
            reqs, "bf16", "cuda", capability)
    if not _fast_fp16(capability):
        return Recommendation(
            get_policy("full"), NoOpLossScale(),
            f"{sm} has neither bf16 nor fast fp16 arithmetic (fast fp16 on sm53, sm60, sm62 and from sm70, "
            "tensor cores from sm70; sm61 runs fp16 at 1/64 of its fp32 rate): fp16 compute would run no "
            "faster than fp32 and need loss scaling, so train in fp32.",
            requirements + [f"for mixed precision: fast fp16 (sm53, sm60, sm62, or >= sm70), >= sm80 for bf16 "
                            f"(this plan: {sm})"],
            "fp32", "cuda", capability)
    hysteresis = 2 if stability == "high" else 1
    tensor_cores = capability >= (7, 0)
    return Recommendation(
        get_policy("p=f32,c=f16,o=f32"), DynamicLossScale(init_scale=2.0**16, hysteresis=hysteresis),
        f"{sm} has no bf16 {'tensor cores' if tensor_cores else 'arithmetic'}: fp16 compute "
        f"{'runs on its tensor cores' if tensor_cores else 'halves memory traffic'}, and dynamic loss "
        "scaling keeps small gradients from flushing to zero (fp16's smallest value is ~6e-8) while "
        "skipping the steps that overflow its 65504 ceiling.",
        requirements + [f"fast fp16: sm53, sm60, sm62 or >= sm70 (this plan: {sm}; tensor cores from 7.0)",
                        "dynamic loss scaling (DynamicLossScale) and fp32 master weights",
                        "watch the skip rate (af.TrainingMonitor): a few skipped steps are normal, many are not"],
        "fp16", "cuda", capability)
