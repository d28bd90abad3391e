"""``apex.fp16_utils`` on ampfunc: ``FP16_Optimizer``, ``LossScaler``, ``DynamicLossScaler`` and
the manual master-parameter helpers. Same names, arguments and checkpoint keys as apex;
works on CPU as well as CUDA."""

from ampfunc.compat.apex.fp16_utils.fp16_optimizer import FP16_Optimizer
from ampfunc.compat.apex.fp16_utils.fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from ampfunc.compat.apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

__all__ = [
    "FP16_Optimizer",
    "LossScaler",
    "DynamicLossScaler",
    "BN_convert_float",
    "network_to_half",
    "prep_param_lists",
    "model_grads_to_master_grads",
    "master_params_to_model_params",
    "tofp16",
    "to_python_float",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "FP16Model",
]
