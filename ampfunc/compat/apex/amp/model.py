"""What ``initialize`` does to models: casts, the patched ``forward``, the fp32 ``state_dict`` hook."""

from __future__ import annotations

import functools

import torch

from ampfunc.compat.apex.amp._state import _amp_state
from ampfunc.compat.apex.amp.properties import Properties
from ampfunc.policy import cast_floating

__all__ = ["check_models", "patch_forward", "register_fp32_state_dict"]


def _device_type(args, kwargs, model) -> str:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    for p in model.parameters():
        return p.device.type
    return "cpu"


def patch_forward(model: torch.nn.Module, props: Properties) -> None:
    """Wraps ``model.forward`` as apex's opt levels do: floating inputs cast to the model's
    type, the body under fp16 autocast when ``props.patch_torch_functions`` (O1), floating
    outputs cast to ``props.cast_model_outputs`` (fp32 by default)."""
    original = model.forward
    input_dtype = props.cast_model_type if props.cast_model_type else None
    output_dtype = props.cast_model_outputs or torch.float32
    autocast = props.patch_torch_functions

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if input_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), input_dtype)
        if autocast:
            with torch.autocast(_device_type(args, kwargs, model), dtype=torch.float16):
                out = original(*args, **kwargs)
        else:
            out = original(*args, **kwargs)
        return cast_floating(out, output_dtype)

    model.forward = forward


def check_models(models, what="models") -> list[torch.nn.Module]:
    """``models`` as a list, after apex's checks: each a bare ``nn.Module`` (not DDP- or
    DataParallel-wrapped) with fp32 floating params; errors name ``what[i]`` and the param."""
    for i, m in enumerate(models):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"amp.initialize: {what}[{i}] is a {type(m).__name__}, expected a torch.nn.Module")
        if isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            raise RuntimeError(f"amp.initialize: {what}[{i}] is wrapped in {type(m).__name__}; call "
                               "amp.initialize on the bare model and wrap it afterwards")
        if not _amp_state.allow_incoming_model_not_fp32:
            for name, p in m.named_parameters():
                if p.is_floating_point() and p.dtype != torch.float32:
                    raise TypeError(
                        f"Found param {name} of {what}[{i}] with dtype {p.dtype}, expected torch.float32. "
                        "When using amp.initialize, you do not need to call .half() on your model before "
                        "passing it, no matter what optimization level you choose.")
    return list(models)


def _fp32_state_dict_hook(module, state_dict, prefix, local_metadata):
    # apex registers this on every module after casting the model: checkpoints hold fp32
    # weights, loadable into an fp32 model (and back into this one, which casts on load).
    for key, value in state_dict.items():
        if (key.startswith(prefix) and isinstance(value, torch.Tensor)
                and value.dtype in (torch.float16, torch.bfloat16)):
            state_dict[key] = value.to(torch.float32)


def register_fp32_state_dict(model: torch.nn.Module) -> None:
    """Makes ``model.state_dict()`` return fp32 tensors where the cast model holds fp16/bf16
    ones (apex's O2/O3 hook)."""
    for module in model.modules():
        module._register_state_dict_hook(_fp32_state_dict_hook)
