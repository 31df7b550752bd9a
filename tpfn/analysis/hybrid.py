"""Dry runs that keep the values they can: parameters on meta, inputs and buffers real.

A model's forward often reads values that never depend on its weights: whether a padding
mask is all ones, whether a pad token ends the ids, where packed sequences start. On meta
tensors such a read fails. ``hybrid_copy(module)`` copies a module with every parameter on
meta (no memory, ties kept) and its buffers and tensor attributes real, on the CPU; under
``Hybrid()`` an op that meets a meta tensor runs on meta (its real arguments moved there), and
one on real tensors alone computes for real. So the ids, masks and positions a forward
derives from its inputs keep their values, and everything the weights touch is a shape (a
tensor of more than ``LARGEST`` elements made for a meta one, a long sequence's causal mask,
stays a shape too). Inputs that need a gradient are meta (autograd hands a gradient back on its input's device).
A real tensor a meta value is written into (``x[..., :d] = q``) is unknown from then on, and
counts as meta wherever it is read.

``Hybrid`` also runs ``_grouped_mm`` (transformers' fused experts) on meta in any float dtype:
its meta kernel checks the dtype a GPU kernel would need; and ``nonzero`` of a meta tensor (a
sparse mixture of experts' ``torch.where(top_k == e)`` on meta router scores) as if every
element were nonzero: each expert is routed every token its top-k could send it, a shape
(torch's ``meta_nonzero_assume_all_nonzero``).

>>> lin = hybrid_copy(nn.Linear(4, 8))
>>> lin.weight.is_meta
True
>>> with Hybrid():
...     y = lin(torch.ones(2, 4))
>>> y.shape, y.is_meta
(torch.Size([2, 8]), True)
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from tpfn._fqn import join
from tpfn._torch import TorchDispatchMode, buffers_of, grouped_mm_op, meta_like, nonzero_on_meta, parameters_of

__all__ = ["Hybrid", "hybrid_copy", "meta_copy", "real", "LARGEST"]

_GROUPED_MM = grouped_mm_op()


def meta_copy(module: nn.Module, *, values: bool = False, who: str = "explain") -> nn.Module:
    """A deep copy whose parameters, buffers and tensor attributes are meta tensors (ties kept);
    ``values``: its buffers and tensor attributes real, copied to the CPU (meta ones stay meta).
    ``who``: the caller, for the error a DTensor raises."""
    memo: dict = {}
    for fqn, sub in module.named_modules():
        for name, value in itertools.chain(parameters_of(sub).items(), buffers_of(sub).items(),
                                           vars(sub).items()):
            if not isinstance(value, torch.Tensor) or id(value) in memo:
                continue
            if isinstance(value, DTensor):
                raise ValueError(
                    f"{join(fqn, name)!r} is already a DTensor: {who} takes the module as it is "
                    "before parallelize (build it on the meta device if it is big).")
            if values and not isinstance(value, nn.Parameter) and not value.is_meta:
                memo[id(value)] = value.detach().to("cpu", copy=True)
                continue
            meta = torch.empty_like(value, device="meta")
            memo[id(value)] = nn.Parameter(meta, value.requires_grad) if isinstance(
                value, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def hybrid_copy(module: nn.Module, who: str = "suggest") -> nn.Module:
    """A deep copy whose parameters are meta tensors (ties kept) and whose buffers and tensor
    attributes are CPU copies (meta ones stay meta); ``who``: the caller, for errors."""
    return meta_copy(module, values=True, who=who)


def real(x):
    """``x`` (a tensor) as a dry run takes it: a CPU copy, or meta where it needs a gradient
    (or where it is meta: no values)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.requires_grad or x.is_meta:
        return torch.empty_like(x, device="meta").requires_grad_(x.requires_grad)
    return x.detach().to("cpu", copy=True)


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def _to_meta(x):
    if isinstance(x, DTensor):
        return x if x.is_meta else meta_like(x)
    if isinstance(x, torch.Tensor):
        return x if x.is_meta else x.to("meta")
    if isinstance(x, (tuple, list)):
        return type(x)(_to_meta(item) for item in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


# Ops whose values do not depend on their tensor argument's: made real where it is meta (a mask
# of ones shaped like the embeddings). Uninitialized ones stay meta: a forward fills them.
LARGEST = 1 << 22  # the most elements a tensor made on meta's behalf is made real with (4M)
_SHAPED = {"zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full"}


_RECURRENT = {"lstm", "gru", "rnn_tanh", "rnn_relu"}  # torch._VF's recurrent layers


def _shapes(x):
    """``x`` with every real tensor a meta one of its shape (``.to("meta")`` under ``Hybrid``
    keeps a tensor where it is)."""
    if isinstance(x, torch.Tensor):
        return x if x.is_meta else torch.empty_like(x, device="meta")
    if isinstance(x, (tuple, list)):
        return type(x)(_shapes(item) for item in x)
    return x


class _Whole(TorchFunctionMode):
    """An attention of meta queries, keys and values computes on meta throughout: the masks
    torch builds inside it (a causal one) hold no value of the model's; so does a recurrent
    layer (``nn.LSTM``) of a meta input, its initial state (zeros, made real) moved to meta."""

    def __init__(self, hybrid: "Hybrid"):
        super().__init__()
        self.hybrid = hybrid

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _RECURRENT and any(t.is_meta for t in _tensors(args)):
            return func(*_shapes(args), **kwargs)  # (its device check runs before any op: all on meta)
        if func is not F.scaled_dot_product_attention or not any(t.is_meta for t in _tensors(args)[:3]):
            return func(*args, **kwargs)
        values, self.hybrid.values = self.hybrid.values, False
        try:
            return func(*args, **kwargs)
        finally:
            self.hybrid.values = values


class Hybrid(TorchDispatchMode):
    """Ops that meet a meta tensor run on meta; the others compute (see the module docstring).
    ``values``: make new tensors real (True in a forward; the backward's own are meta)."""

    def __init__(self):
        super().__init__()
        self.values = True
        self.unknown: dict = {}  # storage pointer -> storage: real tensors a meta value was written into
        self.whole = _Whole(self)
        self.nonzero = nonzero_on_meta()

    def __enter__(self):
        self.nonzero.__enter__()
        self.whole.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            try:
                self.whole.__exit__(*exc)
            finally:
                self.nonzero.__exit__(*exc)

    def _meta(self, t: torch.Tensor) -> bool:
        if t.is_meta or isinstance(t, DTensor):  # (a DTensor's values are its local tensor's)
            return t.is_meta
        return t.untyped_storage().data_ptr() in self.unknown

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        found = _tensors(args) + _tensors(kwargs)
        meta = self.values and str(kwargs.get("device")) == "meta" or self.values and (
            name in _SHAPED and "device" not in kwargs and found and found[0].is_meta)
        if meta and (not found or name in _SHAPED):  # arange(n, device=x.device), x.new_ones(...)
            out = func(*args, **kwargs)
            if out.numel() > LARGEST:  # (a causal mask of long sequences: a shape, not values)
                return out
            out = func(*args, **{**kwargs, "device": torch.device("cpu")})
            return out.zero_() if "empty" in name else out
        if name == "_to_copy" and found and (found[0].is_meta or meta):  # .to(device): stays as it is
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        if any(map(self._meta, found)) and not all(t.is_meta for t in found):
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if first is not None and not first.is_meta and torch.Tag.inplace in func.tags:
                # a meta value written into a real tensor: what it holds is unknown from now on,
                # and it counts as meta wherever it is read
                self.unknown[first.untyped_storage().data_ptr()] = first.untyped_storage()
                return first
            args, kwargs = _to_meta(args), _to_meta(kwargs)
        if func is _GROUPED_MM and found and found[0].is_meta \
                and found[0].dtype != torch.bfloat16:
            dtype = found[0].dtype
            low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                   for a in args]
            return func(*low, **kwargs).to(dtype)
        return func(*args, **kwargs)
