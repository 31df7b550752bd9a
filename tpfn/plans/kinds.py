"""The table: what each built-in core means for each module kind, one row each.

A row is a function of the core (``colwise(parts=2)``'s ``Core``), the module and the parameters the
style governs; it returns a ``Meaning``: the built-in written as a composition of primitives
(``params(...) >> on_shards(...)``), whether the module computes on local shards (its forward is the
kind's own) or on DTensors in the same layouts, and what the primitives cannot say (a bias added
once to partial sums; a forward on local shards where the module's own alone does not give one
device's numbers: a vocabulary's mask, dropout's slice of one device's noise, a random stream of
each rank's, attention on each rank's heads, whose own forward reads the global ``num_heads``).
Built-ins and ``on_shards`` styles then take one path (``tpfn.plans.mount``).

>>> import torch.nn as nn
>>> from tpfn.style.constructors import colwise
>>> meaning(colwise().core, nn.Linear(4, 8), "'w1' (Linear)", ("weight", "bias")).style
replicate() >> params(bias=Shard(dim=0), weight=Shard(dim=0)) >> on_shards(Replicate(), grads=Partial(), output=Shard(dim=-1))
>>> meaning(colwise().core, nn.Conv2d(8, 8, 3, groups=8), "'dw' (Conv2d)", ("weight", "bias")).style
params(bias=Shard(dim=0), weight=Shard(dim=0)) >> on_shards(Shard(dim=1), output=Shard(dim=1)) >> per_rank('groups')
"""

from __future__ import annotations

import contextlib
import functools

import attrs
import torch
import torch.nn as nn
import torch.nn.functional as F

from tpfn._torch import MIXING, DropoutNd, assert_async, parameter
from tpfn._torch import per_rank as per_rank_value
from tpfn.algebra import chunk_bounds
from tpfn.layout import Partial, Replicate, Shard
from tpfn.rng import sharded
from tpfn.style.constructors import on_shards, params, per_rank, prepare_out, replicate
from tpfn.style.style import Style

__all__ = ["Meaning", "TABLE", "meaning", "Conv1D", "own_stream", "vocab_parallel", "dropout_slice",
           "attention_on_heads", "batched"]


@attrs.frozen
class Meaning:
    """A built-in on one module: ``style``, the composition of primitives it is; ``local``: the
    module computes on local shards (else on DTensors in the same layouts); and what the
    primitives cannot say: ``bias_once``, a replicated bias (``True``: ``"bias"``, or its name)
    added once to partial sums; ``forward(call, *inputs)``, the computation on local shards where
    the module's own forward alone does not give it (``call.own(*inputs)`` runs that one;
    ``tpfn.interpret.reference.Call``): a vocabulary's mask, dropout's slice of one device's noise,
    a random stream of each rank's, attention on each rank's heads; ``shape(module, in_shape)``,
    the global shape of the output from input 0's (None: kept where the output is laid out as
    input 0, else recalled); ``fits(module, n)``, why ``n`` ranks cannot hold it (None: they can);
    ``fast``, the name of a fast kernel (``tpfn.kernels``) that may compute it (None: none)."""

    style: Style
    local: bool = True
    bias_once: bool | str = False
    forward: object = None
    shape: object = None
    fits: object = None
    fast: str | None = None

    @property
    def once(self) -> str | None:
        """The name of the replicated bias added once to partial sums (None: none)."""
        return "bias" if self.bias_once is True else self.bias_once or None


def own_stream(call, *inputs, **kwargs):
    """The module's own forward, drawing from a random stream of the rank's own (``tpfn.rng``): in
    training from a seed drawn, so that every call draws anew; in eval mode keyed by the module,
    the default stream left as one device's."""
    rt = call.rt
    with sharded(rt.mesh, None if rt.module.training else rt.stream):
        return call.own(*inputs, **kwargs)


def vocab_parallel(call, ids, *inputs, **kwargs):
    """An embedding on the rank's slice of the vocabulary, as DTensor computes it: the ids outside
    it looked up as row 0 and their rows zeroed; an id outside the whole vocabulary raises on
    every rank, as on one device."""
    module, mesh = call.rt.module, call.rt.mesh
    n = module.num_embeddings
    assert_async(((ids >= 0) & (ids < n)).all(), f"input 0 of {call.rt.mount.where}: an id lies outside "
                 f"the vocabulary [0, {n}) (index out of range in self)")
    local, mask = _vocab_slice(ids, n, mesh.size(), mesh.get_coordinate()[0])
    return call.own(local, *inputs, **kwargs).masked_fill(mask.unsqueeze(-1), 0)


@per_rank_value  # LocalTensorMode: each simulated rank its own slice
def _vocab_slice(ids: torch.Tensor, n: int, k: int, rank: int):
    offset, size = chunk_bounds(n, k, rank)
    mask = (ids < offset) | (ids >= offset + size)
    return (ids - offset).masked_fill(mask, 0), mask


def dropout_slice(call, x):
    """``nn.Dropout`` on shards: the rank's slice of the noise one device draws for the whole
    tensor (the same draws from the default generator, in the order of the tensor's memory, so
    the ranks stay in step), applied in place where the module is."""
    module, mesh = call.rt.module, call.rt.mesh
    if not (module.training and module.p > 0):
        return x
    shape, dim = call.shape(exact=True), call.rt.mount.shards.output.dim % x.ndim
    # one device draws in the order of memory: outermost first, a dim of one inside a larger one of its stride
    order = sorted(range(x.ndim), key=lambda d: (-x.stride(d), x.shape[d] == 1, d))
    whole = torch.ones([shape[d] for d in order], dtype=x.dtype, device=x.device).permute(
        [order.index(d) for d in range(x.ndim)])
    noise = _noise_slice(F.dropout(whole, module.p, training=True), dim, x.shape[dim], mesh.size(),
                         mesh.get_coordinate()[0])
    return x.mul_(noise) if module.inplace else x * noise


@per_rank_value  # LocalTensorMode: each simulated rank its own slice
def _noise_slice(noise: torch.Tensor, dim: int, size: int, k: int, rank: int) -> torch.Tensor:
    start, _ = chunk_bounds(noise.shape[dim], k, rank)
    return noise.narrow(dim, start, size).clone()  # frees the rest of the noise


class _Named(type):
    """A module kind known by its qualified name: ``isinstance`` holds for its subclasses, and
    nothing is imported (``Conv1D``: transformers is no dependency of tpfn)."""

    def __instancecheck__(cls, module) -> bool:
        return cls.real(type(module)) is not None

    def real(cls, kind: type):
        """The class of that name among ``kind``'s bases (None: none)."""
        return next((c for c in kind.__mro__ if f"{c.__module__}.{c.__qualname__}" == cls.qualname), None)


class Conv1D(metaclass=_Named):
    """transformers' ``Conv1D`` (GPT-2's projections): a linear layer whose ``weight`` is stored
    transposed, ``(in, out)``, its output features ``nf``.

    >>> isinstance(nn.Linear(2, 2), Conv1D), Conv1D.label
    (False, "transformers' Conv1D")
    """

    qualname, label = "transformers.pytorch_utils.Conv1D", "transformers' Conv1D"


def _own_forward(module: nn.Module, kind: type) -> bool:
    kind = kind.real(type(module)) if isinstance(kind, _Named) else kind
    return type(module).forward is kind.forward


def _linear(module: nn.Linear) -> str | None:
    """The fast kernel of an ``nn.Linear`` that computes with its own forward (``tpfn.kernels.linear``)."""
    return "linear" if _own_forward(module, nn.Linear) and "forward" not in vars(module) else None


def _linear_shape(module, in_shape):
    return (*in_shape[:-1], module.out_features)


def _conv1d_shape(module, in_shape):
    return (*in_shape[:-1], module.nf)


def _embedding_shape(module, in_shape):
    return (*in_shape, module.embedding_dim)


def _no_renorm(core, module: nn.Embedding, where: str):
    if module.max_norm is None and not module.sparse:
        return None
    option, why = (("max_norm", "renormalizes whole rows in place") if module.max_norm is not None
                   else ("sparse", "makes sparse gradients, which DTensor cannot hold"))
    return (f"{core!r} at {where}: nn.Embedding({option}=...) {why}, so it cannot be "
            f"sharded; leave it out of the plan (replicated) or build it without {option}.")


@functools.lru_cache(maxsize=None)
def _primitives(row: str, k, bias: bool, heads=None) -> Style:
    """The composition of primitives a built-in is on a kind (``bias``: the module has one;
    ``heads``: the output features are that many heads, each replicated over its group of
    ranks when there are more ranks than heads, its gradient partial within the group)."""
    if row in ("colwise_linear", "colwise_conv1d"):  # Conv1D's weight is (in, out): dim 1
        rules = {"weight": Shard(0 if row == "colwise_linear" else 1, k, heads=heads),
                 **({"bias": Shard(0, k, heads=heads)} if bias else {})}
        grads = dict.fromkeys(rules, Partial()) if heads is not None else None
        return replicate() >> params(**rules) >> on_shards(
            Replicate(), grads=Partial(), output=Shard(-1, k, heads=heads), param_grads=grads)
    if row in ("rowwise_linear", "rowwise_conv1d"):
        rules = {"weight": Shard(1 if row == "rowwise_linear" else 0, k), **({"bias": Replicate()} if bias else {})}
        return (replicate() >> params(**rules) >> on_shards(Shard(-1, k), output=Partial())
                >> prepare_out(Replicate()))
    if row == "colwise_embedding":
        return replicate() >> params(weight=Shard(1, k)) >> on_shards(
            Replicate(), grads=(None,), output=Shard(-1, k))
    return (replicate() >> params(weight=Shard(0, k))
            >> on_shards(Replicate(), grads=(None,), output=Partial()) >> prepare_out(Replicate()))


def _no_heads(core, module, where: str):
    if core.heads is None:
        return None
    return (f"{core!r} at {where}: heads= replicates the key and value heads of a linear "
            f"projection; {type(module).__name__} has no heads: use colwise().")


def colwise_linear(core, module: nn.Linear, where: str, owned: tuple):
    return Meaning(_primitives("colwise_linear", core.parts, module.bias is not None, core.heads),
                   local=_own_forward(module, nn.Linear), shape=_linear_shape, fast=_linear(module))


def rowwise_linear(core, module: nn.Linear, where: str, owned: tuple):
    return Meaning(_primitives("rowwise_linear", core.parts, module.bias is not None),
                   local=_own_forward(module, nn.Linear), bias_once=module.bias is not None,
                   shape=_linear_shape, fast=_linear(module))


def colwise_conv1d(core, module, where: str, owned: tuple):
    """transformers' ``Conv1D`` column-wise: its weight ``(in, out)`` sharded on dim 1, its own
    forward on the local shards with ``nf`` the rank's output features (``per_rank("nf")``)."""
    own = _own_forward(module, Conv1D)
    style = _primitives("colwise_conv1d", core.parts, module.bias is not None, core.heads)
    return Meaning(style >> per_rank("nf", heads=core.heads) if own else style, local=own, shape=_conv1d_shape)


def rowwise_conv1d(core, module, where: str, owned: tuple):
    return Meaning(_primitives("rowwise_conv1d", core.parts, module.bias is not None),
                   local=_own_forward(module, Conv1D), bias_once=module.bias is not None, shape=_conv1d_shape)


def colwise_embedding(core, module: nn.Embedding, where: str, owned: tuple):
    return _no_heads(core, module, where) or _no_renorm(core, module, where) or Meaning(
        _primitives("colwise_embedding", core.parts, False),
        local=_own_forward(module, nn.Embedding), shape=_embedding_shape)


def rowwise_embedding(core, module: nn.Embedding, where: str, owned: tuple):
    # DTensor masks padding_idx and counts scale_grad_by_freq over the whole vocabulary.
    plain = module.padding_idx is None and not module.scale_grad_by_freq
    if core.parts != 1:  # each rank masks the ids outside one contiguous slice of the vocabulary
        return f"{core!r} at {where}: the vocabulary of an nn.Embedding is no packed parts; use rowwise()."
    local = plain and _own_forward(module, nn.Embedding)
    return _no_renorm(core, module, where) or Meaning(
        _primitives("rowwise_embedding", core.parts, False), local=local,
        forward=vocab_parallel if local else None, shape=_embedding_shape)


def sequence_parallel_any(core, module: nn.Module, where: str, owned: tuple):
    if isinstance(module, MIXING) or (
            isinstance(module, nn.LayerNorm) and len(module.normalized_shape) > 1):
        return (f"{core!r} at {where}: sequence parallelism runs a module on each position alone, but "
                f"{type(module).__name__} combines positions (batch statistics, groups or windows), so a "
                "shard of the sequence gives other numbers; leave it out of the plan and hand it the whole "
                "sequence (prepare_in(Shard(1), desired=Replicate()) on it, or end the sequence-parallel "
                "region before it).")
    big = [n for n in owned if parameter(module, n).dim() > 1]
    if big:
        return (f"{core!r} at {where}: sequence parallelism runs a module on each position alone, "
                f"so its parameters must be 1-D (norms, dropout), but {', '.join(big)} "
                "is not; shard it with colwise() or rowwise().")
    seq = Shard(core.dim)
    forward = (dropout_slice if _own_forward(module, nn.Dropout)
               else own_stream if isinstance(module, DropoutNd) else None)
    return Meaning(params(**dict.fromkeys(owned, Replicate()))
                   >> on_shards(seq, output=seq, param_grads=dict.fromkeys(owned, Partial())), forward=forward)


def _attention_refusal(core, module: nn.MultiheadAttention, owned: tuple) -> str | None:
    if not _own_forward(module, nn.MultiheadAttention):
        return (f"{type(module).__name__} overrides nn.MultiheadAttention.forward, and colwise() "
                "computes nn.MultiheadAttention's own on each rank's heads; shard it with "
                "params(...) >> on_shards(...) for its forward, or leave it out of the plan.")
    if core.parts != 1 or core.heads is not None:
        return ("nn.MultiheadAttention packs its q, k and v in in_proj_weight and colwise() "
                "shards them by heads itself; use colwise().")
    if module.kdim != module.embed_dim or module.vdim != module.embed_dim:
        return (f"nn.MultiheadAttention(kdim={module.kdim}, vdim={module.vdim}) keeps q, k and v "
                f"in separate weights (q_proj_weight, k_proj_weight, v_proj_weight), which "
                f"colwise() does not shard; build it with kdim = vdim = embed_dim "
                f"({module.embed_dim}), or leave it out of the plan.")
    options = [o for o, on in (("add_bias_kv", module.bias_k is not None),
                               ("add_zero_attn", module.add_zero_attn)) if on]
    if options:
        return (f"nn.MultiheadAttention({options[0]}=True) appends a key and value to every "
                f"sequence, which colwise() does not compute on shards; build it without "
                f"{options[0]}, or leave it out of the plan.")
    if "out_proj.weight" not in owned:
        return ("its out_proj is bound to a style of its own, but nn.MultiheadAttention.forward "
                "reads out_proj's parameters itself (it never calls out_proj); leave out_proj "
                "out of the plan: colwise() on the attention shards it.")
    return None


def _attention_fits(module: nn.MultiheadAttention, n: int) -> str | None:
    if module.num_heads % n == 0:
        return None
    return (f"its {module.num_heads} heads do not split evenly over {n} ranks, and each rank "
            f"computes whole heads; choose a mesh size that divides {module.num_heads}.")


def _additive(mask: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask (True: not attended) as the float one softmax adds."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def _head_mask(mask, key_padding_mask, q, module, mesh, where: str):
    """``attn_mask`` and ``key_padding_mask`` as one additive mask over this rank's heads,
    (batch, heads, target, source) or broadcast to it (None: none)."""
    batch, heads, target = q.shape[:3]
    if mask is not None:
        mask = _additive(mask, q.dtype)
        if mask.dim() == 3 and mask.shape[0] == batch * module.num_heads:  # per head: ours
            first = mesh.get_coordinate()[0] * heads
            mask = mask.unflatten(0, (batch, module.num_heads))[:, first:first + heads]
        elif mask.dim() != 2:
            raise ValueError(f"{where} got attn_mask of shape {tuple(mask.shape)}; sharded by heads it "
                             f"takes one mask for every head, (target, source), or one per head, (batch * "
                             f"num_heads, target, source) = ({batch * module.num_heads}, {target}, source).")
    if key_padding_mask is not None:
        pad = _additive(key_padding_mask, q.dtype).reshape(batch, 1, 1, -1)
        mask = pad if mask is None else mask + pad
    return mask


def attention_on_heads(call, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                       average_attn_weights=True, is_causal=False):
    """``nn.MultiheadAttention.forward`` on this rank's heads: the local ``in_proj_weight``
    (its slice of q, k and v, whole heads), scaled dot-product attention per head (its dropout
    on a random stream of the rank's own), and the local columns of ``out_proj``, which leave a
    partial sum (its bias added once)."""
    module, mesh, where = call.rt.module, call.rt.mesh, call.rt.mount.where
    if need_weights:
        raise ValueError(f"{where} computes on each rank's heads (colwise()), so need_weights=True would "
                         "return attention weights averaged over one rank's heads; call it with "
                         "need_weights=False (nn.TransformerEncoderLayer does), or leave it out of the plan.")
    if is_causal and attn_mask is None:
        raise RuntimeError(f"{where}: is_causal=True needs attn_mask too, as "
                           "nn.MultiheadAttention does (the causal mask, a hint).")
    batched = query.dim() == 3

    def batch_first(x):  # (batch, sequence, features)
        return x if batched and module.batch_first else x.transpose(0, 1) if batched else x[None]

    w, b = module.in_proj_weight, module.in_proj_bias
    if key is query and value is query:  # self-attention: one projection of the input
        q, k, v = F.linear(batch_first(query), w, b).chunk(3, dim=-1)
    else:
        bs = (None,) * 3 if b is None else b.chunk(3)
        q, k, v = (F.linear(batch_first(x), wx, bx)
                   for x, wx, bx in zip((query, key, value), w.chunk(3), bs))
    q, k, v = (x.unflatten(-1, (-1, module.head_dim)).transpose(1, 2) for x in (q, k, v))
    causal = is_causal and key_padding_mask is None
    mask = None if causal else _head_mask(attn_mask, key_padding_mask, q, module, mesh, where)
    dropout = module.dropout if module.training else 0.0
    with sharded(mesh) if dropout else contextlib.nullcontext():
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout)
    y = F.linear(y.transpose(1, 2).flatten(2), module.out_proj.weight, module.out_proj.bias)
    return (y if module.batch_first else y.transpose(0, 1)) if batched else y[0], None


def colwise_attention(core, module: nn.MultiheadAttention, where: str, owned: tuple):
    """Megatron's attention in one module: q, k and v column-wise by heads (each a third of
    ``in_proj_weight``), ``out_proj`` row-wise, its partial sums all-reduced once."""
    why = _attention_refusal(core, module, owned)
    if why is not None:
        return f"{core!r} at {where}: {why}"
    qkv, bias = Shard(0, parts=3), module.in_proj_bias is not None
    rules = {"in_proj_weight": qkv, "out_proj.weight": Shard(1),
             **({"in_proj_bias": qkv, "out_proj.bias": Replicate()} if bias else {})}
    return Meaning(params(**rules) >> on_shards(Replicate(), Replicate(), Replicate(), grads=Partial())
                   >> prepare_out(Replicate(), given=Partial()),
                   bias_once="out_proj.bias" if bias else False, forward=attention_on_heads, fits=_attention_fits)


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _conv_kind(module) -> type:
    return next(k for k in (*_CONVS, *_TRANSPOSED) if isinstance(module, k))


def _conv_shape(module, in_shape):
    """A convolution's output shape from its input's: the output channels and each spatial size,
    as ``torch.nn.functional.conv*d`` computes them (None for a transposed one, whose forward may
    be given its ``output_size``: recalled from the ranks' shards)."""
    if module.transposed:
        return None
    k = len(module.kernel_size)
    lead, spatial = tuple(in_shape[:-k - 1]), tuple(in_shape[-k:])
    pad = module.padding
    if isinstance(pad, str):  # 'valid', or 'same': the input's size (stride 1)
        return (*lead, module.out_channels, *(spatial if pad == "same" else (
            s - d * (w - 1) for s, d, w in zip(spatial, module.dilation, module.kernel_size))))
    sizes = ((s + 2 * p - d * (w - 1) - 1) // st + 1 for s, st, p, d, w in zip(
        spatial, module.stride, pad, module.dilation, module.kernel_size))
    return (*lead, module.out_channels, *sizes)


def _groups_fit(module, n: int) -> str | None:
    groups = module.groups if isinstance(module, (*_CONVS, *_TRANSPOSED)) else module.num_groups
    if groups % n == 0:
        return None
    return (f"its {groups} groups do not split evenly over {n} ranks, and each rank computes whole "
            f"groups of channels; choose a mesh size that divides {groups}, or leave it out of the "
            "plan (replicated).")


def _no_parts(core, module, where: str):
    if core.parts == 1 and core.heads is None:
        return None
    option = f"parts={core.parts!r}" if core.parts != 1 else f"heads={core.heads!r}"
    return (f"{core!r} at {where}: {option} packs parts or heads of a linear projection's output "
            f"features; {type(module).__name__} shards its channels whole: use {core.kind}().")


@functools.lru_cache(maxsize=None)
def _conv_primitives(row: str, transposed: bool, bias: bool) -> Style:
    """A convolution's channels as a composition of primitives: its weight is ``(out, in / groups,
    *kernel)`` (transposed: ``(in, out / groups, *kernel)``) and its channels are dim 1 of its
    input and output. ``colwise``: the output channels, from a replicated input; ``rowwise``: the
    input channels, leaving partial sums; ``groups``: a grouped convolution's groups, whole on
    each rank, channels in and out."""
    out, into = (1, 0) if transposed else (0, 1)
    if row == "colwise":
        return replicate() >> params(weight=Shard(out), **({"bias": Shard(0)} if bias else {})) >> on_shards(
            Replicate(), grads=Partial(), output=Shard(1))
    if row == "rowwise":
        return (replicate() >> params(weight=Shard(into), **({"bias": Replicate()} if bias else {}))
                >> on_shards(Shard(1), output=Partial()) >> prepare_out(Replicate()))
    return (params(weight=Shard(0), **({"bias": Shard(0)} if bias else {}))
            >> on_shards(Shard(1), output=Shard(1)) >> per_rank("groups"))


def batched(call, x, *inputs, **kwargs):
    """A convolution's own forward on its channels, dim 1 of a batch: an unbatched input (its
    channels in dim 0, which the plan's ``Shard(1)`` would take for a spatial dim) is refused by
    name."""
    module = call.rt.module
    if isinstance(x, torch.Tensor) and x.dim() == len(module.kernel_size) + 1:
        raise ValueError(f"{call.rt.mount.where} got an unbatched input of shape {tuple(x.shape)}, its channels "
                         f"in dim 0, but {call.rt.mount.style!r} lays out channels in dim 1; give it a batch "
                         "of one (x.unsqueeze(0)).")
    return call.own(x, *inputs, **kwargs)


def colwise_conv(core, module, where: str, owned: tuple):
    """A convolution column-wise: its output channels (``Shard(1)`` out) from a replicated input;
    a grouped or depthwise one (``groups > 1``) on its groups: channels sharded in and out, each
    rank its ``groups / n`` whole groups (``per_rank("groups")``)."""
    kind = _conv_kind(module)
    grouped = module.groups > 1
    local = _own_forward(module, kind)
    return _no_parts(core, module, where) or Meaning(
        _conv_primitives("groups" if grouped else "colwise", module.transposed, module.bias is not None),
        local=local, forward=batched if local else None, shape=_conv_shape,
        fits=_groups_fit if grouped else None)


def rowwise_conv(core, module, where: str, owned: tuple):
    """A convolution row-wise: its input channels (``Shard(1)`` in), its partial sums all-reduced,
    the bias added once."""
    kind = _conv_kind(module)
    if module.groups > 1:
        return (f"{core!r} at {where}: {type(module).__name__}(groups={module.groups}) computes each group "
                "from its own input channels, so it shards whole groups, channels in and out: use colwise().")
    local = _own_forward(module, kind)
    return _no_parts(core, module, where) or Meaning(
        _conv_primitives("rowwise", module.transposed, module.bias is not None), local=local,
        forward=batched if local else None, bias_once=module.bias is not None, shape=_conv_shape)


def colwise_channels(core, module, where: str, owned: tuple):
    """A norm on channels (``nn.BatchNorm1d/2d/3d``, ``nn.GroupNorm``) on each rank's channels,
    dim 1 sharded in and out: its weight, bias and running statistics sharded on dim 0; a
    GroupNorm's groups whole on each rank (``per_rank("num_groups")``)."""
    why = _no_parts(core, module, where)
    if why:
        return why
    names = [n for n in ("weight", "bias", "running_mean", "running_var") if getattr(module, n, None) is not None]
    group = isinstance(module, nn.GroupNorm)
    style = params(**dict.fromkeys(names, Shard(0))) >> on_shards(Shard(1), output=Shard(1))
    kind = nn.GroupNorm if group else next(k for k in _BATCH_NORMS if isinstance(module, k))
    return Meaning(style >> per_rank("num_groups") if group else style, local=_own_forward(module, kind),
                   fits=_groups_fit if group else None)


def rowwise_channels(core, module, where: str, owned: tuple):
    return (f"{core!r} at {where}: {type(module).__name__} normalizes each channel (or group of channels) on "
            "its own, so it computes on a rank's channels as they come: use colwise(), which shards its "
            "channels, between a column-wise and a row-wise convolution.")


# (built-in, module kind) -> its row; the first kind the module is an instance of applies.
TABLE = {
    "colwise": ((nn.Linear, colwise_linear), (nn.Embedding, colwise_embedding),
                (nn.MultiheadAttention, colwise_attention), (Conv1D, colwise_conv1d),
                *((k, colwise_conv) for k in (*_CONVS, *_TRANSPOSED)),
                *((k, colwise_channels) for k in (*_BATCH_NORMS, nn.GroupNorm))),
    "rowwise": ((nn.Linear, rowwise_linear), (nn.Embedding, rowwise_embedding), (Conv1D, rowwise_conv1d),
                *((k, rowwise_conv) for k in (*_CONVS, *_TRANSPOSED)),
                *((k, rowwise_channels) for k in (*_BATCH_NORMS, nn.GroupNorm))),
    "sequence_parallel": ((nn.Module, sequence_parallel_any),),
}


def _label(kind: type) -> str:
    """How a refusal names a module kind of the table (a family of 1-, 2- and 3-D kinds as one)."""
    family = next((f for f in (_CONVS, _TRANSPOSED, _BATCH_NORMS) if kind in f), None)
    if family is not None:
        return f"nn.{family[0].__name__[:-2]}1d/2d/3d"
    return getattr(kind, "label", f"nn.{kind.__name__}")


def meaning(core, module: nn.Module, where: str, owned: tuple, kinds: tuple = ()):
    """The ``Meaning`` of ``core`` on ``module`` (``owned``: the names of the parameters its
    style governs), or a sentence saying why it has none.

    Rows come from, in order: ``kinds``, the plan's own ``((module class, {built-in: row}),
    ...)`` (``Plan.kind``), the first class the module is an instance of; the class
    attribute ``tpfn_rows = {"colwise": row, ...}`` of a module kind of the user's own; then
    ``TABLE``. Each ``row(core, module, where, owned)`` returns a style of primitives (or a
    ``Meaning``, or a sentence refusing)."""
    mine = next((rows for kind, rows in kinds if isinstance(module, kind)), {})
    row = dict(mine).get(core.kind) or getattr(type(module), "tpfn_rows", {}).get(core.kind)
    if row is not None:
        found = row(core, module, where, owned)
        return Meaning(found) if isinstance(found, Style) else found
    for kind, row in TABLE[core.kind]:
        if isinstance(module, kind):
            return row(core, module, where, owned)
    *most, last = dict.fromkeys(_label(kind) for kind, _ in TABLE[core.kind])
    kinds = f"{', '.join(most)} and {last}" if most else last
    wraps = isinstance(getattr(module, "base_layer", None), nn.Module)  # PEFT's LoRA layers, say
    return f"{core!r} at {where}: it shards {kinds}, not {type(module).__name__}" + (
        f" ({type(module).__module__}.{type(module).__qualname__}, which wraps its 'base_layer'): pass the "
        "plan through tpfn.with_lora(plan, model), which shards the base layer and its LoRA adapters "
        "alike (tpfn.from_hf does)." if wraps else ".")
