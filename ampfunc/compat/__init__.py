"""Migration facades: scripts written for ``torch.amp`` or NVIDIA apex run on ampfunc with an import change.

============================================  ===================================================
was                                           now
============================================  ===================================================
``torch.amp.GradScaler``                      ``ampfunc.compat.torch_amp.GradScaler``
``torch.autocast`` / ``torch.amp.autocast``   ``ampfunc.compat.torch_amp.autocast`` (+ ``policy=``)
``torch.amp.custom_fwd`` / ``custom_bwd``     ``ampfunc.compat.torch_amp.custom_fwd`` / ``custom_bwd``
``torch.optim.Adam`` / ``AdamW``              ``ampfunc.compat.torch_optim.Adam`` / ``AdamW`` (low-memory states)
``apex.fp16_utils``                           ``ampfunc.compat.apex.fp16_utils``
``apex.amp``                                  ``ampfunc.compat.apex.amp``
``torch.load`` of an apex checkpoint          ``ampfunc.compat.apex.checkpoint.load``
============================================  ===================================================

Every facade is a stateful shell over the pure core (:mod:`ampfunc.loss_scale`,
:mod:`ampfunc.mixed`, :mod:`ampfunc.policy`, :mod:`ampfunc.ops`): the facades hold loss-scale
pytrees and replace them each step; none re-implements the scale-update rule.
"""

from ampfunc.compat import apex, torch_amp, torch_optim
from ampfunc.compat.torch_amp import GradScaler, autocast, custom_bwd, custom_fwd

__all__ = ["GradScaler", "autocast", "custom_fwd", "custom_bwd", "torch_amp", "torch_optim", "apex"]
