"""The layout algebra: which collectives turn one layout into another, what each rank holds, what it costs.

Pure functions over layouts and shapes; no process group is involved.

- ``transition(src, dst)``: the program of steps that turns ``src`` into ``dst``, in the
  order DTensor's ``redistribute`` executes them. The empty program ``()`` is the identity.
- ``pullback(src, dst, grad)``: the program that the backward of that transition runs on a
  gradient that arrives with layout ``grad``.
- ``local_shape(global_shape, layout, mesh_shape, coord)``: the shape one rank holds
  (``torch.chunk``'s uneven rule), for ints and sympy expressions; ``shard_ranges``: which
  ranges of a sharded dim it holds (its chunk of every packed part, its group's heads).
- ``comm_bytes(steps, global_shape, mesh_shape, itemsize)``: bytes each rank sends, as a
  sympy expression, under the ring model.
- ``unpackable(name, shape, layout, n)``: why ``n`` ranks cannot hold packed parts or heads.

>>> transition(Shard(0), Replicate())
(AllGather(dim=0),)
>>> transition(Partial(), Shard(1))
(ReduceScatter(dim=1),)
>>> transition(Replicate(), Replicate())
()
>>> transition(Replicate(), Partial())
(Split(),)
>>> local_shape((7, 4), Shard(0), (2,), (1,))
(3, 4)
>>> comm_bytes(transition(Partial(), Replicate()), (1024,), (4,), itemsize=2)
3072
"""

from __future__ import annotations

import attrs
import sympy

from tpfn.layout import Partial, Replicate, Shard, as_layout, normalize, symbolic

__all__ = ["AllGather", "AllReduce", "ReduceScatter", "AllToAll", "Chunk", "Split", "Step", "transition",
           "chunk_bounds", "shard_ranges", "pullback", "cotangent", "local_shape", "comm_bytes",
           "check_layout", "contiguous_strides", "unpackable"]


def _short_repr(self) -> str:
    """The constructor call, leaving out fields at their default value."""
    parts = (f"{a.name}={getattr(self, a.name)!r}" for a in attrs.fields(type(self))
             if a.default is attrs.NOTHING or getattr(self, a.name) != a.default)
    return f"{type(self).__name__}({', '.join(parts)})"


def _step(collective: str | None, src, dst):
    """A step class: a step turns placement ``src(step)`` into ``dst(step)`` on one mesh dim, running
    ``collective`` (None: local); ``sharded_by`` lists the *other* mesh dims that shard the tensor
    meanwhile: the collective sees 1/prod(their sizes) of it."""
    def make(cls):
        cls.collective, cls.src, cls.dst = collective, property(src), property(dst)
        cls.__repr__ = _short_repr
        return attrs.frozen(slots=True, repr=False)(cls)
    return make


@_step("all_gather", lambda s: Shard(s.dim, s.parts), lambda s: Replicate())
class AllGather:
    """``Shard(dim, parts) -> Replicate()`` on ``mesh_dim``: every rank receives every chunk
    (``parts``: an int, or the sizes of unequal parts)."""

    dim: int
    parts: int | tuple = 1
    mesh_dim: int = 0
    sharded_by: tuple = ()


@_step("all_reduce", lambda s: Partial(s.op), lambda s: Replicate())
class AllReduce:
    """``Partial(op) -> Replicate()`` on ``mesh_dim``: every rank receives the reduction."""

    op: str = "sum"
    mesh_dim: int = 0
    sharded_by: tuple = ()


@_step("reduce_scatter", lambda s: Partial(s.op), lambda s: Shard(s.dim))
class ReduceScatter:
    """``Partial(op) -> Shard(dim)`` on ``mesh_dim``: every rank receives its chunk of the reduction."""

    dim: int
    op: str = "sum"
    mesh_dim: int = 0
    sharded_by: tuple = ()


@_step("all_to_all", lambda s: Shard(s.src_dim), lambda s: Shard(s.dst_dim))
class AllToAll:
    """``Shard(src_dim) -> Shard(dst_dim)`` on ``mesh_dim``: every rank trades chunks with every other."""

    src_dim: int
    dst_dim: int
    mesh_dim: int = 0
    sharded_by: tuple = ()


@_step(None, lambda s: Replicate(), lambda s: Shard(s.dim, s.parts))
class Chunk:
    """``Replicate() -> Shard(dim, parts)`` on ``mesh_dim``: every rank keeps its own chunk
    (of every part); no communication."""

    dim: int
    parts: int | tuple = 1
    mesh_dim: int = 0
    sharded_by: tuple = ()


@_step(None, lambda s: Replicate(), lambda s: Partial(s.op))
class Split:
    """``Replicate() -> Partial(op)`` on ``mesh_dim``: every rank keeps its term of the value
    (for ``"sum"`` the value divided by the mesh size; for ``"avg"``, ``"max"``, ``"min"``
    the value itself), as DTensor's ``Partial._partition_value``; no communication."""

    op: str = "sum"
    mesh_dim: int = 0
    sharded_by: tuple = ()


Step = (AllGather, AllReduce, ReduceScatter, AllToAll, Chunk, Split)


def check_layout(layout, *, name: str = "layout") -> tuple:
    """The layout as a tuple, rejecting one that mixes reductions (DTensor rejects them too).

    >>> check_layout((Partial("sum"), Partial("max")))
    Traceback (most recent call last):
    ...
    ValueError: 'layout' mixes Partial reductions (Partial(), Partial(op='max')): the order of a sum and a max matters, so DTensor rejects it; reduce one mesh dim first.
    """
    layout = as_layout(layout, name=name)
    ops = {p.op for p in layout if isinstance(p, Partial)}
    if len(ops) > 1:
        raise ValueError(f"'{name}' mixes Partial reductions {layout}: the order of a "
                         f"{' and a '.join(sorted(ops, reverse=True))} matters, so DTensor rejects it; "
                         "reduce one mesh dim first.")
    return layout


def _check_legal(src: tuple, dst: tuple) -> None:
    for i, (s, d) in enumerate(zip(src, dst)):
        if isinstance(d, Partial) and isinstance(s, Shard):
            raise ValueError(f"no transition turns {s!r} into {d!r} on mesh dim {i}: Partial values arise "
                             "only from computation (e.g. a matmul over a sharded dim) or from a replica "
                             "split into terms (Replicate() -> Partial()); a shard is neither. Ask for "
                             "Replicate() or Shard(dim) instead, or replicate it first.")
        if isinstance(d, Partial) and isinstance(s, Partial) and s != d:
            raise ValueError(f"no transition turns {s!r} into {d!r} on mesh dim {i}: terms pending a "
                             f"'{s.op}' reduction are not terms of a '{d.op}' reduction. Reduce first "
                             "(to Replicate() or Shard(dim)).")


def _make_steps(current: tuple, mesh_dim: int, target) -> tuple:
    cur = current[mesh_dim]
    others = tuple(j for j, p in enumerate(current) if j != mesh_dim and isinstance(p, Shard))
    where = dict(mesh_dim=mesh_dim, sharded_by=others)
    packed = any(isinstance(p, Shard) and p.parts != 1 for p in (cur, target))
    if isinstance(target, Partial):  # legal only from a replica (_check_legal)
        return (Split(op=target.op, **where),)
    if isinstance(target, Replicate):
        if isinstance(cur, Partial):
            return (AllReduce(op=cur.op, **where),)
        return (AllGather(dim=cur.dim, parts=cur.parts, **where),)
    chunk = (Chunk(dim=target.dim, parts=target.parts, **where),)
    if isinstance(cur, Replicate):
        return chunk
    if packed:  # as DTensor: through Replicate, the second step local
        return _make_steps(current, mesh_dim, Replicate()) + chunk
    if isinstance(cur, Partial):
        return (ReduceScatter(dim=target.dim, op=cur.op, **where),)
    return (AllToAll(src_dim=cur.dim, dst_dim=target.dim, **where),)


def transition(src, dst, *, ndim: int | None = None) -> tuple:
    """The steps that turn layout ``src`` into layout ``dst``, in execution order.

    Mirrors DTensor's ``redistribute``: on an N-D mesh, a tensor dim sharded on several mesh
    dims in a different nesting is first replicated from the innermost mesh dim outwards,
    then re-sharded from the outermost inwards. ``ndim``, when given, normalizes negative
    shard dims first (``Shard(-1)`` and ``Shard(1)`` are one placement of a 2-D tensor).

    >>> transition((Shard(0), Shard(0)), (Replicate(), Shard(0)))
    (AllGather(dim=0, mesh_dim=1, sharded_by=(0,)), AllGather(dim=0), Chunk(dim=0, mesh_dim=1))
    >>> transition(Replicate(), Partial())
    (Split(),)
    >>> transition(Shard(0), Partial())
    Traceback (most recent call last):
    ...
    ValueError: no transition turns Shard(dim=0) into Partial() on mesh dim 0: Partial values arise only from computation (e.g. a matmul over a sharded dim) or from a replica split into terms (Replicate() -> Partial()); a shard is neither. Ask for Replicate() or Shard(dim) instead, or replicate it first.
    """
    src, dst = check_layout(src, name="src"), check_layout(dst, name="dst")
    if len(src) != len(dst):
        raise ValueError(f"src {src} and dst {dst} are layouts of different meshes ({len(src)}-D and "
                         f"{len(dst)}-D): give one placement per mesh dim in both.")
    if ndim is not None:
        src, dst = normalize(src, ndim), normalize(dst, ndim)
    _check_legal(src, dst)
    heads = [p for s, d in zip(src, dst) if s != d for p in (s, d)
             if isinstance(p, Shard) and p.heads is not None]
    if heads:
        raise ValueError(f"{src} -> {dst}: no transition moves a tensor into or out of {heads[0]!r}: each "
                         "head is held by a group of ranks on more ranks than heads, which DTensor has no "
                         "placement for; hand the local shards on as the projection makes them.")
    if len(src) > 1 and any(isinstance(p, Shard) and p.parts != 1 for p in src + dst):
        raise ValueError(f"{src} -> {dst}: packed shards (parts > 1) are modelled on 1-D meshes only, "
                         "where tensor parallelism uses them; redistribute over one mesh dim at a time.")
    current, steps = list(src), []

    def move(mesh_dim, target):
        if current[mesh_dim] != target:
            steps.extend(_make_steps(tuple(current), mesh_dim, target))
            current[mesh_dim] = target

    if any(isinstance(p, Shard) for p in src) and len(src) > 1:
        for i in reversed(range(len(src))):
            target = dst[i]
            before = range(i)
            if isinstance(target, Shard) and ([j for j in before if current[j] == target]
                                              != [j for j in before if dst[j] == target]):
                target = Replicate()
            move(i, target)
    for i in range(len(src)):
        move(i, dst[i])
    return tuple(steps)


def cotangent(layout) -> tuple:
    """The layout a gradient takes back to a tensor laid out as ``layout``: Partial becomes Replicate.

    Each term of a reduction receives the whole gradient, as DTensor's ``from_local`` backward
    gives it; shards and replicas keep their placement.

    >>> cotangent((Partial(), Shard(0)))
    (Replicate(), Shard(dim=0))
    """
    return tuple(Replicate() if isinstance(p, Partial) else p for p in check_layout(layout))


def pullback(src, dst, grad=None, *, to=None, ndim: int | None = None) -> tuple:
    """The steps the backward of ``transition(src, dst)`` runs on a gradient with layout ``grad``.

    The gradient travels from ``grad`` (by default ``dst``) to ``to`` (by default
    ``cotangent(src)``). This is the duality law: with a Partial gradient, an all-gather pulls
    back to a reduce-scatter; a local chunk pulls back to an all-gather; an all-reduce pulls
    back to nothing. A split, its gradient whole (``cotangent(Partial())``), pulls back to
    nothing (DTensor's: the whole gradient), or, with ``to=Partial()`` (the replica's producer
    sums the terms of its gradient), to a split.

    >>> pullback(Shard(1), Replicate(), grad=Partial())
    (ReduceScatter(dim=1),)
    >>> pullback(Replicate(), Shard(0))
    (AllGather(dim=0),)
    >>> pullback(Partial(), Replicate())
    ()
    >>> whole = Replicate()
    >>> pullback(Replicate(), Partial(), whole), pullback(Replicate(), Partial(), whole, to=Partial())
    ((), (Split(),))
    """
    grad = dst if grad is None else grad
    land = cotangent(src)
    if to is not None:
        to = check_layout(to, name="to")
        if len(to) != len(land) or any(
                t != c and not (isinstance(t, Partial) and isinstance(c, Replicate))
                for t, c in zip(normalize(to, ndim) if ndim else to,
                                normalize(land, ndim) if ndim else land)):
            raise ValueError(f"a gradient of a tensor laid out {as_layout(src)} lands in {land} or, where "
                             f"it is replicated, as terms (Partial()); not in {to}.")
        land = to
    return transition(grad, land, ndim=ndim)


def chunk_bounds(n: int, k: int, c: int) -> tuple:
    """``(start, size)`` of chunk ``c`` when ``torch.chunk`` splits ``n`` items into ``k``.

    >>> [chunk_bounds(7, 2, c) for c in (0, 1)]
    [(0, 4), (4, 3)]
    """
    return min(c * -(-n // k), n), _chunk_size(n, k, c)


def _chunk_size(n, k, c):
    if not symbolic(n, k, c):
        q = -(-n // k)
        return max(0, min(n, (c + 1) * q) - c * q)
    n, k, c = sympy.sympify(n), sympy.sympify(k), sympy.sympify(c)
    if (n / k).is_integer:
        return n / k
    q = sympy.ceiling(n / k)
    return sympy.Max(0, sympy.Min(n, (c + 1) * q) - c * q)


def _head_chunks(placement: Shard, k: int, c: int) -> range:
    """The heads (``torch.chunk``s of the dim) that rank ``c`` of ``k`` holds."""
    h = placement.heads
    if symbolic(k, c):
        raise ValueError(f"{placement!r} on a symbolic number of ranks: whether they divide {h} heads or are "
                         "a multiple of them decides what each holds; give the number of ranks.")
    if h % k == 0:
        return range(c * (h // k), (c + 1) * (h // k))
    if k % h == 0:
        return range(c // (k // h), c // (k // h) + 1)
    raise ValueError(f"{placement!r} over {k} ranks: {k} neither divides the {h} heads nor is "
                     f"a multiple of them, so the ranks cannot hold whole heads; choose a "
                     f"number of ranks that divides {h} or is a multiple of it.")


def shard_ranges(size, placement: Shard, k: int, c: int) -> tuple:
    """``((start, size), ...)``: the ranges of a dim of ``size`` that rank ``c`` of ``k``
    holds under ``placement``, in the order it holds them (one per packed part).

    >>> shard_ranges(8, Shard(0), 2, 1)
    ((4, 4),)
    >>> shard_ranges(96, Shard(0, parts=(64, 16, 16)), 2, 1)
    ((32, 32), (72, 8), (88, 8))
    >>> [shard_ranges(16, Shard(0, heads=2), 4, c) for c in range(4)]
    [((0, 8),), ((0, 8),), ((8, 8),), ((8, 8),)]
    """
    if placement.heads is not None:
        heads = _head_chunks(placement, k, c)
        first = chunk_bounds(size, placement.heads, heads[0])[0]
        return ((first, sum(chunk_bounds(size, placement.heads, j)[1] for j in heads)),)
    out, offset = [], 0
    for part in placement.sizes(size):
        start, length = chunk_bounds(part, k, c)
        out.append((offset + start, length))
        offset += part
    return tuple(out)


def local_shape(global_shape, layout, mesh_shape, coord) -> tuple:
    """The shape of the tensor held at mesh coordinate ``coord``.

    Mesh dims apply in order, each splitting what the previous ones left by
    ``torch.chunk``'s rule (chunks of ``ceil(n / k)``, the last ones smaller or empty),
    as DTensor does; a packed dim splits each part so. Sizes, mesh sizes and coordinates
    may be sympy expressions (the number of ranks must be a number for ``heads=``).

    >>> local_shape((7,), Shard(0), (4,), (3,))
    (1,)
    >>> local_shape((96, 8), Shard(0, parts=(64, 16, 16)), (4,), (0,))
    (24, 8)
    >>> import sympy
    >>> s = sympy.Symbol("s", positive=True, integer=True)
    >>> local_shape((8 * s, 16), (Shard(0), Shard(1)), (2, 4), (0, 1))
    (4*s, 4)
    """
    layout = check_layout(layout)
    shape = list(global_shape)
    if not len(layout) == len(mesh_shape) == len(coord):
        raise ValueError(f"layout {layout}, mesh_shape {tuple(mesh_shape)} and coord {tuple(coord)} "
                         "must have one entry per mesh dim each.")
    for p, k, c in zip(normalize(layout, len(shape)), mesh_shape, coord):
        if isinstance(p, Shard) and p.heads is not None:
            shape[p.dim] = sum(length for _, length in shard_ranges(shape[p.dim], p, k, c))
        elif isinstance(p, Shard):
            shape[p.dim] = sum(_chunk_size(part, k, c) for part in p.sizes(shape[p.dim]))
    return tuple(shape)


_RING = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n / n,
}


def comm_bytes(steps, global_shape, mesh_shape, itemsize) -> sympy.Expr:
    """Bytes each rank sends to run ``steps``, as a sympy expression (ring model).

    With ``T`` the bytes of the tensor a collective assembles (the global tensor divided by
    the mesh dims that shard it besides the step's own) and ``n`` the size of the step's
    mesh dim: all-gather and reduce-scatter send ``(n-1)/n * T``, all-reduce ``2(n-1)/n * T``,
    all-to-all ``(n-1)/n`` of the local tensor ``T/n``; a local chunk sends nothing.
    Uneven shards count at their nominal ``T/n``.

    >>> import sympy
    >>> b, s, h, t = sympy.symbols("b s h t", positive=True)
    >>> comm_bytes(transition(Partial(), Replicate()), (b, s, h), (t,), 2)
    4*b*h*s*(t - 1)/t
    """
    numel = sympy.Mul(*map(sympy.sympify, global_shape))
    total = sympy.Integer(0)
    for step in (s for s in steps if s.collective is not None):  # a local step sends nothing
        n = sympy.sympify(mesh_shape[step.mesh_dim])
        divisor = sympy.Mul(*(sympy.sympify(mesh_shape[j]) for j in step.sharded_by))
        total += _RING[step.collective](n) * numel / divisor * itemsize
    return sympy.factor(total) if total.free_symbols else total


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``.

    >>> contiguous_strides((2, 3, 4))
    (12, 4, 1)
    """
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def unpackable(name: str, shape, layout, n: int) -> str | None:
    """Why ``n`` ranks cannot hold packed parts (or heads) of parameter ``name`` evenly (None: they can).

    Each rank holds its chunk of every part, so each part must split evenly over the ranks;
    unequal parts must add up to the dim; ``heads`` must split the dim into equal heads, on
    a number of ranks that divides them or is a multiple of them.

    >>> unpackable("gate_up.weight", (12, 8), Shard(0, parts=2), 4)
    "parameter 'gate_up.weight' packs 2 parts in dim 0 (12): each part (6) must split evenly over 4 ranks, so dim 0 must be a multiple of 8; pad each part, or choose a mesh size that divides 6."
    >>> unpackable("qkv.weight", (96, 8), Shard(0, parts=(64, 16, 16)), 32)
    "parameter 'qkv.weight' packs parts of 64, 16 and 16 in dim 0: the part of 16 does not split evenly over 32 ranks; pad each part to a multiple of 32, or choose a mesh size that divides every part."
    >>> unpackable("k.weight", (16, 8), Shard(0, heads=2), 3)
    "parameter 'k.weight' is 2 heads in dim 0, and 3 ranks neither divide them nor are a multiple of them, so no rank would hold whole heads; choose a mesh size that divides 2 or is a multiple of it."
    """
    if not isinstance(layout, Shard) or (layout.parts == 1 and layout.heads is None):
        return None
    dim = layout.dim % len(shape)
    if layout.heads is not None:
        heads = layout.heads
        if shape[dim] % heads:
            return (f"parameter {name!r} is {heads} heads in dim {dim}, but {shape[dim]} does not "
                    f"split into {heads} equal heads; give the number of heads its features are.")
        if heads % n and n % heads:
            return (f"parameter {name!r} is {heads} heads in dim {dim}, and {n} ranks neither "
                    f"divide them nor are a multiple of them, so no rank would hold whole heads; "
                    f"choose a mesh size that divides {heads} or is a multiple of it.")
        return None
    if isinstance(layout.parts, tuple):
        sizes = layout.parts
        listed = ", ".join(map(str, sizes[:-1])) + f" and {sizes[-1]}"
        if sum(sizes) != shape[dim]:
            return (f"parameter {name!r} has {shape[dim]} in dim {dim}, but parts={sizes!r} add "
                    f"up to {sum(sizes)}; give the sizes of the parts it packs (q, k and v "
                    "rows of a fused projection).")
        odd = next((size for size in sizes if size % n), None)
        if odd is None:
            return None
        return (f"parameter {name!r} packs parts of {listed} in dim {dim}: the part of {odd} "
                f"does not split evenly over {n} ranks; pad each part to a multiple of {n}, or "
                "choose a mesh size that divides every part.")
    parts = layout.parts
    if shape[dim] % (parts * n) == 0:
        return None
    if shape[dim] % parts:
        return (f"parameter {name!r} packs {parts} parts in dim {dim}, but {shape[dim]} does not "
                f"split into {parts} equal parts; give the number of parts it packs.")
    part = shape[dim] // parts
    return (f"parameter {name!r} packs {parts} parts in dim {dim} ({shape[dim]}): each part "
            f"({part}) must split evenly over {n} ranks, so dim {dim} must be a multiple of "
            f"{parts * n}; pad each part, or choose a mesh size that divides {part}.")
