"""ampfunc: mixed-precision training as pure, composable transforms over PyTorch pytrees.

    import ampfunc as af
    tx = af.mixed_precision(af.chain(af.clip_by_global_norm(1.0), af.adamw(1e-3)),
                            loss_scale=af.DynamicLossScale())

See README.md for the user's loop and the fused fast path.
"""

__version__ = "0.1.0"

from ampfunc import ops, tree  # noqa: F401
from ampfunc.tree import all_finite, leaves_with_paths, select_tree, tree_cast, tree_map  # noqa: F401
from ampfunc.transform import (  # noqa: F401
    EmptyState,
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
from ampfunc.mixed import (  # noqa: F401
    MixedPrecision,
    MixedPrecisionState,
    agree_finite,
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
from ampfunc.monitor import StepStats, health, init_stats, nonfinite_leaves, record, skip_rate  # noqa: F401
# -- optimizers (ampfunc/optim/)
from ampfunc import optim  # noqa: F401
from ampfunc.optim import (  # noqa: F401
    AccumulateState,
    AdamState,
    FusedSpec,
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
# -- migration facades (ampfunc/compat/): torch.amp.GradScaler now, apex on first use
from ampfunc import compat  # noqa: F401,E402
# -- flat buffers and the fused step (ampfunc/flat.py, ampfunc/fused.py)
from ampfunc import flat, fused  # noqa: F401,E402
from ampfunc.flat import FlatTree, flatten  # noqa: F401,E402


def __getattr__(name):
    # ampfunc.dist imports torch.distributed.tensor (about half a second): load it on first use.
    if name == "dist":
        import importlib

        return importlib.import_module("ampfunc.dist")
    raise AttributeError(f"module 'ampfunc' has no attribute {name!r}")
