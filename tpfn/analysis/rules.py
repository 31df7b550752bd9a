"""How each ATen op carries its inputs' sharded dims (``tpfn.analysis.factors``) to its outputs.

``carry(func, args, kwargs, out, held, spaces)`` returns the dims of each output tensor of one
op, or raises ``Broken`` where the op would need a sharded space's features whole: a
reduction, softmax or norm over them, a matmul that contracts them, an index into them, a
replicated tensor (or parameter) of their full size meeting them, or an op no rule here
knows (nothing is guessed). Elementwise ops, views, transposes, copies, batched matmuls
and attention carry them; where two spaces meet on one dim they are joined, and a
replicated tensor that meets a sharded one by broadcasting passes a partial gradient to every
parameter it was computed from. A
tensor that holds one value everywhere (zeros made with a head count) may meet sharded
features: whether each rank makes it its share is what the ranks' check sees.

>>> import torch
>>> from tpfn.analysis.factors import tag
>>> from tpfn.analysis.spaces import Spaces
>>> spaces = Spaces()
>>> q = spaces.new("q", 32)
>>> x = torch.empty(2, 16, 32, device="meta")
>>> class Held:
...     def dims(self, t): return tag(plain(t.shape), 2, q) if t is x else plain(t.shape)
...     def param(self, t): return None
...     def uniform(self, t): return False
...     def input(self, t): return None
...     def deps(self, t): return set()
>>> y = x.view(2, 16, 4, 8)
>>> carry(torch.ops.aten.view.default, (x, [2, 16, 4, 8]), {}, y, Held(), spaces)[0][0][1]
(((2, None),), ((16, None),), ((4, 0),), ((8, None),))
"""

from __future__ import annotations

import re

import attrs
import torch

from tpfn._torch import argument_names, functional_overload
from tpfn.analysis.factors import (
    REPEAT, Broken, expand, form, permute, plain, size, spaces as held_spaces, view,
)

__all__ = ["carry", "tensors", "step", "UNIFORM", "Input", "filled", "arg"]

UNIFORM = "<uniform>"  # an operand that holds one value everywhere (zeros, a fill)


@attrs.frozen
class Input:
    """An operand that is (a view of) input ``name`` of module ``fqn``."""

    fqn: str
    name: str
# Ops whose output holds one value everywhere, whatever their input holds.
_FILLS = {"zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
          "new_full", "scalar_tensor", "fill", "zero"}


def filled(func, inputs_uniform: bool) -> bool:
    """Whether ``func``'s output holds one value everywhere: a fill, or a view or copy of one."""
    name = func.overloadpacket.__name__
    base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
    return base in _FILLS or inputs_uniform and base in _RESHAPES | _SAME | {
        "expand", "permute", "transpose", "t", "select", "slice"}

# Ops whose one output is a view or copy of their first input with another shape.
_RESHAPES = {"view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "flatten",
             "unflatten", "alias", "lift_fresh", "detach", "view_as"}
# Ops whose outputs have their first input's shape and dims.
_SAME = {"clone", "_to_copy", "contiguous", "native_dropout", "dropout", "fill", "zero",
         "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
         "_to_dim_order_copy", "detach_copy", "alias_copy", "copy"}
_SOFTMAX = {"_softmax", "_safe_softmax", "_log_softmax", "softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp",
            "sort", "argsort", "topk", "cummax", "cummin"}
_NORMS = {"native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm"}
_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "addbmm"}
# Ops on the last k dims of each channel alone: pooling, resampling, padding (max_pool2d: k = 2).
_SPATIAL = re.compile(r"^_?(max_pool|avg_pool|adaptive_avg_pool|adaptive_max_pool|fractional_max_pool|lp_pool|"
                      r"upsample_\w+?|reflection_pad|replication_pad)(\d)d(_with_indices|_aa)?$")


# Ops that only lay a tensor out anew (a reshape copies where a view cannot): the same step.
_LAYOUT = {"clone", "contiguous", "alias", "detach", "lift_fresh"}
_VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias"}


def step(func) -> str | None:
    """The op as two runs of one model must agree on it (None: a copy that only lays a tensor
    out anew, which a run takes or not by its strides)."""
    name = func.overloadpacket.__name__
    if name in _LAYOUT:
        return None
    return "view" if name in _VIEWS else str(func)


def tensors(x) -> list:
    """The tensors in an op's arguments or outputs, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in tensors(item)]
    return []


def _name(func) -> str:
    return func.overloadpacket.__name__


def arg(func, args, kwargs, name, default=None):
    """Argument ``name`` of a call of the ATen op ``func``, by keyword or position (``default``: absent)."""
    names = argument_names(func)
    if name in kwargs:
        return kwargs[name]
    i = names.index(name) if name in names else None
    return args[i] if i is not None and i < len(args) else default


def _dims_list(x) -> list:
    return [x] if isinstance(x, int) else list(x or [])


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _pointwise(func) -> bool:
    functional = functional_overload(func)
    return torch.Tag.pointwise in func.tags or (
        functional is not None and torch.Tag.pointwise in functional.tags)


def _line_up(operands: list, out_size: int, spaces, what: str):
    """The dims of one output dim from the operands' dims at it (``(dims, source, index)`` for
    each operand that has it whole, not broadcast): every one must hold a space, lined up
    alike, and then their spaces are joined. A module's input laid out per head (rows of batch
    times heads, heads innermost: BLOOM's ALiBi) is noted, for ``per_rank(inputs=...)``."""
    operands = [o if len(o) == 3 else (*o, None) for o in operands]
    held = [(d, p) for d, p, _ in operands if held_spaces((d,))]
    if not held:
        return plain((out_size,))[0]
    ref = form(held[0][0])
    for d, param, index in operands:
        f = form(d)
        if f is None and param == UNIFORM:  # zeros of a global head count: the ranks' check sees
            continue
        if f is None and isinstance(param, Input) and index == 0 and ref[3] == 1:
            spaces.inputs.setdefault(spaces.find(ref[2]), set()).add((param.fqn, param.name, ref[1]))
            continue
        if f is None:
            whose = (f"the parameter {param}, as wide as them" if isinstance(param, str) else
                     f"input {param.name!r} of {param.fqn or '<root>'!r}, replicated and as wide as them"
                     if isinstance(param, Input) else "a replicated tensor as wide as them")
            raise Broken(held_spaces(tuple(h for h, _ in held)), f"{what} of the sharded features with {whose}")
        if f[0] != ref[0] or f[1] * f[3] != ref[1] * ref[3]:
            raise Broken(held_spaces(tuple(h for h, _ in held)),
                         f"{what}: two sharded dims meet that do not line up")
        spaces.join(ref[2], f[2])
    return next((d for d, _ in held if all(t != REPEAT for _, t in d)), held[0][0])


def _broadcast(items: list, shape: tuple, spaces, what: str) -> tuple:
    """The dims of an elementwise op's output of ``shape`` from ``(dims, shape, param)`` of
    each input."""
    out = []
    n = len(shape)
    for i in range(n):
        operands = []
        for dims, s, param in items:
            j = i - (n - len(s))
            if j >= 0 and s[j] != 1:
                operands.append((dims[j], param, j))
        out.append(_line_up(operands, shape[i], spaces, what))
    return tuple(out)


def _partial(deps: list, outs: list, spaces) -> None:
    """The parameters a replicated input of an op with sharded outputs depends on get partial
    gradients (each rank's covers its shard only)."""
    found = held_spaces(tuple(d for _, dims in outs for d in dims))
    if found:
        root = spaces.find(next(iter(found)))
        spaces.partial.setdefault(root, set()).update(*deps)


def _reduced(dims: tuple, axes, keep: bool, what: str) -> tuple:
    """``dims`` less ``axes`` (kept as size 1 with ``keep``); a sharded axis raises."""
    for a in axes:
        if held_spaces((dims[a],)):
            raise Broken(held_spaces((dims[a],)), f"{what} over the sharded features")
    return tuple(() if i in axes else d for i, d in enumerate(dims) if keep or i not in axes)


def _source(held, t):
    """What an operand is beyond its dims: a parameter's name, ``UNIFORM``, an ``Input``, or None."""
    return UNIFORM if held.uniform(t) else held.param(t) or held.input(t)


def carry(func, args: tuple, kwargs: dict, out, held, spaces) -> tuple:
    """``([(output tensor, dims), ...], [(output tensor, source), ...])`` of one op: the dims
    of its outputs, and the outputs that are views or copies of a parameter (its name) or of a
    module's input (an ``Input``)."""
    name = _name(func)
    base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
    ins = tensors(args) + tensors(list(kwargs.values()))
    outs = tensors(out)
    items = [(held.dims(t), tuple(t.shape), _source(held, t)) for t in ins]
    what = f"{base}"
    if not any(held_spaces(d) for d, _, _ in items):
        derived = []
        source = (held.param(ins[0]) or held.input(ins[0])) if ins else None
        if source and base in _RESHAPES | _SAME | {"expand", "permute", "transpose", "t", "select", "slice"}:
            derived = [(o, source) for o in outs]
        return [(o, plain(o.shape)) for o in outs], derived
    first = items[0][0] if items else ()
    x = ins[0] if ins else None
    if base in _RESHAPES:
        found = [(outs[0], view(first, tuple(x.shape), tuple(outs[0].shape), spaces.units))]
    elif base in _SAME or torch.Tag.nondeterministic_seeded in func.tags and base not in _FILLS:
        # a copy, or random numbers of its shape (a dropout mask: drawn per rank, the note says)
        found = [(o, first) if tuple(o.shape) == tuple(x.shape) else (o, plain(o.shape)) for o in outs]
        if any(held_spaces(d) for d, _, _ in items[1:]):  # copy_(dst, src): src's dims
            found = [(o, _broadcast(items, tuple(o.shape), spaces, what)) for o in outs]
    elif base.startswith("new_"):  # a new tensor of sizes given (a buffer to fill)
        found = [(o, plain(o.shape)) for o in outs]
    elif base == "view_as_complex":  # (..., 2) real pairs as complex numbers
        _reduced(first, [x.dim() - 1], False, "view_as_complex")
        found = [(outs[0], first[:-1])]
    elif base == "view_as_real":
        found = [(outs[0], first + plain((2,)))]
    elif base == "expand":
        found = [(outs[0], expand(first, tuple(x.shape), tuple(outs[0].shape)))]
    elif base in ("permute", "transpose", "t", "swapaxes", "numpy_T"):
        nd = x.dim()
        if base == "permute":
            order = [_norm(d, nd) for d in arg(func, args, kwargs, "dims")]
        else:
            order = list(range(nd))
            if nd == 2 and base in ("t", "numpy_T"):
                order = [1, 0]
            else:
                a, b = (_norm(arg(func, args, kwargs, k), nd) for k in ("dim0", "dim1"))
                order[a], order[b] = order[b], order[a]
        found = [(outs[0], permute(first, order))]
    elif base in ("select", "unbind"):
        d = _norm(arg(func, args, kwargs, "dim", 0), x.dim())
        found = [(o, _reduced(first, [d], False, f"{base} (an index into them)")) for o in outs]
    elif base == "slice":
        d = _norm(arg(func, args, kwargs, "dim", 0), x.dim())
        o = outs[0]
        if o.shape[d] != x.shape[d]:
            _reduced(first, [d], False, "slice (a part of them)")
            found = [(o, first[:d] + plain((o.shape[d],)) + first[d + 1:])]
        else:
            found = [(o, first)]
    elif base in ("split", "split_with_sizes", "unsafe_split", "unsafe_split_with_sizes"):
        found = _split(func, args, kwargs, x, first, outs, spaces)
    elif base in ("cat", "stack"):
        found = _cat(func, args, kwargs, items, outs, spaces, base)
    elif _pointwise(func):
        found = [(o, _broadcast(items, tuple(o.shape), spaces, what)) for o in outs[:1]]
        found += [(o, plain(o.shape)) for o in outs[1:]]
    elif base in _MATMULS:
        found = [(outs[0], _matmul(base, items, tuple(outs[0].shape), spaces))]
    elif "scaled_dot_product" in base:
        found = _attention(func, args, kwargs, held, outs, spaces)
    elif base in _SOFTMAX:
        d = _norm(arg(func, args, kwargs, "dim", -1), x.dim())
        _reduced(first, [d], False, f"{base}")
        found = [(o, first if o.dim() == x.dim() else plain(o.shape)) for o in outs]
        found = [(o, dims if tuple(o.shape) == tuple(x.shape) else
                  first[:d] + plain((o.shape[d],)) + first[d + 1:]) for o, dims in found]
    elif base in _NORMS:
        k = len(_dims_list(arg(func, args, kwargs, "normalized_shape")))
        axes = list(range(x.dim() - k, x.dim()))
        kept = _reduced(first, axes, True, "a norm")
        found = [(o, first if tuple(o.shape) == tuple(x.shape) else kept) for o in outs]
    elif torch.Tag.reduction in func.tags or base in ("max", "min", "argmax", "argmin", "var_mean",
                                                      "std_mean", "logsumexp", "linalg_vector_norm"):
        axes = _dims_list(arg(func, args, kwargs, "dim"))
        axes = [_norm(a, x.dim()) for a in axes] or list(range(x.dim()))
        keep = bool(arg(func, args, kwargs, "keepdim", False))
        dims = _reduced(first, axes, keep, f"{base} (a reduction)")
        found = [(o, dims) for o in outs]
    elif base in ("index_select", "index_add", "index_copy", "index_fill", "scatter", "scatter_add",
                  "scatter_reduce", "gather"):
        found = _indexed(func, args, kwargs, items, outs, spaces, base)
    elif base == "index":
        found = [(outs[0], _advanced_index(args[1] if len(args) > 1 else kwargs["indices"], first,
                                           tuple(outs[0].shape)))]
    elif _SPATIAL.match(name) or base == "constant_pad_nd":
        found = _spatial(func, args, kwargs, x, first, outs, base)
    else:
        raise Broken(held_spaces(tuple(d for dims, _, _ in items for d in dims)),
                     f"{func} (an op no rule says how it treats sharded features)")
    _partial([held.deps(t) for t in ins if not held_spaces(held.dims(t))], found, spaces)
    return found, []


def _spatial(func, args, kwargs, x, first, outs, base) -> list:
    """Pooling, resampling and padding of the last ``k`` dims (``max_pool2d``: 2), each channel on
    its own: those dims must be whole; the dims before them (batch, channels) carry."""
    found = _SPATIAL.match(base)
    k = int(found.group(2)) if found else len(arg(func, args, kwargs, "pad")) // 2
    _reduced(first, list(range(x.dim() - k, x.dim())), False, f"{base} (over positions)")
    out = []
    for o in outs:
        if o.dim() != x.dim() or tuple(o.shape[:-k]) != tuple(x.shape[:-k]):
            raise Broken(held_spaces(first), f"{base}, whose output this rule cannot follow")
        out.append((o, first[:-k] + plain(tuple(o.shape[-k:]))))
    return out


def _split(func, args, kwargs, x, first, outs, spaces) -> list:
    d = _norm(arg(func, args, kwargs, "dim", 0), x.dim())
    sizes = tuple(o.shape[d] for o in outs)
    if not held_spaces((first[d],)):
        return [(o, first[:d] + plain((o.shape[d],)) + first[d + 1:]) for o in outs]
    f = form(first[d])
    whole = f is not None and len(first[d]) == 1 and spaces.spaces[f[2]].part_of is None \
        and spaces.spaces[f[2]].width == x.shape[d]
    if not whole:
        raise Broken(held_spaces((first[d],)), "a split of sharded features that are not a linear's whole output")
    try:
        parts = [spaces.part(f[2], sizes, i) for i in range(len(outs))]
    except ValueError as e:
        raise Broken({f[2]}, str(e)) from None
    return [(o, first[:d] + (((o.shape[d], p),),) + first[d + 1:]) for o, p in zip(outs, parts)]


def _cat(func, args, kwargs, items, outs, spaces, base) -> list:
    out = outs[0]
    d = _norm(arg(func, args, kwargs, "dim", 0), out.dim())
    parts = [it for it in items if not (len(it[1]) == 1 and it[1][0] == 0)]  # torch.cat skips empty 1-D
    if base == "stack":
        parts = [(dims[:d] + ((),) + dims[d:], s[:d] + (1,) + s[d:], p) for dims, s, p in parts]
    for dims, _, _ in parts:
        if held_spaces((dims[d],)):
            raise Broken(held_spaces((dims[d],)), f"{base} along the sharded features")
    dims = []
    for i in range(out.dim()):
        if i == d:
            dims.append(plain((out.shape[d],))[0])
        else:
            dims.append(_line_up([(ds[i], p) for ds, s, p in parts if s[i] != 1], out.shape[i], spaces, base))
    return [(out, tuple(dims))]


def _matmul(base: str, items: list, shape: tuple, spaces) -> tuple:
    """``mm``/``bmm`` and their ``add`` forms: batch dims line up, the contracted dim must be whole."""
    extra = items[0] if base in ("addmm", "baddbmm", "addbmm") else None
    a, b = (items[1], items[2]) if extra else (items[0], items[1])
    (da, sa, pa), (db, sb, pb) = a, b
    for dims, dim in ((da, -1), (db, -2)):
        if held_spaces((dims[dim],)):
            raise Broken(held_spaces((dims[dim],)), f"{base}, which contracts the sharded features "
                         "outside a row-wise linear")
    batch = [_line_up([(da[i], pa), (db[i], pb)], sa[i], spaces, base) for i in range(len(sa) - 2)]
    if base == "addbmm":
        raise Broken(held_spaces(da + db), "addbmm, which sums its batch")
    dims = tuple(batch) + (da[-2], db[-1])
    if extra is not None:
        dims = _broadcast([(dims, shape, None), extra], shape, spaces, base)
    return dims


def _attention(func, args, kwargs, held, outs, spaces) -> list:
    """Scaled dot-product attention: heads (dim 1) and batch (dim 0) line up across q, k, v
    and the mask; positions and head dims must be whole."""
    q, k, v = (arg(func, args, kwargs, n) for n in ("query", "key", "value"))
    mask = arg(func, args, kwargs, "attn_mask", arg(func, args, kwargs, "attn_bias"))
    if arg(func, args, kwargs, "enable_gqa", False) and q.shape[1] != k.shape[1]:
        raise Broken(held_spaces(held.dims(q) + held.dims(k)), "attention with grouped KV heads "
                     "(enable_gqa), which reads the head counts")
    items = [(held.dims(t), tuple(t.shape), held.param(t)) for t in (q, k, v)]
    for dims, _, _ in items:
        if held_spaces(dims[2:]):
            raise Broken(held_spaces(dims[2:]), "attention over sharded positions or head dims")
    lead = tuple(_line_up([(d[i], p) for d, s, p in items if s[i] != 1], q.shape[i], spaces, "attention")
                 for i in range(2))
    if mask is not None:
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        whole = [(lead + plain(shape[2:]), shape, None), (held.dims(mask), tuple(mask.shape), None)]
        _broadcast(whole, shape, spaces, "attention's mask")
    return [(o, lead + plain(o.shape[2:])) if o.dim() >= 2 and tuple(o.shape[:2]) == tuple(q.shape[:2])
            else (o, plain(o.shape)) for o in outs]


def _indexed(func, args, kwargs, items, outs, spaces, base) -> list:
    """Index ops along one dim: that dim must be whole; the others line up between the
    tensor and its source."""
    x = items[0]
    d = _norm(arg(func, args, kwargs, "dim", 0), len(x[1]))
    for dims, _, _ in items:
        if len(dims) > d and held_spaces((dims[d],)):
            raise Broken(held_spaces((dims[d],)), f"{base} along the sharded features")
    if base in ("gather", "index_select"):
        if base == "gather":
            raise Broken(held_spaces(x[0]), "gather from sharded features")
        return [(outs[0], x[0][:d] + plain((outs[0].shape[d],)) + x[0][d + 1:])]
    out = outs[0]
    source = [it for it in items[1:] if it[1] and len(it[1]) == out.dim()]
    dims = []
    for i in range(out.dim()):
        if i == d:
            dims.append(plain((out.shape[i],))[0])
            continue
        operands = [(x[0][i], x[2])] + [(s[0][i], s[2]) for s in source if s[1][i] == out.shape[i]]
        dims.append(_line_up([o for o in operands if size(o[0]) != 1], out.shape[i], spaces, base))
    return [(out, tuple(dims))]


def _advanced_index(indices, dims: tuple, shape: tuple) -> tuple:
    """``x[idx, ...]``: the indexed dims must be whole; they give way to the index's dims."""
    at = [i for i, t in enumerate(indices) if t is not None]
    for i in at:
        if held_spaces((dims[i],)):
            raise Broken(held_spaces((dims[i],)), "an index into the sharded features")
    rest = [d for i, d in enumerate(dims) if i not in at]
    n_index = len(shape) - len(rest)
    if at == list(range(at[0], at[-1] + 1)):
        out = dims[:at[0]] + plain(shape[at[0]:at[0] + n_index]) + dims[at[-1] + 1:]
    else:
        out = plain(shape[:n_index]) + tuple(rest)
    if tuple(size(d) for d in out) != tuple(shape):
        raise Broken(held_spaces(dims), "an index whose result this rule cannot follow")
    return out

