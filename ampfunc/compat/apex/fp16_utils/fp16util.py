"""apex's manual master-parameter helpers and fp16 model conversion (``apex.fp16_utils.fp16util``).

Model conversion keeps the own params and buffers of affine BatchNorm modules in fp32 (apex's
rule: modules inside such a BatchNorm are cast) and is built on :func:`ampfunc.cast_params`:
the kept tensors are passed as ``keep=``. Master-param
copies use ``torch._foreach_copy_`` (one launch per dtype group rather than one per tensor).
Unlike apex, everything here works on CPU tensors too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ampfunc.policy import buffers_of, cast_floating, cast_params, params_of

__all__ = [
    "tofp16",
    "BN_convert_float",
    "network_to_half",
    "convert_module",
    "convert_network",
    "FP16Model",
    "prep_param_lists",
    "model_grads_to_master_grads",
    "master_params_to_model_params",
    "to_python_float",
    "clip_grad_norm",
]

_BatchNorm = nn.modules.batchnorm._BatchNorm


class tofp16(nn.Module):  # noqa: N801 - apex's name
    """A module whose forward is ``input.half()``."""

    def forward(self, input):
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802 - apex's name
    """Casts every affine BatchNorm module of ``module`` back to fp32, in place; returns ``module``."""
    for m in module.modules():
        if isinstance(m, _BatchNorm) and m.affine is True:
            m.float()
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """``nn.Sequential(tofp16(), BN_convert_float(network.half()))`` (apex's legacy helper; see :class:`FP16Model`)."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Casts the module's own (non-recursive) floating params, their grads and its buffers to ``dtype``."""
    for param in module.parameters(recurse=False):
        if param is not None and param.data.is_floating_point():
            param.data = param.data.to(dtype=dtype)
            if param._grad is not None and param._grad.data.is_floating_point():
                param._grad.data = param._grad.data.to(dtype=dtype)
    for buf in module.buffers(recurse=False):
        if buf is not None and buf.data.is_floating_point():
            buf.data = buf.data.to(dtype=dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Casts ``network`` to ``dtype`` in place, except affine BatchNorms' own tensors (apex's rule); returns it.

    As apex, only the affine BatchNorm module's own tensors stay as they are: modules inside it
    (a BatchNorm subclass holding a projection, say) are cast like any other, and so is a tensor
    a BatchNorm shares with another module. The casts are computed by :func:`ampfunc.cast_params`
    over the network's params and buffers with the kept tensors as ``keep``, then written back
    into the module (grads of cast params are cast too). RNN weights are re-flattened afterwards.

    Args:
      network: the module to convert, in place.
      dtype: the floating dtype to cast to (``torch.half`` for :class:`FP16Model`).

    Returns:
      ``network``.

    Example:
      >>> net = convert_network(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), torch.half)
      >>> net[0].weight.dtype, net[1].weight.dtype
      (torch.float16, torch.float32)

    Cost: one cast per tensor whose dtype changes; no host sync.
    """
    # apex: for each module of network.modules(), skip it if it is an affine BatchNorm, else
    # convert its own (non-recursive) tensors. So a tensor stays only if every module holding it
    # directly is an affine BatchNorm.
    bn_own, other_own = set(), set()
    for m in network.modules():
        own = {id(t) for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
        (bn_own if isinstance(m, _BatchNorm) and m.affine is True else other_own).update(own)
    kept_ids = bn_own - other_own
    tensors = {**{"p." + k: v for k, v in params_of(network).items()},
               **{"b." + k: v for k, v in buffers_of(network).items()}}
    params = dict(network.named_parameters())
    buffers = dict(network.named_buffers())
    kept = {"p." + k for k, t in params.items() if id(t) in kept_ids} | \
        {"b." + k for k, t in buffers.items() if id(t) in kept_ids}
    cast = cast_params(tensors, dtype, keep=lambda path, leaf: path in kept)
    for key, value in cast.items():
        kind, name = key[:1], key[2:]
        target = params[name] if kind == "p" else buffers[name]
        if value.dtype == target.dtype:
            continue
        target.data = value
        if kind == "p" and target._grad is not None and target._grad.is_floating_point():
            target._grad.data = target._grad.data.to(dtype)
    for m in network.modules():
        if isinstance(m, nn.RNNBase):
            m.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """``network`` converted to fp16 (affine BatchNorm kept fp32), with its floating inputs cast to fp16.

    The output is whatever the network returns in fp16. Unlike apex, integer inputs (token
    ids) pass through uncast (apex called ``.half()`` on every input).
    """

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs):
        return self.network(*cast_floating(inputs, torch.half))


def prep_param_lists(model: nn.Module, flat_master: bool = False):
    """``(model_params, master_params)``: the trainable params and fp32 copies of them.

    With ``flat_master=True`` the masters are one flat fp32 tensor (a one-element list, with a
    ``.grad`` allocated); every model param must then have the same dtype, else ``TypeError``
    naming the dtypes found, and there must be at least one, else ``ValueError`` (apex fails
    in ``torch.cat``).
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        if not model_params:
            raise ValueError(f"prep_param_lists(flat_master=True): the {type(model).__name__} has no trainable "
                             "parameters (requires_grad=True) to flatten into a master")
        dtypes = {p.dtype for p in model_params}
        if len(dtypes) > 1:
            named = {}
            for n, p in model.named_parameters():
                if p.requires_grad:
                    named.setdefault(p.dtype, n)
            raise TypeError(
                "prep_param_lists(flat_master=True): the model mixes parameter dtypes "
                f"({', '.join(f'{d} e.g. {n!r}' for d, n in named.items())}); use flat_master=False "
                "or FP16_Optimizer"
            )
        master = nn.Parameter(_flatten_dense_tensors([p.detach() for p in model_params]).float())
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    master_params = [p.detach().clone().float() for p in model_params]
    for p in master_params:
        p.requires_grad = True
    return model_params, master_params


@torch.no_grad()
def model_grads_to_master_grads(model_params, master_params, flat_master: bool = False) -> None:
    """Copies the model grads into the master grads (allocating them in fp32 when missing).

    A model param without a grad leaves its master's grad ``None`` (apex's rule), so the
    optimizer skips it. With ``flat_master=True`` there is one master grad and no param can be
    skipped, so a param without a grad raises ``ValueError`` naming its index in
    ``model_params`` (its position among the model's trainable params), shape and dtype, and
    nothing is written (apex fails inside ``torch.cat``). A zero grad is not filled in for it:
    momentum and weight decay would then move that param, unlike ``flat_master=False``.

    Args:
      model_params: the model params from :func:`prep_param_lists`.
      master_params: the masters from :func:`prep_param_lists` (one flat tensor with
        ``flat_master=True``).
      flat_master: whether the masters were made with ``flat_master=True``.

    Returns:
      None.

    Example:
      >>> model_params = [nn.Parameter(torch.ones(2, dtype=torch.float16))]
      >>> model_params[0].grad = torch.full((2,), 0.5, dtype=torch.float16)
      >>> master_params = [p.detach().float().requires_grad_() for p in model_params]
      >>> model_grads_to_master_grads(model_params, master_params)
      >>> master_params[0].grad
      tensor([0.5000, 0.5000])

    Cost: one copy of the grads (``_foreach_copy_``; flat: one concatenation and one copy); no
    host sync.
    """
    if flat_master:
        for i, p in enumerate(model_params):
            if p.grad is None:
                raise ValueError(
                    f"model_grads_to_master_grads(flat_master=True): model_params[{i}] (shape {tuple(p.shape)}, "
                    f"{p.dtype}) has no grad (unused in the forward, or its grad set to None); the flat master "
                    "cannot skip one param. Use flat_master=False (its master grad is then None and the "
                    "optimizer skips it, as apex does), or set its .grad to zeros if it should still be stepped "
                    "(momentum, weight decay); nothing was written")
        flat = _flatten_dense_tensors([p.grad for p in model_params])
        master = master_params[0]
        if master.grad is None:  # e.g. after the master optimizer's zero_grad(set_to_none=True)
            master.grad = torch.empty_like(master)
        master.grad.copy_(flat)
        return
    dst, src = [], []
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        dst.append(master.grad)
        src.append(model.grad)
    if dst:
        torch._foreach_copy_(dst, src)


@torch.no_grad()
def master_params_to_model_params(model_params, master_params, flat_master: bool = False) -> None:
    """Copies the (updated) master params into the model params, rounding to their dtype."""
    if flat_master:
        masters = _unflatten_dense_tensors(master_params[0].detach(), model_params)
    else:
        masters = [m.detach() for m in master_params]
    if model_params:
        torch._foreach_copy_([p.data for p in model_params], list(masters))


def to_python_float(t) -> float:
    """``t.item()`` for a tensor, ``t[0]`` for a sequence (apex's helper)."""
    if hasattr(t, "item"):
        return t.item()
    return t[0]


clip_grad_norm = torch.nn.utils.clip_grad_norm_
