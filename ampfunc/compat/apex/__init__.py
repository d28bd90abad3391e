"""apex's removed mixed-precision modules, rebuilt on ampfunc: ``fp16_utils`` and ``amp``.

``from apex import amp`` becomes ``from ampfunc.compat.apex import amp``; ``from
apex.fp16_utils import FP16_Optimizer`` becomes ``from ampfunc.compat.apex.fp16_utils import
FP16_Optimizer``. Unlike apex, both work on CPU as well as on CUDA.

Importing this package registers the loss-scaler classes that the facades' checkpoints hold
(``FP16_Optimizer.state_dict()["loss_scaler"]``, ``fp16_utils.LossScaler`` /
``DynamicLossScaler``) with ``torch.serialization.add_safe_globals``, so a fresh process loads
such a checkpoint with ``torch.load`` (``weights_only=True``, torch's default) after
``import ampfunc.compat.apex``. Cost: a few tens of milliseconds of import.
"""

# Registers the checkpoint classes as torch.load safe globals (each module does so on import).
from ampfunc.compat.apex import _scaler as _scaler  # noqa: F401
from ampfunc.compat.apex import amp, checkpoint, fp16_utils
from ampfunc.compat.apex.fp16_utils import loss_scaler as _fp16_loss_scaler  # noqa: F401

__all__ = ["amp", "fp16_utils", "checkpoint"]

