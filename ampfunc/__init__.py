"""ampfunc: mixed-precision training as pure, composable transforms over PyTorch pytrees.

    import ampfunc as af
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3)),
                            loss_scale=af.DynamicLossScale())

The top level holds what a training loop calls; the in-place twins and the advanced pieces live
in submodules (``ampfunc.mixed``, ``ampfunc.optim``, ``ampfunc.functional``, ``ampfunc.tree``,
``ampfunc.flat``, ``ampfunc.monitor``, ...), each with its own ``__all__``.
"""

__version__ = "0.1.0"

from ampfunc import (
    checkpoint,
    compat,
    dist,
    flat,
    fp8,
    functional,
    mixed,
    monitor,
    ops,
    optim,
    tree,
)
from ampfunc.advisor import recommend_policy
from ampfunc.engine import MixedPrecisionState
from ampfunc.functional import TrainState, make_train_step, value_and_grad
from ampfunc.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from ampfunc.mixed import (
    loss_scale_of,
    master_params,
    mixed_precision,
    scale_loss,
    skip_or_apply,
    unscale_and_check,
    update_scale,
)
from ampfunc.monitor import TrainingMonitor
from ampfunc.optim import (
    accumulate,
    adam,
    adamw,
    add_decayed_weights,
    clip_by_global_norm,
    from_torch,
    sgd,
)
from ampfunc.policy import Policy, cast_params, get_policy, norm_layers, params_of
from ampfunc.stateful import ModuleTrainer
from ampfunc.transform import (
    GradientTransformation,
    apply_updates,
    chain,
    identity,
    masked,
    partition,
)

# An optimizer that ampfunc.optim picks up from a module of its own (ampfunc/optim/lion.py) is
# exported here under the module's name (af.lion); its state and building blocks stay in optim.
globals().update({_name: getattr(optim, _name) for _name in optim._picked_up_optimizers})

__all__ = [
    # the five primitives
    "cast_params", "scale_loss", "unscale_and_check", "skip_or_apply", "update_scale",
    # policies
    "Policy", "get_policy", "norm_layers", "params_of",
    # loss scales
    "DynamicLossScale", "StaticLossScale", "NoOpLossScale", "loss_scale_of",
    # transforms (optax's model)
    "GradientTransformation", "chain", "masked", "partition", "identity", "apply_updates",
    # optimizers and common transforms
    "sgd", "adam", "adamw", "from_torch", "clip_by_global_norm", "add_decayed_weights", "accumulate",
    # the mixed-precision step
    "mixed_precision", "MixedPrecisionState", "master_params",
    # one step path per style of loop: torch.func/compile, and a stateful nn.Module trainer
    "make_train_step", "TrainState", "value_and_grad", "ModuleTrainer",
    # monitoring and advice
    "TrainingMonitor", "recommend_policy",
    # submodules: in-place twins, advanced pieces, FP8, distributed, migration facades, kernels
    "mixed", "optim", "functional", "tree", "flat", "monitor", "fp8", "dist", "compat", "checkpoint", "ops",
]
__all__ += [_name for _name in optim._picked_up_optimizers if _name not in __all__]
