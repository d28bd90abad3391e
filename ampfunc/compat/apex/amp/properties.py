"""amp's opt levels and the checked settings of one ``initialize`` call."""

from __future__ import annotations

import torch

__all__ = ["Properties", "OPT_LEVELS"]

OPT_LEVELS = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False, keep_batchnorm_fp32=False,
               master_weights=False, loss_scale=1.0),
}


class Properties:
    """The settings of one ``initialize`` call: the opt level's defaults with the user's overrides."""

    def __init__(self, enabled: bool = True, opt_level: str | None = None, **settings):
        self.enabled = enabled
        self.opt_level = opt_level
        self.cast_model_type = settings.get("cast_model_type")
        self.patch_torch_functions = settings.get("patch_torch_functions", False)
        self.keep_batchnorm_fp32 = settings.get("keep_batchnorm_fp32")
        self.master_weights = settings.get("master_weights")
        self.loss_scale = settings.get("loss_scale", 1.0)
        self.cast_model_outputs = settings.get("cast_model_outputs")

    def __repr__(self) -> str:
        return "Properties(" + ", ".join(f"{k}={v!r}" for k, v in vars(self).items()) + ")"


def _bool_setting(name: str, value):
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    raise ValueError(f"amp.initialize: {name} must be True, False, 'True', 'False' or None, got {value!r}")


def _properties(opt_level, overrides) -> Properties:
    if opt_level not in OPT_LEVELS:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3'.  Note that in "
            "`O0`, `O1`, etc., the prefix O is the letter O, not the number zero."
        )
    settings = dict(OPT_LEVELS[opt_level])
    for key, value in overrides.items():
        if value is None:
            continue
        if key in ("keep_batchnorm_fp32", "master_weights", "patch_torch_functions"):
            value = _bool_setting(key, value)
        elif key == "cast_model_type":
            if value is not False and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError("amp.initialize: cast_model_type must be a floating torch.dtype or False, "
                                 f"got {value!r}")
        elif key == "loss_scale":
            if value != "dynamic":
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    raise ValueError(f"amp.initialize: loss_scale must be 'dynamic' or a number, "
                                     f"got {value!r}") from None
                if not value > 0:
                    raise ValueError(f"amp.initialize: loss_scale must be > 0, got {value!r}")
        elif key == "cast_model_outputs":
            if not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"amp.initialize: cast_model_outputs must be a floating torch.dtype, got {value!r}")
        settings[key] = value
    if opt_level == "O1":
        if settings["cast_model_type"] not in (None, False):
            raise ValueError(
                "O1 inserts casts around Torch functions rather than model weights, so with O1, the model "
                "weights themselves should remain FP32. If you wish to cast the model to a different type, "
                "use opt_level='O2' or 'O3'. (got cast_model_type="
                f"{settings['cast_model_type']})")
        if settings["master_weights"]:
            raise ValueError("It doesn't make sense to use master_weights with O1. With O1, your model "
                             "weights themselves should be FP32.")
        if settings["keep_batchnorm_fp32"] is not None:
            raise ValueError("With opt_level O1, batchnorm functions are automatically patched to run in "
                             "FP32, so keep_batchnorm_fp32 should be None. (got keep_batchnorm_fp32="
                             f"{settings['keep_batchnorm_fp32']})")
    return Properties(True, opt_level, **settings)
