"""ampfunc: mixed-precision training as pure, composable transforms over PyTorch pytrees.

    import ampfunc as af
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3)),
                            loss_scale=af.DynamicLossScale())

See README.md for the user's loop and the fused fast path.
"""

__version__ = "0.1.0"

from ampfunc import ops, tree  # noqa: F401
from ampfunc.tree import all_finite, leaves_with_paths, tree_cast, tree_map  # noqa: F401
from ampfunc.transform import (  # noqa: F401
    ChainSpec,
    EmptyState,
    FusedSpec,
    GradientTransformation,
    apply_updates,
    chain,
    identity,
    masked,
    named_chain,
    partition,
)
# -- loss scales and primitives (ampfunc/loss_scale.py, ampfunc/mixed.py)
from ampfunc.loss_scale import DynamicConfig, DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale  # noqa: F401
from ampfunc.dist import agree_finite  # noqa: F401
from ampfunc.engine import MixedPrecisionState  # noqa: F401
from ampfunc.mixed import (  # noqa: F401
    MixedPrecision,
    loss_scale_of,
    mixed_precision,
    scale_loss,
    skip_or_apply,
    unscale,
    skip_or_apply_,
    unscale_and_check,
    unscale_and_check_,
    update_scale,
    update_scale_,
)
# -- policies (ampfunc/policy.py)
from ampfunc import monitor, policy  # noqa: F401
from ampfunc.policy import (  # noqa: F401
    BATCH_NORM_TYPES,
    NORM_LAYER_TYPES,
    Policy,
    buffers_of,
    cast_floating,
    cast_params,
    get_policy,
    norm_layers,
    params_of,
)
from ampfunc.monitor import (  # noqa: F401
    MonitorConfig, StepStats, TrainingMonitor, health, init_stats, leaf_nonfinite, nonfinite_leaves, record, skip_rate,
)
from ampfunc import advisor  # noqa: F401,E402
from ampfunc.advisor import Recommendation, recommend_policy  # noqa: F401,E402
# -- optimizers (ampfunc/optim/)
from ampfunc import optim  # noqa: F401
from ampfunc.optim import (  # noqa: F401
    AccumulateState,
    AdamState,
    SgdState,
    TorchOptimizerState,
    accumulate,
    adam,
    adamw,
    add_decayed_weights,
    clip_by_global_norm,
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    from_torch,
    global_norm,
    linear_schedule,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
    sgd,
    warmup_cosine_decay_schedule,
)
# the optimizers added to ampfunc/optim/ as modules of their own (e.g. af.lion), as it exports them
globals().update({_n: getattr(optim, _n) for _n in optim.__all__ if _n not in globals()})
# -- the one mixed-precision step (ampfunc/engine.py)
from ampfunc import engine  # noqa: F401,E402
# -- torch.func / compile / distributed
from ampfunc.functional import (  # noqa: F401,E402
    StepOutput,
    TrainState,
    TrainStep,
    ValueAndGrad,
    apply_module,
    clip_per_example,
    copy_to_module,
    make_train_step,
    value_and_grad,
)
from ampfunc.stateful import ModuleTrainer, TrainerState  # noqa: F401,E402
# -- FP8 linear layers (ampfunc/fp8.py): af.fp8.fp8_policy, af.fp8.DelayedScaling, ...
from ampfunc import fp8  # noqa: F401,E402
# -- migration facades (ampfunc/compat/): torch.amp.GradScaler, and apex's checkpoint classes
# registered for torch.load(weights_only=True) (amp itself loads on first use)
from ampfunc import compat  # noqa: F401,E402
import ampfunc.compat.apex  # noqa: F401,E402
# -- flat buffers and the fused step (ampfunc/flat.py, ampfunc/fused.py)
from ampfunc import flat, fused  # noqa: F401,E402
# -- checkpoints with a format version and a checksum (ampfunc/checkpoint.py)
from ampfunc import checkpoint  # noqa: F401,E402
from ampfunc.flat import FlatTree, flatten  # noqa: F401,E402


# Names that went away, kept one release as aliases that warn: name -> (module, attribute, advice).
_DEPRECATED = {
    "select_tree": ("ampfunc.tree", "select_tree", "use ampfunc.skip_or_apply(finite, new, old)"),
}

__all__ = [
    # trees
    "tree", "tree_map", "tree_cast", "leaves_with_paths", "all_finite",
    # transforms (optax's model) and the kernel registry
    "GradientTransformation", "EmptyState", "FusedSpec", "ChainSpec", "identity", "chain", "named_chain",
    "masked", "partition", "apply_updates",
    # loss scales and the mixed-precision primitives
    "LossScale", "NoOpLossScale", "StaticLossScale", "DynamicLossScale", "DynamicConfig",
    "scale_loss", "unscale", "unscale_and_check", "unscale_and_check_", "skip_or_apply", "skip_or_apply_",
    "update_scale", "update_scale_", "agree_finite",
    # the whole step
    "engine", "MixedPrecision", "MixedPrecisionState", "mixed_precision", "loss_scale_of",
    # policies
    "policy", "Policy", "get_policy", "cast_params", "cast_floating", "norm_layers", "params_of", "buffers_of",
    "BATCH_NORM_TYPES", "NORM_LAYER_TYPES",
    # monitoring
    "monitor", "StepStats", "init_stats", "record", "skip_rate", "health", "nonfinite_leaves",
    "TrainingMonitor", "MonitorConfig", "leaf_nonfinite",
    # the precision advisor
    "advisor", "recommend_policy", "Recommendation",
    # optimizers and schedules
    "optim", "sgd", "SgdState", "adam", "adamw", "AdamState", "scale_by_adam", "from_torch", "TorchOptimizerState",
    "clip_by_global_norm", "global_norm", "accumulate", "AccumulateState", "add_decayed_weights", "scale",
    "scale_by_learning_rate", "scale_by_schedule", "constant_schedule", "linear_schedule", "cosine_decay_schedule",
    "warmup_cosine_decay_schedule", "exponential_decay",
    # torch.func, compile, modules
    "apply_module", "value_and_grad", "ValueAndGrad", "clip_per_example", "make_train_step", "TrainState",
    "StepOutput", "TrainStep", "copy_to_module", "ModuleTrainer", "TrainerState",
    # kernels, flat buffers, facades, distributed
    "ops", "flat", "fused", "FlatTree", "flatten", "compat", "dist", "fp8",
]
__all__ += [_n for _n in optim.__all__ if _n not in __all__]


def __getattr__(name):
    # ampfunc.dist imports torch.distributed (cheap) and, on first use, torch.distributed.tensor.
    if name == "dist":
        import importlib

        return importlib.import_module("ampfunc.dist")
    if name in _DEPRECATED:
        import importlib
        import warnings

        module, attr, advice = _DEPRECATED[name]
        warnings.warn(f"ampfunc.{name} is deprecated and will be removed in the next release: {advice}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'ampfunc' has no attribute {name!r}")
