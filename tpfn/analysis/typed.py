"""One forward on one device, each value typed by the layout a plan gives it on the ranks.

``typed(model, mounts, args, kwargs)`` runs ``model`` (a ``hybrid_copy``: parameters on meta,
inputs and buffers real) once under a dispatch mode and module hooks. Where the plan binds a
module its slots say the layout of what it is handed and hands on (``tpfn.analysis.values``);
a module whose built-in row the runtime computes (a linear column-wise, an embedding row-wise)
is one step, its inner ops its own; the code of every other module, and of modules whose
style runs the model's own forward on shards (``on_shards``, ``prepare_in``, a norm's forward
under ``sequence_parallel``), is typed op by op by the rules of ``tpfn.analysis.rules`` and
those of partial sums below. What no rule proves, or what a rule shows would compute other
numbers than one device, is a ``Finding`` naming the module, the op and the line of source.

The rules beyond ``carry``'s:

- a partial sum (a row-wise output handed on before its all-reduce, a sum over a sharded
  dim) goes through linear ops only: views, copies, selections, sums and means, sums with
  partial sums, products and quotients by replicated values, matrix products with replicated
  ones. A nonlinear op, a norm, a softmax, a max or a comparison of one computes each rank's
  term apart; a replicated value added to one is added once per rank;
- a sum (or a matrix product) over a sharded dim leaves a partial sum; a mean, a norm, a
  softmax, a max, a sort or a cumulative op over one reads the rank's shard alone;
- random numbers drawn on a shard (dropout) are the rank's own draw, unless the module's
  style draws on shards (``on_shards``, the built-in dropout rows);
- a replicated value computed from parameters (or inputs) that need a gradient and that meets
  a shard or a partial sum gets a partial sum as its gradient on each rank, which nothing sums
  unless the plan declares it (``param_grads=Partial()``, ``grads=Partial()``): the backward,
  typed by each op's dual.

``Trace`` holds the ops as one device ran them (each output's global shape and ``Value``, its
arguments, where and at which line), the findings, and the layout of each module's output.

>>> import torch.nn as nn
>>> from tpfn import Partial, colwise, prepare_out, rowwise
>>> from tpfn.analysis.hybrid import hybrid_copy
>>> from tpfn.plans.plan import resolve
>>> mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU())
>>> plan = {"0": colwise(), "2": rowwise() >> prepare_out(Partial())}   # the last ReLU: partial
>>> model = hybrid_copy(mlp)
>>> trace = typed(model, {m.fqn: m for m in resolve(plan, model)}, (torch.ones(2, 8),), {})
>>> print(trace.findings[0])  # doctest: +ELLIPSIS
'3' aten.relu.default (torch/nn/modules/activation.py:...): relu of a partial sum (output 0 of '2'): ...
"""

from __future__ import annotations

import contextlib

import attrs
import torch
import torch.nn as nn

from tpfn._fqn import join
from tpfn._torch import TorchDispatchMode, argument_names
from tpfn.analysis.factors import REPEAT, Broken, expand, form, local_shape, plain, spaces as held_spaces
from tpfn.analysis.findings import Finding
from tpfn.analysis.hybrid import Hybrid
from tpfn.analysis.inputs import tensors as leaves
from tpfn.analysis.rules import arg, carry, filled, step, tensors
from tpfn.analysis.spaces import Spaces
from tpfn.analysis.values import Value, layout_of, sharded, value_of
from tpfn.analysis.where import asks_rank, caller, failing_module, rank_reads
from tpfn.layout import Partial, Replicate, Shard, normalize
from tpfn.plans.kinds import attention_on_heads, dropout_slice, own_stream
from tpfn.style.stages import Core

__all__ = ["typed", "Trace", "Op", "trusted", "arguments", "expected"]

# Ops linear in a partial sum, taken with replicated operands: views, copies, selections, sums.
_CARRIED = {"view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "flatten",
            "unflatten", "alias", "lift_fresh", "detach", "view_as", "clone", "_to_copy", "contiguous",
            "copy", "expand", "permute", "transpose", "t", "numpy_T", "swapaxes", "select", "slice",
            "narrow", "split", "split_with_sizes", "unsafe_split", "unbind", "index_select", "index",
            "gather", "cat", "stack", "neg", "sum", "mean", "roll", "flip", "repeat", "tril", "triu",
            "constant_pad_nd", "masked_fill", "where", "zero", "fill", "mm", "bmm", "matmul",
            "_to_dim_order_copy", "as_strided", "diagonal", "movedim"}
# Ops that make a tensor of no values yet (what is written into it later decides them).
_EMPTY = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"}
_PRODUCTS = {"mul", "div", "mm", "bmm", "matmul"}    # linear in one partial operand, not in two
_SUMS = {"add", "sub"}                                # linear where every tensor operand is partial
# Ops that write values into a tensor: linear where every floating operand is a partial sum (or zeros).
_INTO = {"index_add", "index_put", "scatter_add", "scatter", "index_copy", "masked_scatter", "copy",
         "scatter_reduce"}
_ZEROS = {"zeros", "zeros_like", "new_zeros", "zero"}  # ops that make zeros, a term of any partial sum


@attrs.frozen
class Op:
    """One op of the model's own code as one device ran it: the op (``tpfn.analysis.rules.step``),
    the module whose code ran it, the source line, its arguments (``arguments``) and, per
    output, ``(global shape, Value, uniform)`` (uniform: one value everywhere, or none yet)."""

    op: str
    where: str
    line: str
    args: tuple
    outputs: tuple


@attrs.define
class Trace:
    """What ``typed`` saw: the ops, the findings, the spaces (their head sizes in ``units``),
    the layout of each module's outputs as the ranks hold them, per call (``{fqn: [[layout,
    ...], ...]}``, None where no one layout says it), the model's outputs, the modules computed
    as one step, and the layouts of each module's inputs as they arrive (``arrivals``)."""

    ops: list
    findings: list
    spaces: Spaces
    layouts: dict
    outputs: list
    trusted: set    # the modules the runtime computes by a built-in row (one step each)
    arrivals: dict  # {fqn: [[layout of each input], ...]}, as layouts are


def trusted(module: nn.Module, mount) -> bool:
    """Whether the runtime computes ``mount``'s module by a built-in row on torch's own forward
    (a linear or embedding column- or row-wise, ``nn.MultiheadAttention``, a norm or dropout of
    torch's under sequence parallelism): one step, whose inner ops the check does not type."""
    if not isinstance(mount.style.core, Core) or "forward" in vars(module):
        return False
    code = type(module).forward
    return code.__module__.startswith(("torch.", "transformers.pytorch_utils"))


def arguments(func, args: tuple, kwargs: dict) -> tuple:
    """``((name, value), ...)``: the op's arguments that are no tensors, by their schema names."""
    names = argument_names(func)
    pairs = [*zip(names, args), *kwargs.items()]
    return tuple((n, _plain(v)) for n, v in pairs
                 if not tensors(v) and n not in ("device", "pin_memory", "layout"))


def _plain(v):
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v if isinstance(v, (int, float, bool, str, type(None), torch.dtype)) else repr(v)


def _zeros(func, args, kwargs) -> bool:
    """Whether ``func`` makes a tensor of zeros (``zeros``, ``full(..., 0)``, ``fill_(0)``)."""
    base = _name(func)
    if base in _ZEROS:
        return True
    value = arg(func, args, kwargs, "fill_value", arg(func, args, kwargs, "value"))
    return base in ("full", "full_like", "new_full", "fill") and isinstance(value, (int, float)) and value == 0


def _name(func) -> str:
    name = func.overloadpacket.__name__
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


def _axes(func, args, kwargs, ndim: int) -> list:
    dims = arg(func, args, kwargs, "dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return [d % ndim for d in dims] if dims else list(range(ndim))


class Wrong(Broken):
    """An op the rules of partial sums show computes other numbers, said in full."""

    def __init__(self, why: str):
        super().__init__((), why)


class _Typing(TorchDispatchMode):
    """The dispatch mode and module hooks of ``typed`` (see the module docstring)."""

    def __init__(self, model: nn.Module, mounts: dict, n: int):
        super().__init__()
        self.model, self.mounts, self.n = model, mounts, n
        self.modules = dict(model.named_modules())
        self.spaces = Spaces()
        self.values: dict = {}      # id -> (tensor, Value)
        self.uniforms: dict = {}    # id -> a tensor that holds one value everywhere
        self.zeros: dict = {}       # id -> a tensor of zeros (a term of any partial sum)
        self.params = {id(p): name for name, p in model.named_parameters()}
        self.declared: set = set()  # anchors whose gradients the plan declares partial sums
        self.stack: list = []
        self.inside = 0             # depth inside a trusted module
        self.saved: list = []       # per module call: the values its hooks replaced
        self.ops: list = []
        self.findings: list = []
        self.layouts: dict = {}
        self.arrivals: dict = {}
        self.random: list = []      # module fqns whose style draws on shards, innermost last
        self.keep: list = []        # tensors whose ids the tables use, kept alive

    # -- values ------------------------------------------------------------------------------
    def value(self, t: torch.Tensor) -> Value:
        found = self.values.get(id(t))
        if found is not None and found[0] is t:
            return found[1]
        name = self.params.get(id(t))
        if name is not None and t.requires_grad:
            return Value(plain(t.shape), grads=frozenset({name}))
        return Value(plain(t.shape))

    def set(self, t: torch.Tensor, value: Value) -> None:
        self.values[id(t)] = (t, value)

    def dims(self, t):  # the interface of tpfn.analysis.rules
        return self.value(t).dims

    def param(self, t):
        return self.params.get(id(t))

    def uniform(self, t) -> bool:
        found = self.uniforms.get(id(t))
        return found is not None and found is t

    def zero(self, t) -> bool:
        found = self.zeros.get(id(t))
        return found is not None and found is t

    def input(self, t):
        return None

    def deps(self, t) -> set:
        return set()

    @property
    def where(self) -> str:
        return self.stack[-1] if self.stack else ""

    def find(self, op: str, line: str, why: str, kind: str = "wrong", where: str | None = None) -> None:
        self.findings.append(Finding(self.where if where is None else where, op, line, why, kind))

    # -- ops ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside:
            return out
        who, line = caller()
        outs = tensors(out)
        if who != "model":  # a tpfn function the model calls (its own layouts), or autograd
            return out
        ins = tensors(args) + tensors(list(kwargs.values()))
        values = [self.value(t) for t in ins]
        try:
            found = self._type(func, args, kwargs, out, ins, values, outs, line)
        except Broken as e:
            unknown = "no rule says" in e.why
            self.find(str(func), line, e.why if isinstance(e, Wrong) else self._broken(e.why, ins, values)
                      if not unknown else (
                f"{func} takes a sharded value, and no rule of the check says how it treats one: "
                "it cannot prove what it computes"), "unproven" if unknown else "wrong")
            found = [(o, Value(plain(o.shape), known=False)) for o in outs]
        except Exception as e:  # noqa: BLE001 - a rule that cannot follow the op: unproven, named
            self.find(str(func), line, f"the check's rules cannot follow {func} on these values "
                      f"({type(e).__name__}: {e}): it cannot prove what it computes", "unproven")
            found = [(o, Value(plain(o.shape), known=False)) for o in outs]
        for t, value in found:
            self.set(t, value)
        if func.overloadpacket.__name__.endswith("_") and found:
            self._written(*found[0])
        if filled(func, bool(ins) and all(self.uniform(t) for t in ins[:1])) or _name(func) in _EMPTY:
            self.uniforms.update((id(t), t) for t in outs)
        if _zeros(func, args, kwargs) or (ins and self.zero(ins[0]) and filled(func, True)
                                          and _name(func) != "fill"):
            self.zeros.update((id(t), t) for t in outs)
        self.keep.extend(outs)
        name = step(func)
        if name is not None:
            self.ops.append(Op(name, self.where, line, arguments(func, args, kwargs),
                               tuple((tuple(t.shape), self.value(t), self.uniform(t)) for t in outs)))
        return out

    def _written(self, t: torch.Tensor, value: Value) -> None:
        """A shard written in place into a view of a tensor of no values yet (``new_empty``,
        ``zeros``): the tensor holds that shard, on the dims the view keeps whole."""
        base = t._base
        if base is None or not self.uniform(base) or not sharded(value) or base.dim() != t.dim():
            return
        dims = []
        for d, (whole, part) in enumerate(zip(base.shape, t.shape)):
            if whole != part and held_spaces((value.dims[d],)):
                return
            dims.append(value.dims[d] if whole == part else plain((whole,))[0])
        self.set(base, Value(tuple(dims)))

    def _type(self, func, args, kwargs, out, ins, values, outs, line) -> list:
        """``[(output, Value), ...]`` of one op of the model's code (raises ``Broken``)."""
        base = _name(func)
        if all(v.replicated for v in values):  # a gradient reaches what its floating outputs came from
            drawn = torch.Tag.nondeterministic_seeded in func.tags
            grads = frozenset() if drawn else frozenset().union(*(v.grads for v in values))
            if base == "expand":  # copies: a rank may hold fewer of them (its heads' share)
                return [(outs[0], Value(expand(values[0].dims, tuple(ins[0].shape), tuple(outs[0].shape)),
                                        grads=grads))]
            return [(o, Value(plain(o.shape), grads=grads if o.is_floating_point() else frozenset()))
                    for o in outs]
        if not all(v.known for v in values):  # past a finding
            return [(o, Value(plain(o.shape), known=False)) for o in outs]
        if any(v.dtensor for v in values):  # DTensor computes it by its global meaning
            return [(o, Value(plain(o.shape), dtensor=True)) for o in outs]
        if torch.Tag.nondeterministic_seeded in func.tags and not self.random:
            self.find(str(func), line, (
                f"{base} draws random numbers on a shard: each rank draws its own for its part, where "
                "one device draws once for the whole, and the plan's style declares no random stream "
                "here (nn.Dropout under sequence_parallel() takes its slice of one device's mask; a "
                "module bound with on_shards(...) draws on shards by declaration); leave the module "
                "that draws out of the sharded region, or bind it"))
        if any(v.partial for v in values):
            found = self._partial(func, base, args, kwargs, ins, values, outs, line)
        else:
            found = self._split(func, base, args, kwargs, ins, values, outs) or self._reduced(
                func, base, args, kwargs, ins, values, outs) or [
                (o, Value(dims)) for o, dims in carry(func, args, kwargs, out, self, self.spaces)[0]]
        self._gradients(func, base, ins, values, found, line)
        return found

    def _split(self, func, base, args, kwargs, ins, values, outs):
        """A split along a sharded dim: into whole blocks of its unsharded outer factor (equal
        parts, ``colwise(parts=k)``), each a shard as the whole was; a contiguous shard cut in
        pieces is each rank's pieces of its own block, not its share of each piece."""
        if base not in ("split", "split_with_sizes", "unsafe_split") or len(outs) < 2:
            return None
        x, value = ins[0], values[0]
        d = arg(func, args, kwargs, "dim", 0) % x.dim()
        found = form(value.dims[d])
        if found is None:
            return None
        outer, units, space, inner = found
        block = units * inner
        if self.spaces.spaces[space].parts and len(value.dims[d]) == 1:
            return None  # unequal parts: a split by them (carry's)
        sizes = [o.shape[d] for o in outs]
        if outer > 1 and all(size % block == 0 for size in sizes):
            rest = value.dims[d][1:]
            return [(o, Value(value.dims[:d] + ((((size // block, None),) if size // block > 1 else ()) + rest,)
                              + value.dims[d + 1:])) for o, size in zip(outs, sizes)]
        raise Wrong(
            f"{base} cuts dim {d} into pieces of {tuple(sizes)}, but each of the {self.n} ranks holds a "
            f"contiguous 1/{self.n} of its {x.shape[d]} features, not its share of each piece (rank 0 "
            f"holds the first {x.shape[d] // self.n}); shard the projection that makes them with "
            f"colwise(parts={len(sizes) if len(set(sizes)) == 1 else tuple(sizes)}), so that each rank "
            "holds its slice of every piece")

    def _reduced(self, func, base, args, kwargs, ins, values, outs):
        """A sum over a sharded dim, or a matrix product that contracts one: a partial sum."""
        x = values[0]
        if base == "sum" and sharded(x):
            axes = _axes(func, args, kwargs, ins[0].dim())
            hit = [a for a in axes if held_spaces((x.dims[a],))]
            rest = [d for i, d in enumerate(x.dims) if i not in axes]
            if hit and not held_spaces(tuple(rest)):
                return [(o, Value(plain(o.shape), partial=True, since=f"a sum over the sharded dim {hit[0]}"))
                        for o in outs]
        if base == "_grouped_mm":
            return self._grouped(ins, values, outs)
        if base in ("mm", "bmm") and len(values) == 2 and all(map(sharded, values)):
            a, b = values
            fa, fb = form(a.dims[-1]), form(b.dims[-2])
            others = held_spaces(a.dims[:-1] + b.dims[:-2] + b.dims[-1:])
            if fa is not None and fb is not None and fa[0] == fb[0] and fa[1] * fa[3] == fb[1] * fb[3] \
                    and not others:
                self.spaces.join(fa[2], fb[2])
                return [(outs[0], Value(plain(outs[0].shape), partial=True,
                                        since=f"{base}, which contracts the sharded features"))]
        return None

    def _grouped(self, ins, values, outs) -> list:
        """``_grouped_mm(tokens, weights, offs)`` (fused experts, each token's rows by its expert's
        weights): the weights' output features sharded leave the output so; the tokens' features
        contracted with weights sharded alike leave a partial sum; the rows stay whole."""
        (a, b), out = values[:2], outs[0]
        fa, fb, fn = form(a.dims[-1]), form(b.dims[-2]), form(b.dims[-1])
        if held_spaces(a.dims[:-1] + b.dims[:-2]):
            raise Broken(held_spaces(a.dims[:-1]), "_grouped_mm over sharded tokens or experts")
        if fa is None and fb is None and fn is not None:
            return [(out, Value(plain(out.shape[:-1]) + (b.dims[-1],)))]
        if fa is not None and fb is not None and fn is None and fa[0] == fb[0] \
                and fa[1] * fa[3] == fb[1] * fb[3]:
            self.spaces.join(fa[2], fb[2])
            return [(out, Value(plain(out.shape), partial=True, since="_grouped_mm, which contracts the "
                                                                      "sharded features"))]
        raise Broken(held_spaces(a.dims + b.dims), "_grouped_mm of sharded features that do not line up")

    def _partial(self, func, base, args, kwargs, ins, values, outs, line) -> list:
        """The rules of partial sums (see the module docstring)."""
        since = next(v.since for v in values if v.partial)
        if any(sharded(v) for v in values):
            raise Wrong(f"{base} meets a partial sum ({since}) with a shard of another value: no layout on "
                        "the ranks is their combination")
        parts = [v.partial or self.zero(t) for t, v in zip(ins, values)]
        numbers = [a for a in list(args[1:]) + list(kwargs.values())
                   if isinstance(a, (int, float)) and not isinstance(a, bool)]
        nonzero = [a for a in numbers if a != 0]
        ok = base in _CARRIED and (base not in ("mm", "bmm", "matmul") or sum(parts) == 1) or (
            base in _INTO and all(parts[i] for i, t in enumerate(ins) if t.is_floating_point()))
        if base in ("masked_fill", "fill", "constant_pad_nd") and nonzero:
            ok = False
        if base == "where" and sum(parts) < len([t for t in ins if t.dtype.is_floating_point]):
            ok = False
        if base in ("cat", "stack") and not all(parts):
            ok = False
        if base in _PRODUCTS:
            ok = sum(parts) == 1 and (base != "div" or parts[0])
        elif base in _SUMS:
            ok = all(parts) and not nonzero
            if not ok:
                raise Wrong((
                    f"{base} of a partial sum ({since}) and a replicated "
                    f"{'number' if nonzero and all(parts) else 'value'}: each of the {self.n} ranks adds it to "
                    f"its own term, so the sum counts it {self.n} times (a bias added to partial sums is "
                    "added on one rank, as rowwise() does, or after the reduction)"))
        if not ok:
            raise Wrong((
                f"{base} of a partial sum ({since}): each rank applies it to its own term, and the "
                f"terms' {base} is not the {base} of their sum; reduce the sum first (prepare_out("
                "Replicate()) on the module that hands it on, or let its style all-reduce it)"))
        return [(o, Value(plain(o.shape), partial=True, since=since)) for o in outs]

    def _gradients(self, func, base, ins, values, found, line) -> None:
        """A replicated value that needs a gradient and meets a shard or a partial sum: its
        gradient on each rank is a partial sum, wrong unless the plan declares it."""
        if not any(sharded(v) or v.partial for _, v in found):
            return
        for t, v in zip(ins, values):
            if not v.replicated or not t.is_floating_point():
                continue
            loose = sorted(v.grads - self.declared)
            if loose:
                named = ", ".join(loose[:3]) + (f" (and {len(loose) - 3} more)" if len(loose) > 3 else "")
                self.find(str(func), line, (
                    f"{base} meets a shard or a partial sum with a replicated value computed from "
                    f"{named}: in the backward its gradient on each rank covers only that rank's part (a "
                    f"partial sum), and nothing sums it, so the gradient of {named} differs from one "
                    "device's; declare it (param_grads={name: Partial()} where the plan binds the "
                    "parameter's module, as sequence_parallel() does for norms) or keep the value's path "
                    "replicated"))
                return

    def _broken(self, why: str, ins, values) -> str:
        """The sentence for a rule that breaks on sharded values."""
        d = next((i for v in values for i, dim in enumerate(v.dims) if held_spaces((dim,))), None)
        at = f" (dim {d} is sharded)" if d is not None else ""
        return (f"{why}{at}: each rank computes it on its own part alone, so it differs from what one "
                "device computes on the whole")

    def rank(self, what: str, line: str, module) -> None:
        """The model's code asks for its rank (or whether it runs on ranks)."""
        where = next((fqn for fqn, m in self.modules.items() if m is module), "")
        self.find(what, line, where=where, why=(
            f"reads {what}: a value or a branch on it differs from rank to rank (and between the "
            "ranks and one device), where the plan's ranks each compute their part of one device's "
            "computation; a plan needs no rank in the model's code (tpfn's styles slice and sum by "
            "rank themselves), so compute without it"))

    # -- modules -----------------------------------------------------------------------------
    def pre(self, fqn: str, module: nn.Module, args, kwargs):
        if not self.inside:
            self.arrivals.setdefault(fqn, []).append([layout_of(self.value(t)) for t in leaves((args, kwargs))])
        self.stack.append(fqn)
        mount = self.mounts.get(fqn)
        if mount is None or self.inside:
            if self.inside:
                self.inside += mount is not None
            return
        replaced = []
        names = mount.names or ()
        for name, heads in mount.per_head:  # rows of batch times heads, heads innermost: the rank's heads
            i = names.index(name) if name in names else len(args)
            t = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] % heads == 0:
                space = self.spaces.new(f"input {name!r} of {fqn!r}", heads)
                batch = t.shape[0] // heads
                rows = (((batch, None),) if batch > 1 else ()) + ((heads, space),)
                replaced.append((t, self.values.get(id(t))))
                self.set(t, Value((rows,) + plain(t.shape)[1:]))
        slots = [(f"input {i}", i, s) for i, s in enumerate(mount.inputs.slots)]
        slots += [(f"input {k!r}", k, s) for k, s in mount.inputs.kwargs]
        white = not trusted(module, mount)
        for label, key, slot in slots:
            x = args[key] if isinstance(key, int) and key < len(args) else kwargs.get(
                key if isinstance(key, str) else (names[key] if key < len(names) else None))
            if not isinstance(x, torch.Tensor) or slot.untouched:
                continue
            arrived = self.value(x)
            if fqn == "" and not self.stack[:-1]:  # the model's own inputs: as the root's style says
                arrived = value_of(slot.given, tuple(x.shape), self.spaces, "input") if slot.given else arrived
                self.set(x, arrived)
            self._arrives(fqn, module, label, slot, arrived)
            if white:
                shards = mount.shards
                i = key if isinstance(key, int) else None
                wanted = shards.desired[i] if shards is not None and i is not None and i < len(shards.desired) \
                    and shards.desired[i] is not None else slot.out
                anchor = f"input {key!r} of {fqn or '<root>'!r}" if isinstance(key, str) else \
                    f"input {key} of {fqn or '<root>'!r}"
                grad = shards.grads[i] if shards is not None and i is not None and i < len(shards.desired) \
                    else None
                if isinstance(grad, Partial):
                    self.declared.add(anchor)
                inside = value_of(wanted, tuple(x.shape), self.spaces, f"{label} of {fqn!r}",
                                  dtensor=shards is None and not mount.inputs.local,
                                  grads={anchor} if x.requires_grad else ())
                replaced.append((x, self.values.get(id(x))))
                self.set(x, inside)
        if white:
            placed = dict(mount.params)  # (the runtime sums the partial gradients of placed ones)
            for name, grad in mount.shards.param_grads if mount.shards is not None else ():
                if isinstance(grad, Partial) and name in placed:
                    self.declared.add(join(fqn, name))
            for name, placement in mount.params:
                p = module.get_parameter(name) if "." in name or hasattr(module, name) else None
                if not isinstance(p, torch.Tensor):
                    continue
                full = join(fqn, name)
                replaced.append((p, self.values.get(id(p))))
                self.set(p, value_of(placement, tuple(p.shape), self.spaces, f"{full!r}",
                                     dtensor=mount.shards is None, grads={full} if p.requires_grad else ()))
            self.random.append(fqn) if _draws(mount, module) else None
        else:
            self.inside += 1
        self.saved.append((fqn, replaced, white and _draws(mount, module)))

    def _arrives(self, fqn: str, module, label: str, slot, arrived: Value) -> None:
        """A finding where a local value arrives at a slot in another layout than the slot takes
        a plain tensor in (a DTensor brings its own, and is moved)."""
        if arrived.dtensor:
            return
        taken, now = slot.source, layout_of(arrived)
        if taken is None or now is None and not sharded(arrived):
            return
        if now == taken or isinstance(taken, Shard) and isinstance(now, Shard) and now.parts == taken.parts \
                and (now.dim - taken.dim) % 64 == 0:
            return
        if isinstance(taken, Shard) and isinstance(now, Shard):
            return  # the dims compared by their global shapes on the ranks (the replay)
        what = ("a partial sum (" + arrived.since + ")" if arrived.partial else "replicated"
                if isinstance(now, Replicate) else f"a shard ({now!r})" if now is not None else "a shard")
        self.find(label, "", (
            f"arrives as {what} where its style ({self.mounts[fqn].style!r}, on {type(module).__name__}) "
            f"takes a local tensor as {taken!r}: "
            + ("it takes the value as if every rank held the whole of it, " if isinstance(taken, Replicate) else
               "it takes the value as if it were laid out so, ")
            + "and the module computes on other numbers than one device; lay out the slot as it arrives "
              f"(prepare_in({now!r}) or given=), or move it before"), where=fqn)

    def post(self, fqn: str, module: nn.Module, args, kwargs, out):
        self.stack.pop()
        mount = self.mounts.get(fqn)
        if mount is None:
            self._note(fqn, out)
            return
        if self.inside and not (self.saved and self.saved[-1][0] == fqn):
            self.inside -= 1
            return
        _, replaced, drew = self.saved.pop()
        for t, old in reversed(replaced):
            if old is None:
                self.values.pop(id(t), None)
            else:
                self.values[id(t)] = old
        white = not trusted(module, mount)
        if white:
            if drew:
                self.random.pop()
        else:
            self.inside -= 1
        items = list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, (tuple, list)) \
            else [out]
        shards = mount.shards
        for i, x in enumerate(items):
            if not isinstance(x, torch.Tensor):
                continue
            slot = mount.outputs.slots[i] if i < len(mount.outputs.slots) else None
            computed = self.value(x) if white else None
            own = shards.output if shards is not None and i == 0 else None
            if own is not None:
                own = normalize(own, x.dim())[0]
            if white and own is not None and layout_of(computed) not in (None, own) and not computed.dtensor:
                self.find(f"output {i}", "", (
                    f"'{fqn or '<root>'}' ({type(module).__name__}) computes its output {i} as "
                    f"{layout_of(computed)!r} where its style declares {own!r} ({mount.style!r}), so what "
                    "it hands on is read as other numbers than it holds; declare the layout it computes"),
                    where=fqn)
            layout = slot.out if slot is not None and not slot.untouched else own
            if layout is None:
                if not white:
                    self.set(x, Value(plain(x.shape), dtensor=True))
                continue
            dtensor = not mount.outputs.local
            whole = x.requires_grad and isinstance(layout, Replicate)
            grads = {f"the output of {fqn or '<root>'!r}"} if whole else ()
            if whole and white and sums_its_gradients(mount, module, args, kwargs):
                self.declared.update(grads)
            self.set(x, value_of(layout, tuple(x.shape), self.spaces, f"output {i} of {fqn!r}", dtensor=dtensor,
                                 grads=grads))
        self._note(fqn, out)

    def _note(self, fqn: str, out) -> None:
        if not self.inside:
            self.layouts.setdefault(fqn, []).append([layout_of(self.value(t)) for t in leaves(out)])


def _outputs(tracer: _Typing, out, n: int) -> list:
    """The model's output tensors: a partial sum among them is a finding (a shard is laid out as
    its style says, and noted by the caller)."""
    found = []
    for t in leaves(out):
        value = tracer.value(t)
        if value.partial:
            tracer.findings.append(Finding("", "output", "", (
                f"the model's output is a partial sum ({value.since}): each of the {n} ranks returns "
                "its own term, not the sum; all-reduce it before it leaves the model (prepare_out("
                "Replicate()) on the module that hands it on)")))
        found.append((tuple(t.shape), value))
    return found


def typed(model: nn.Module, mounts: dict, args: tuple, kwargs: dict, n: int = 2) -> Trace:
    """The ``Trace`` of one forward of ``model`` (a ``hybrid_copy``) under the plan's ``mounts``
    (``{fqn: Mount}``) on ``n`` ranks."""
    tracer = _Typing(model, mounts, n)
    handles = []
    for fqn, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(
            lambda m, a, k, fqn=fqn: tracer.pre(fqn, m, a, k), with_kwargs=True))
        handles.append(module.register_forward_hook(
            lambda m, a, k, o, fqn=fqn: tracer.post(fqn, m, a, k, o), with_kwargs=True, always_call=True))
    for x in [*args, *kwargs.values()]:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            tracer.set(x, Value(plain(x.shape), grads=frozenset({"the model's input"})))
    reads = rank_reads(tracer.rank) if asks_rank(model) else contextlib.nullcontext()
    try:
        with Hybrid(), tracer, reads:
            out = model(*args, **kwargs)
    except Exception as e:
        where, text = failing_module(e, model), (str(e).splitlines() or [""])[0]
        why = ("a forward that reads its weights' values cannot run without them; give example_inputs= "
               "it runs on, or check a plan by hand" if "meta" in text else
               "the check compares the ranks with the model on one device: a model that runs only on "
               "shards (a head count set to the local one by hand) has no one device's numbers; give "
               "it its global sizes, and hold them per rank with per_rank(...) in the plan")
        raise RuntimeError(
            f"check runs one forward of {type(model).__name__} on one device with its parameters on "
            f"the meta device, and it fails in {where or '<root>'!r}: {type(e).__name__}: {text} "
            f"({why})") from e
    finally:
        for h in handles:
            h.remove()
    outputs = _outputs(tracer, out, n)
    steps = {fqn for fqn, m in mounts.items() if trusted(tracer.modules[fqn], m)}
    return Trace(tracer.ops, tracer.findings, tracer.spaces, tracer.layouts, outputs, steps, tracer.arrivals)


def expected(value: Value, shape: tuple, spaces: Spaces, n: int) -> tuple | None:
    """The local shape on rank 0 of ``n`` of a value of global ``shape`` (DTensors: global;
    None: not known past a finding); a dim of copies (``expand``) is None: any number of them
    holds the same."""
    if not value.known:
        return None
    found = tuple(shape) if value.dtensor or value.partial or not held_spaces(value.dims) else \
        local_shape(value.dims, n, spaces.units)
    if value.dtensor:
        return found
    return tuple(None if dim and all(t == REPEAT for _, t in dim) else size
                 for size, dim in zip(found, value.dims))


def sums_its_gradients(mount, module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the module ``mount`` binds hands back every gradient it computes as a partial sum
    the plan sums: each input that needs one (``on_shards(..., grads=Partial())``) and each
    parameter (replicated, ``param_grads={name: Partial()}``). Its backward is linear in its
    output's gradient, so that gradient may be a partial sum too (a replicated output the ranks'
    shards each read a part of): the sums the plan makes of what it hands back are then right.

    >>> from tpfn import Partial, Replicate, Shard, on_shards, params, prepare_in
    >>> from tpfn.plans.plan import resolve
    >>> style = (prepare_in(Shard(-1), desired=Replicate(), local=True) >> params(weight=Replicate())
    ...          >> on_shards(Replicate(), grads=Partial(), output=Replicate(), param_grads={"weight": Partial()}))
    >>> linear = nn.Linear(8, 4, bias=False)
    >>> [mount] = resolve(style, linear)
    >>> sums_its_gradients(mount, linear, (torch.ones(2, 8, requires_grad=True),), {})
    True
    >>> [mount] = resolve(params(weight=Replicate()) >> on_shards(Replicate(), output=Replicate()), linear)
    >>> sums_its_gradients(mount, linear, (torch.ones(2, 8, requires_grad=True),), {})
    False
    """
    shards = mount.shards
    if shards is None:
        return False
    names = mount.names or ()
    for i, x in enumerate(args):
        if isinstance(x, torch.Tensor) and x.requires_grad and not (
                i < len(shards.grads) and isinstance(shards.grads[i], Partial)):
            return False
    for name, x in kwargs.items():
        i = names.index(name) if name in names else None
        if isinstance(x, torch.Tensor) and x.requires_grad and not (
                i is not None and i < len(shards.grads) and isinstance(shards.grads[i], Partial)):
            return False
    placed, partial = dict(mount.params), dict(shards.param_grads)
    return all(isinstance(placed.get(name), Replicate) and isinstance(partial.get(name), Partial)
               for name, p in module.named_parameters() if p.requires_grad)


def _draws(mount, module) -> bool:
    """Whether the bound module draws its random numbers on shards as its row declares (a stream of
    each rank's own, or dropout's slice of one device's noise)."""
    forward = mount.row.forward if mount.shards is not None else None
    return forward in (own_stream, dropout_slice) or forward is attention_on_heads and bool(module.dropout)
