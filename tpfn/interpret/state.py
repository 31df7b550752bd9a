"""What a parallelized model remembers: global shapes of local tensors, partial gradients.

``parallelize`` makes one ``State`` per call; every module it mounts shares it, and nothing
of it is shared with another model, mesh or process group (a deep copy of the model copies it).

Global shapes: seven positions on two ranks are 4 and 3, and from its local 4 alone rank 0
cannot tell 7 from 8. Every sharded local tensor that leaves a slot is remembered, by
identity and by local shape and layout. The next annotation of that very tensor recovers
its global shape exactly (``TENSOR_SHAPES``: a fact about that tensor, whichever model
handed it on). For any other sharded local tensor (a user's piece of a sequence, a
residual sum) rank 0's 4 could be 7 or 8: its global shape is a ``Guess`` (the most recent
one this model saw for that local shape, else an even split, as DTensor assumes), handed on
as a guess where nothing depends on it (a row-wise layer's input, whose sharded features its
output drops; a sequence-parallel norm's, whose output keeps the guess), and made exact
where something does (a move, a DTensor, one device's dropout noise): from the tensor a slot
handed on that it was computed from, a few autograd nodes back (``derived_shape``: a
residual sum), else by an exchange of the ranks' local shapes (``tpfn.interpret.agree``,
one all-gather of a few ints). Every rank decides alike, since whether a tensor is one a
slot handed on, how sure its shape is and the autograd graph are the same on every rank.
Compiled code neither reads nor writes the memory nor exchanges shapes (a graph would be
specialized on them): there, sharded local tensors are even splits.

Partial gradients: a replicated parameter used on sharded activations (a sequence-parallel
norm, a per-head norm) gets a partial gradient. Left so, every optimizer op on it would
all-reduce it again (Adam: three times per parameter per step). Such parameters are
``watch``-ed by their bound module's runtime (``PartialGrads``), by module and name, looked up
afresh each time (what ``Module._apply``, ``to_empty`` or ``load_state_dict(assign=True)``
puts in their place is watched too, frozen or not), and the bound modules' outputs are
``arm``-ed as a forward makes them (compiled
code arms none: there the hook ``watch`` put on each parameter serves, until a swap drops
it). A backward that reaches an armed output sums, at its end, every watched partial
gradient of every model it reached: one all-reduce of one flat buffer per process group,
placements and dtype, however many ``parallelize`` calls (a block each) made those models,
and the optimizer sees replicated gradients. What a backward will sum is kept for that
backward alone, keyed by its graph task and held by the engine: a backward that fails takes
it along, and the next one sums whatever is partial then. Accumulating a second backward's
partial gradient onto a summed one first hands the summed one back as a partial sum
(``_accumulating``), so that it too is one bulk all-reduce; ``autograd.grad`` accumulates
nothing and sums nothing. In invariant mode (``tree``) the ranks' partial gradients, each the root
of its subtree (``tpfn.interpret.invariant``), are added by the canonical tree (``tpfn.tree``):
all-gathered, then added in its order; a summed gradient a second backward accumulates onto is
set aside and added to the new sum after it (``_set_aside``), as one rank adds it.
"""

from __future__ import annotations

import collections
import copy
import functools
import weakref

import torch
from torch.autograd.graph import get_gradient_edge
from torch.distributed.tensor import DTensor, Replicate

from tpfn._torch import (DTensorSpec, WeakTensorKeyDictionary, all_reduced, graph_task_id, local_tensor, parameter,
                         per_rank, queue_callback, rank_sizes, spec_of)
from tpfn.bounded import all_reduce, collective, tree_sum
from tpfn.errors import LayoutError
from tpfn.interpret.agree import agreed_shape
from tpfn.interpret.moves import unhooked

__all__ = ["State", "Shapes", "PartialGrads", "TENSOR_SHAPES", "Guess", "recall", "derived_shape"]

TENSOR_SHAPES = WeakTensorKeyDictionary()
"""local tensor -> (key, global shape), for the local tensors that slots handed on."""


def _key(local, placements: tuple, n: int) -> tuple:
    return rank_sizes(local.shape), placements, n


def _sharded(placements: tuple) -> bool:
    for p in placements:
        if p.is_shard():
            return True
    return False


def _even(local, placements: tuple, n: int) -> tuple:
    shape = list(local.shape)
    for p in placements:
        if p.is_shard():
            shape[p.dim] *= n
    return tuple(shape)


class Guess(tuple):
    """A global shape taken from this rank's local shape alone (other ranks may guess another)."""


def recall(local, placements: tuple, mesh, table=None, what: str | None = None,
           exact: bool = False, timeout: float | None = None) -> tuple:
    """The global shape of ``local`` if a slot handed it on; else (a ``Guess``) the one
    ``table`` (a model's ``Shapes.table``) last saw for its local shape, else the even split.
    ``exact``, with ``what`` naming the slot: never a guess, on a mesh of several real ranks
    the one their local shapes make (an exchange waiting ``timeout`` seconds at most),
    remembered for ``local`` (every rank asks alike)."""
    n = mesh.size() if _sharded(placements) else 1
    if n == 1:  # whole on every rank
        return tuple(local.shape)
    if torch.compiler.is_compiling():
        return _even(local, placements, n)
    key = _key(local, placements, n)
    mine = TENSOR_SHAPES.get(local)
    if mine is not None and mine[0] == key and not (exact and isinstance(mine[1], Guess)):
        return mine[1]
    if exact and what is not None:
        found = derived_shape(local)
        if found is not None and found[0] == key:  # as an elementwise op keeps local shapes
            return found[1]
        if found is not None:  # a graph that every rank has: no rank exchanges
            raise LayoutError(
                f"{what}: the global shape of this sharded local tensor is unknown: it is "
                f"computed from one of local shape {found[0][0]} (global {found[1]}) but has "
                f"local shape {key[0]}; hand it on as a DTensor (DTensor.from_local(x, mesh, "
                "placements, shape=...)), or lay it out with prepare_out(...) where it is made.")
        shape = agreed_shape(local, placements, mesh, what, timeout)
        if shape is not None:
            TENSOR_SHAPES[local] = (key, shape)
            return shape
    return Guess(table[key] if table is not None and key in table else _even(local, placements, n))


_DEPTH = 6  # autograd nodes walked back from a tensor to one a slot handed on, hooks aside
_NODE_KEY = "tpfn global shapes"  # in an autograd node's metadata: output number -> (key, shape)


def derived_shape(local) -> tuple | None:
    """``(key, global shape)`` of the sharded local tensor a slot handed on that ``local`` was
    computed from (a residual sum, a norm's output): the nearest among its autograd inputs,
    ``_DEPTH`` nodes back, breadth first, else None (no graph, or none near). Which one is
    found depends on the graph alone, the same on every rank."""
    level, seen = [unhooked(local.grad_fn, local.output_nr)], set()
    for _ in range(_DEPTH):
        level = [(n, i) for n, i in level if n is not None and id(n) not in seen
                 and not seen.add(id(n))]
        for node, nr in level:
            found = node.metadata.get(_NODE_KEY, {}).get(nr) if node.metadata else None
            if found is not None:
                return found
        level = [unhooked(n, i) for node, _ in level for n, i in node.next_functions]
    return None


class Shapes:
    """Global shapes by tensor, then by (local shape, torch placements, mesh size), the last 64;
    an exchange of local shapes waits ``timeout`` seconds at most."""

    def __init__(self, size: int = 64, timeout: float | None = None):
        self.size, self.table, self.timeout = size, collections.OrderedDict(), timeout

    def remember(self, local, placements: tuple, global_shape, mesh) -> None:
        if not _sharded(placements) or torch.compiler.is_compiling():
            return  # whole on every rank; or compiled (a graph would guard on the memory)
        n = mesh.size()
        if n > 1:  # one rank: all whole
            key = _key(local, placements, n)
            shape = global_shape if type(global_shape) is tuple else (
                Guess(global_shape) if isinstance(global_shape, Guess) else tuple(global_shape))
            TENSOR_SHAPES[local] = (key, shape)
            if local.grad_fn is not None and not isinstance(shape, Guess):
                local.grad_fn.metadata.setdefault(_NODE_KEY, {})[local.output_nr] = (key, shape)
            self.table[key] = tuple(shape)
            self.table.move_to_end(key)
            while len(self.table) > self.size:
                self.table.popitem(last=False)

    def recall(self, local, placements: tuple, mesh, what: str, exact: bool = False) -> tuple:
        """The global shape of ``local`` arriving at the slot ``what``: ``recall`` with this table."""
        return recall(local, placements, mesh, self.table, what, exact, self.timeout)


@per_rank  # LocalTensorMode: each simulated rank its own coordinates
def _on_first(local, *coordinate):
    """``local`` on the rank whose ``coordinate`` is all zeros, zeros on every other rank."""
    return local if all(c == 0 for c in coordinate) else torch.zeros_like(local)


def _partial(grad) -> bool:
    return isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements)


def _parameter(ref, name: str):
    """The parameter ``name`` of the module ``ref`` refers to now, or None (the module freed,
    or the parameter gone)."""
    module = ref()
    try:
        return None if module is None else parameter(module, name)
    except (AttributeError, KeyError):
        return None


_HOOKED = "tpfn partial grads"  # in an AccumulateGrad node's metadata: _accumulating is on


def _accumulating(param, grads) -> None:
    """Before a partial gradient is added to a replicated one (an earlier backward's, reduced),
    hand the replicated one back as a partial sum (kept on the first rank, zeros elsewhere: no
    communication), so the two add up locally and are reduced once more, in bulk."""
    old, new = param.grad, grads[0]
    if not (isinstance(old, DTensor) and _partial(new) and old.device_mesh == new.device_mesh):
        return
    dims = [i for i, (o, n) in enumerate(zip(old.placements, new.placements))
            if o.is_replicate() and n.is_partial("sum")]
    if dims:
        coordinate = old.device_mesh.get_coordinate()
        placements = tuple(new.placements[i] if i in dims else p for i, p in enumerate(old.placements))
        local = _on_first(old.to_local(), *(coordinate[i] for i in dims))
        param.grad = DTensor.from_local(local, old.device_mesh, placements, run_check=False,
                                        shape=old.shape, stride=old.stride())


class PartialGrads:
    """Watched parameters (a bound module's, or a model's): a backward that reaches one of its
    armed tensors sums their partial gradients at its end (``_EndOfBackward``), waiting
    ``timeout`` seconds at most; ``tree``: by the canonical tree (invariant mode). It holds its
    modules weakly; a deep copy of it, made with a deep copy of its modules, watches the copies."""

    def __init__(self, timeout: float | None = None, tree: bool = False):
        self.watched: list = []  # (module's weak reference, name, fqn)
        self.timeout, self.tree = timeout, tree

    def __deepcopy__(self, memo) -> "PartialGrads":
        copied = memo[id(self)] = PartialGrads(self.timeout, self.tree)
        copied.watched = [(weakref.ref(copy.deepcopy(ref(), memo)), name, fqn)
                          for ref, name, fqn in self.watched if ref() is not None]
        return copied

    def watch(self, module, name: str, fqn: str | None = None) -> None:
        """Watch the parameter ``name`` (dotted) of ``module``, called ``fqn`` in the model,
        whatever its ``requires_grad``, looked up afresh each time: what replaces it
        (``Module._apply``, ``to_empty``, ``load_state_dict(assign=True)``) is watched in its
        place. The parameter is armed too if it requires grad (compiled code arms no output; a
        swap loses that hook)."""
        self.watched.append((weakref.ref(module), name, name if fqn is None else fqn))
        param = _parameter(self.watched[-1][0], name)
        if param is not None and param.requires_grad:
            param.register_hook(self._reached)

    @property
    def fqns(self) -> tuple:
        """The names of the watched parameters that require grad now."""
        return tuple(fqn for param, fqn in self.params() if param.requires_grad)

    def params(self):
        """``(parameter, fqn)`` of every watched parameter there is now."""
        for ref, name, fqn in self.watched:
            param = _parameter(ref, name)
            if param is not None:
                yield param, fqn

    def arm(self, output) -> None:
        """Make every backward that reaches ``output`` (a tensor, or a tuple, list or dict of
        them: a bound module's output) sum this model's partial gradients once, at its end.
        Compiled code arms nothing (a graph would break on the hook)."""
        if torch.compiler.is_compiling():
            return
        if isinstance(output, torch.Tensor):
            if output.requires_grad:
                output.register_hook(self._reached)
        elif isinstance(output, (tuple, list)):
            for x in output:
                self.arm(x)
        elif isinstance(output, dict):
            for x in output.values():
                self.arm(x)

    def _reached(self, grad) -> None:
        _EndOfBackward.running().join(self)

    def _hook_accumulation(self) -> None:
        """Put ``_accumulating`` before the gradient accumulation of each watched parameter
        that requires grad (once per AccumulateGrad node: a swapped parameter gets a new one)."""
        for param, _ in self.params():
            if param.requires_grad:
                node = get_gradient_edge(param).node
                if _HOOKED not in node.metadata:
                    node.metadata[_HOOKED] = True
                    node.register_prehook(functools.partial(_set_aside if self.tree else _accumulating, param))


_RUNNING = weakref.WeakValueDictionary()
"""graph task id -> its ``_EndOfBackward``, while the engine holds it (a failed backward's
goes with the backward)."""


class _EndOfBackward:
    """What one backward sums at its end: the partial gradients of every model it reached,
    one all-reduce of one flat buffer per process group(s), placements and dtype."""

    def __init__(self):
        self.models: list = []
        self.aside: dict = {}  # id(parameter) -> its summed gradient, set aside (invariant mode)

    @classmethod
    def running(cls) -> "_EndOfBackward":
        """The running backward's, queued to run at its end the first time it is asked for."""
        task = graph_task_id()
        end = _RUNNING.get(task)
        if end is None:
            end = _RUNNING[task] = cls()
            queue_callback(end)
        return end

    def join(self, model: PartialGrads) -> None:
        if all(m is not model for m in self.models):
            self.models.append(model)
            model._hook_accumulation()

    def __call__(self) -> None:
        buckets, seen = {}, set()
        for model in self.models:  # in the order the backward reached them: alike on every rank
            for param, fqn in model.params():
                grad = param.grad
                if _partial(grad) and id(param) not in seen:
                    seen.add(id(param))
                    groups = tuple(map(id, param.device_mesh.get_all_groups()))
                    buckets.setdefault((groups, grad.placements, grad.dtype, model.tree), []).append((param, fqn))
        timeouts = [m.timeout for m in self.models if m.timeout is not None]
        for (_, placements, _, tree), params in buckets.items():
            _reduce(params, placements, max(timeouts, default=None), tree, self.aside)


def _set_aside(param, grads) -> None:
    """Invariant mode's ``_accumulating``: before a partial gradient is added to a summed one,
    set the summed one aside (the parameter then takes the partial one alone), to be added to
    the new sum at the end of the backward: ``old + (sum of the ranks')``, as one rank adds."""
    old, new = param.grad, grads[0]
    if isinstance(old, DTensor) and _partial(new) and not _partial(old):
        _EndOfBackward.running().aside[id(param)] = old
        param.grad = None


def _reduce(params: list, placements: tuple, timeout: float | None, tree: bool = False,
            aside: dict | None = None) -> None:
    """Sum the partial gradients of ``params`` (``(parameter, fqn)``, one mesh, ``placements``
    and dtype) in one all-reduce of one flat buffer per partial mesh dim, each waiting
    ``timeout`` seconds at most, on the parameters' own mesh (a gradient an op made may name
    another mesh over the same ranks: DTensor's caches ignore the process group). ``tree``: by
    the canonical tree, and each gradient ``aside`` (by parameter) added to its sum after."""
    grads = [p.grad for p, _ in params]
    mesh = params[0][0].device_mesh
    flat = torch.cat([local_tensor(g).reshape(-1) for g in grads])
    names = ", ".join(sorted(fqn for _, fqn in params))
    for dim, placement in enumerate(placements):
        if placement.is_partial() and mesh.size(dim) > 1:
            with collective(f"the all-reduce of the partial gradients of {names} at the "
                            "end of the backward", mesh, timeout, dim) as bound:
                if tree:  # (invariant mode's gradients live on the 1-D mesh)
                    flat = tree_sum(flat, mesh, bound)
                elif type(flat) is torch.Tensor and flat.device.type != "meta":
                    flat = all_reduce(flat, "sum", bound, own=True)  # (the bucket torch.cat made)
                else:  # a simulated rank's (LocalTensorMode) or a dry run's
                    flat = all_reduced(flat, "sum", (mesh, dim))
    replicated = tuple(Replicate() if p.is_partial() else p for p in placements)
    pieces = flat.split([local_tensor(g).numel() for g in grads])
    for (param, _), grad, piece in zip(params, grads, pieces):
        spec = DTensorSpec(mesh, replicated, tensor_meta=spec_of(grad).tensor_meta)
        old, local = aside.pop(id(param), None) if tree else None, piece.view(local_tensor(grad).shape)
        param.grad = DTensor(local if old is None else local_tensor(old) + local, spec, requires_grad=False)


class State:
    """What one ``parallelize`` call's modules share: shape memory, the ``Bound`` their
    collectives wait with (``tpfn.bounded``; None: their group's), the ``observer`` that
    sees each bound module's slots (None: none; ``tpfn.explain`` sets one), and ``tree``, the
    chunks of invariant mode's canonical tree (``tpfn.tree``; None: the default mode)."""

    def __init__(self, bound=None, tree: int | None = None):
        self.shapes = Shapes(timeout=None if bound is None else bound.seconds)
        self.bound, self.observer, self.tree = bound, None, tree
