"""Every collective tpfn issues waits a bounded time; one that ends badly names what it served and who is missing.

A rank that raises, dies or runs another program leaves the others waiting in their next
collective for as long as the process group allows (30 minutes on gloo by default, 10 on NCCL),
then failing with the backend's words alone. tpfn bounds each of its collectives by a ``Bound``
of ``seconds``: ``parallelize(..., timeout=)``'s for a model's collectives, else the process
group's own timeout, at most ``DEFAULT``, 10 minutes (NCCL's default). A collective waits for the
last rank to reach it; in a tensor-parallel step every rank runs the same program on the same
batch, so that skew is small, while work one rank does alone between steps (writing a
checkpoint, an evaluation) can take minutes: give it longer with ``timeout=``.

How, on any backend: each collective is issued with the bound as its own timeout. gloo takes it
per operation (its options' ``timeout``); NCCL reads it from the group's options as it makes the
work (the watchdog's deadline), so where torch issues collectives on tpfn's behalf (DTensor's
redistributions, torch.distributed.checkpoint) the group's timeout is the bound while they are
issued (``collective``, ``Bound.issuing``), and is put back after. On NCCL a wait only orders
streams: the watchdog ends a collective at the bound (and by default the process).

On gloo, whose wait blocks the host, tpfn waits in slices (``Work.wait(timeout)``, at most a
second): a collective that completes in the first costs what a plain wait costs. Past the first,
the rank writes in the group's store that it waits at its k-th collective, and reads whether
another rank raised just before its own k-th (tpfn's entry points ``announce`` an error they
raise; a rank that goes on takes it back as it issues its next collective): once that error has
stood for ``PATIENCE``, the wait ends, naming it. At the bound, or where the backend fails (a
peer's connection closed), the ``CollectiveError`` names the collective, what it served and the
ranks that had not reached it (those the store does not show waiting there).

A process group whose collective timed out is unusable after it (gloo closes its connections):
end the job, or go on with a new group.

>>> from torch.distributed.device_mesh import init_device_mesh
>>> mesh = init_device_mesh("cpu", (1,))
>>> bound = Bound(mesh.get_group(), "cpu", 3.0)
>>> bound.seconds, all_reduce(torch.ones(2), "max", bound).tolist()
(3.0, [1.0, 1.0])
"""

from __future__ import annotations

import contextlib
import datetime
import math
import re
import time

import torch
import torch.distributed as dist
from torch.distributed import tensor as _dt

from tpfn._torch import (DTensorSpec, TensorMeta, all_gather_into, all_reduced, all_to_all, all_to_all_into, backend_of,
                         backend_timeout, collective_options, collectives_issued, group_store,
                         redistribute_local_tensor, reduce_scatter_into, set_backend_timeout)
from tpfn.algebra import AllGather, AllReduce, Chunk, ReduceScatter, Split, chunk_bounds, contiguous_strides
from tpfn.errors import CollectiveError
from tpfn.layout import to_torch
from tpfn.tree import total

__all__ = ["DEFAULT", "seconds", "Bound", "Stalled", "failed", "collective", "announce", "all_reduce",
           "all_gather", "tree_sum", "tree_scatter", "barrier", "RUN", "TREE", "run"]

DEFAULT = 600.0
"""Seconds a collective waits at most where neither ``timeout=`` nor a shorter group timeout says."""

PATIENCE = 3.0
"""Seconds another rank's error must stand (that rank not going on) before a wait for it ends."""

_TOLD: list = []  # (store, key) of the errors this rank told of, until it issues its next collective

_REAL = ("gloo", "nccl")  # backends whose ranks are other processes
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def seconds(timeout) -> float | None:
    """``timeout`` (seconds, a ``datetime.timedelta``, or None) as seconds, checked."""
    if timeout is None:
        return None
    value = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"'timeout' must be a positive number of seconds or a datetime.timedelta (got "
                         f"{timeout!r}); e.g. timeout=60.")
    return float(value)


class Stalled(RuntimeError):
    """A collective that did not complete: ``cause`` (the backend's words, or the bound passed),
    ``raised`` (``(rank, error)`` of a rank that raised just before reaching it, or None) and
    ``missing`` (the ranks that had not reached it; None where that cannot be known)."""

    def __init__(self, cause: str, raised=None, missing=None):
        super().__init__(cause)
        self.cause, self.raised, self.missing = cause, raised, missing


class Bound:
    """How long tpfn's collectives on process ``group`` (its backend for ``device``) wait:
    ``seconds`` (``timeout``; None: the group's own timeout, at most ``DEFAULT``). See the
    module docstring."""

    __slots__ = ("group", "seconds", "delta", "backend", "sliced", "slice", "stamped", "store", "rank", "made")

    def __init__(self, group, device: str = "cpu", timeout: float | None = None):
        backend = backend_of(group, device)
        real = backend is not None and backend.name() in _REAL
        own = backend_timeout(backend) if real else None
        self.seconds = timeout if timeout is not None else \
            min(own.total_seconds() if own is not None else DEFAULT, DEFAULT)
        self.group, self.delta, self.backend = group, datetime.timedelta(seconds=self.seconds), backend if real else None
        self.sliced = real and backend.name() == "gloo"  # a wait that blocks the host
        self.stamped = real and not self.sliced  # the work's deadline read from the group's options
        self.slice = datetime.timedelta(seconds=min(1.0, self.seconds / 4))
        self.store, self.rank, self.made = group_store(group) if real else None, group.rank(), {}

    def options(self, kind: str, **fields):
        """The options of a ``kind`` of collective issued with the bound (``collective_options``),
        made once."""
        key = (kind, *fields.items())
        found = self.made.get(key)
        if found is None:
            found = self.made[key] = collective_options(kind, self.delta, **fields)
        return found

    def issue(self, op, *args):
        """``op(*args)``, a collective issued with the bound as its own timeout where the backend
        reads it from the group (NCCL); gloo takes it from the options in ``args``."""
        if _TOLD:  # this rank goes on after an error it told of: it is no longer stopped there
            _retract()
        if not self.stamped:
            return op(*args)
        with self.issuing():
            return op(*args)

    @contextlib.contextmanager
    def issuing(self):
        """Inside, collectives issued on the group without options of their own (DTensor's,
        torch.distributed.checkpoint's) take the bound as their timeout."""
        backend = self.backend
        if _TOLD:
            _retract()
        if backend is None:
            yield
            return
        before = backend_timeout(backend)
        set_backend_timeout(backend, self.delta)
        try:
            yield
        finally:
            set_backend_timeout(backend, before)

    def wait(self, work) -> None:
        """Wait for ``work``; a ``Stalled`` error where it fails, passes the bound, or another
        rank raised before reaching it and has not gone on for ``PATIENCE`` (at most a quarter
        of the bound)."""
        if not self.sliced:
            work.wait()
            return
        try:
            if self._slice(work):
                return
        except RuntimeError as error:
            raise self.blame(error) from error
        start, k = time.monotonic() - self.slice.total_seconds(), self._issued()
        self._post("at", k)
        seen = None  # since when another rank's error has stood
        while True:
            raised = self._raised(k)
            seen = None if not raised else seen or time.monotonic()
            if seen is not None and time.monotonic() - seen >= min(PATIENCE, self.seconds / 4):
                raise Stalled(raised[1], raised)
            if time.monotonic() - start >= self.seconds and not work.is_completed():  # (done while read)
                raise Stalled(f"it did not complete within {self.seconds:g} s", None, self._missing(k))
            try:
                if self._slice(work):
                    return
            except RuntimeError as error:
                raise self.blame(error, k) from error

    def _slice(self, work) -> bool:
        """Wait for ``work`` a slice: True where it completed, False where it still runs; the
        backend's error where it failed. A slice that ends as the collective completes raises
        the slice's "timed out" although the work is done: its own wait then says which."""
        try:
            work.wait(self.slice)
            return True
        except RuntimeError:
            if not work.is_completed():
                return False
        work.wait(self.slice)  # (done: returns at once, or raises the work's own error)
        return True

    def blame(self, error: BaseException, k: int | None = None) -> Stalled:
        """``error``, the backend's failure of this rank's ``k``-th collective on the group (by
        default the last one issued), as a ``Stalled`` naming who raised or was missing."""
        if isinstance(error, Stalled):
            return error
        k = self._issued() if k is None else k
        raised, words = self._raised(k), _words(error)
        if re.search(r"timed out", words, re.IGNORECASE):  # gloo's words for its own deadline, which vary
            words = f"it did not complete within {self.seconds:g} s"
        return Stalled(words, raised, None if raised else self._missing(k))

    def __deepcopy__(self, memo) -> "Bound":  # (a deep copy of a model waits alike, on the same group)
        return self

    def _issued(self) -> int | None:
        """How many collectives this rank has issued on the group (None: where nothing can tell)."""
        return None if self.store is None else collectives_issued(self.group)

    def _post(self, kind: str, value) -> None:
        if value is None:
            return
        with contextlib.suppress(Exception):  # (a store gone with the rank that held it)
            self.store.set(f"tpfn/{kind}/{self.rank}", str(value))

    def _read(self, kind: str, rank: int) -> str | None:
        key = f"tpfn/{kind}/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _raised(self, k: int):
        """``(global rank, error)`` of a rank that raised after its (k-1)-th collective on the
        group, so never issues the k-th this rank waits in (None: none did, or nothing can tell)."""
        if k is None:
            return None
        try:
            for rank in range(self.group.size()):
                told = self._read("raised", rank) if rank != self.rank else None
                if told is not None and told.split(" ", 1)[0] == str(k - 1):
                    return _global(self.group, rank), told.split(" ", 1)[1]
        except Exception:  # noqa: BLE001 (a store gone: nothing to read)
            return None
        return None

    def _missing(self, k: int) -> list | None:
        """The global ranks that had not reached this rank's k-th collective on the group, as
        the store says after a slice's grace (None: the store cannot say)."""
        if k is None:
            return None
        self._post("at", k)
        deadline = time.monotonic() + self.slice.total_seconds()
        try:
            while True:
                missing = [rank for rank in range(self.group.size())
                           if rank != self.rank and self._read("at", rank) != str(k)]
                if not missing or time.monotonic() > deadline:
                    return [_global(self.group, rank) for rank in missing]
                time.sleep(0.05)
        except Exception:  # noqa: BLE001
            return None


def _global(group, rank: int) -> int:
    try:
        return dist.get_global_rank(group, rank)
    except (RuntimeError, ValueError, KeyError):  # a group c10d does not know (a private one)
        return rank


def _words(error: BaseException) -> str:
    """The first sentence of a backend's error, without gloo's source location."""
    line = re.sub(r"^\[[^\]]*\] ", "", (str(error).splitlines() or [type(error).__name__])[0])
    return line.split(". ")[0].rstrip(".")


def _listed(ranks: list) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def failed(what: str, error: BaseException, bound: Bound) -> CollectiveError:
    """The error of a collective that served ``what`` and failed with ``error`` on this rank."""
    me = dist.get_rank() if dist.is_initialized() else bound.rank
    stalled = bound.blame(error)
    longer = (f"each waits at most {bound.seconds:g} s: parallelize(..., timeout=...), else the process "
              "group's timeout, at most 10 minutes")
    if stalled.raised:
        rank, told = stalled.raised
        return CollectiveError(f"rank {me}: {what} stopped: rank {rank} raised before reaching it ({told}). "
                               f"Fix that error (rank {rank}'s own traceback says where); every rank then runs alike.")
    if stalled.missing:
        who = _listed(stalled.missing)
        return CollectiveError(f"rank {me}: {what} failed: {stalled.cause}; {who} had not reached it. Find why in "
                               f"the output of {who} (an error, a hang, another program); if only slower, give the "
                               f"ranks longer ({longer}).")
    return CollectiveError(f"rank {me}: {what} failed: {stalled.cause}. Another rank has most likely failed (its own "
                           f"error says why) or runs another plan; see its output ({longer}).")


@contextlib.contextmanager
def collective(what: str, mesh=None, timeout: float | None = None, dim: int = 0):
    """Inside, the collectives on the process group of ``mesh``'s dim ``dim`` (no mesh: the
    default group) wait ``timeout`` seconds at most (None: the group's timeout, at most
    ``DEFAULT``), and one that fails raises a ``CollectiveError`` naming ``what`` it served
    (``"cross_entropy's all-reduce of the per-token maxima"``). Yields the group's ``Bound``."""
    group = dist.group.WORLD if mesh is None else mesh.get_group(dim)
    bound = Bound(group, "cpu" if mesh is None else mesh.device_type, timeout)
    try:
        with bound.issuing():
            yield bound
    except CollectiveError:
        raise
    except RuntimeError as error:
        raise failed(what, error, bound) from error


def announce(error: BaseException, bound: Bound | None) -> None:
    """Tell the other ranks of ``bound``'s group that this rank raised ``error`` (once per
    error), so that a collective one of them waits in ends at once, naming it."""
    if bound is None or bound.store is None or isinstance(error, (CollectiveError, Stalled)) \
            or getattr(error, "_tpfn_told", False):
        return
    k, line = bound._issued(), (str(error).splitlines() or [""])[0].rstrip(".")
    if k is None:
        return
    bound._post("raised", f"{k} {type(error).__name__}: {line}")
    _TOLD.append((bound.store, f"tpfn/raised/{bound.rank}"))
    with contextlib.suppress(AttributeError, TypeError):
        error._tpfn_told = True


def _retract() -> None:
    """Take back the errors this rank told of: it issues collectives again (it caught them).
    The key is emptied, never deleted: another rank may be between seeing it and reading it,
    and a read of a deleted key waits for the store's timeout."""
    while _TOLD:
        store, key = _TOLD.pop()
        with contextlib.suppress(Exception):
            store.set(key, "")


# --- the plain collectives: one c10d collective each, waited with the bound ------------------


def _done(out: torch.Tensor, work, bound: Bound, wait: bool, then=None):
    """``out`` once ``work`` is done (``then(out)`` where given); ``wait=False``: a function
    that waits and returns it, the collective left running meanwhile."""
    def finish():
        bound.wait(work)
        return out if then is None else then(out)
    return finish() if wait else finish


def all_reduce(x: torch.Tensor, op: str, bound: Bound, wait: bool = True, *, own: bool = False):
    """The ranks' ``x`` reduced with ``op`` (``"sum"``, ``"max"``), a new tensor; ``own``: a
    contiguous buffer the caller made, reduced where it lies."""
    if not _plain(x):  # simulated ranks' (LocalTensorMode), a dry run's
        out = all_reduced(x, op, bound.group)
        return out if wait else lambda: out
    out = x if own and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    options = bound.options("allreduce", reduceOp=_OPS[op])
    return _done(out, bound.issue(bound.group.allreduce, [out], options), bound, wait)


def all_gather(x: torch.Tensor, dim: int, n: int, bound: Bound, wait: bool = True):
    """The ranks' ``x`` concatenated along ``dim``."""
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # rank-major, as the collective fills it
    then = None
    if dim != 0:
        shape = list(x.shape)
        shape[dim] *= n
        then = lambda out: out.view(n, *x.shape).movedim(0, dim).reshape(shape)  # noqa: E731
    return _done(out, bound.issue(all_gather_into, out, x, bound.group, bound.options("allgather")), bound, wait, then)


def _reduce_scatter(x: torch.Tensor, dim: int, n: int, bound: Bound, wait: bool = True):
    """This rank's chunk along ``dim`` of the sum of the ranks' ``x``."""
    shape = list(x.shape)
    shape[dim] //= n
    if dim != 0:  # the chunks rank-major, as the collective reads them
        x = x.unflatten(dim, (n, shape[dim])).movedim(dim, 0)
    x = x.contiguous()
    out = x.new_empty(shape)
    flat = x.reshape(n * shape[0], *shape[1:])
    options = bound.options("reduce_scatter")
    return _done(out, bound.issue(reduce_scatter_into, out, flat, bound.group, options), bound, wait)


def _plain(x: torch.Tensor) -> bool:
    """Whether ``x`` goes to the process group itself (else: simulated ranks, a dry run's meta tensors)."""
    return type(x) is torch.Tensor and x.device.type != "meta"


def _redistributed(x: torch.Tensor, mesh, shape: tuple, src: tuple, dst: tuple, bound: Bound) -> torch.Tensor:
    """Local ``x`` of a tensor of global ``shape`` on the 1-D ``mesh`` moved from torch placements
    ``src`` to ``dst`` by DTensor (simulated ranks, meta tensors), issued with the bound."""
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), x.dtype)
    with bound.issuing():
        return redistribute_local_tensor(x.contiguous(), DTensorSpec(mesh, src, tensor_meta=meta),
                                         DTensorSpec(mesh, dst, tensor_meta=meta))


def tree_sum(x: torch.Tensor, mesh, bound: Bound, wait: bool = True):
    """The ranks' ``x`` summed by the canonical tree (``tpfn.tree``): each rank's ``x`` is the root
    of its subtree; all-gathered (on 2 ranks as many bytes as an all-reduce), the roots are added
    in the tree's order, so every rank gets the same bits as one rank adding every leaf."""
    n, shape = mesh.size(), x.shape
    if _plain(x):
        flat = x.reshape(-1)
        out = flat.new_empty(n * flat.numel())
        work = bound.issue(all_gather_into, out, flat, bound.group, bound.options("allgather"))
        return _done(out, work, bound, wait, lambda out: total(out.view(n, *shape).unbind(0)))
    out = total(_redistributed(x.unsqueeze(0), mesh, (n, *shape), (_dt.Shard(0),), (_dt.Replicate(),), bound).unbind(0))
    return out if wait else lambda: out


def tree_scatter(x: torch.Tensor, dim: int, mesh, bound: Bound, wait: bool = True):
    """This rank's chunk along ``dim`` of the ranks' ``x`` summed by the canonical tree: each
    rank sends every other its chunk (an all-to-all: the bytes of a reduce-scatter), and the
    chunks are added in the tree's order."""
    n, dim = mesh.size(), dim % x.ndim
    send = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()  # by destination
    if _plain(x):
        out = torch.empty_like(send)
        work = bound.issue(all_to_all_into, out, send, bound.group, bound.options("alltoall"))
        return _done(out, work, bound, wait, lambda out: total(out.unbind(0)))
    with bound.issuing():
        out = total(all_to_all(send, (mesh, 0)).unbind(0))
    return out if wait else lambda: out


def barrier(what: str) -> None:
    """Wait until every rank of the default group reaches it (nothing where torch.distributed
    is not initialized); a ``CollectiveError`` naming ``what`` where a rank fails or stays away."""
    if dist.is_available() and dist.is_initialized():
        with collective(what) as bound:
            bound.wait(bound.issue(bound.group.barrier, bound.options("barrier")))


# --- the algebra's steps, each run by its plain collective ---------------------------------


def _even(shape: tuple, dim: int, n: int) -> bool:
    return shape[dim] % n == 0


def _gather(step, x, mesh, shape, bound, wait):
    if step.parts == 1 and _even(shape, step.dim, mesh.size()):
        return all_gather(x, step.dim, mesh.size(), bound, wait)
    return None


def _sum(step, x, mesh, shape, bound, wait):
    return all_reduce(x, step.op, bound, wait) if step.op in _OPS else None


def _scatter(step, x, mesh, shape, bound, wait):
    if step.op == "sum" and _even(shape, step.dim, mesh.size()):
        return _reduce_scatter(x, step.dim, mesh.size(), bound, wait)
    return None


def _chunk(step, x, mesh, shape, bound, wait):
    if step.parts != 1:
        return None
    dim = step.dim % x.ndim
    out = x.narrow(dim, *chunk_bounds(x.shape[dim], mesh.size(), mesh.get_coordinate()[0]))
    out = out.clone(memory_format=torch.contiguous_format)
    return out if wait else lambda: out


def _split(step, x, mesh, shape, bound, wait):
    out = x / mesh.size() if step.op == "sum" else x.clone()  # DTensor's terms of a replica
    return out if wait else lambda: out


RUN = {AllGather: _gather, AllReduce: _sum, ReduceScatter: _scatter, Chunk: _chunk, Split: _split}
"""Each step of the algebra (``tpfn.algebra.transition``) by the plain collective that runs it:
``run(step, x, mesh, shape, bound, wait)`` returns the moved local tensor (None where it cannot:
uneven shards, packed parts, an unsupported reduction)."""


def _tree_all_reduce(step, x, mesh, shape, bound, wait):
    return tree_sum(x, mesh, bound, wait) if step.op == "sum" else None


def _tree_reduce_scatter(step, x, mesh, shape, bound, wait):
    if step.op != "sum":
        return None
    if not _even(shape, step.dim, mesh.size()):
        raise ValueError(f"invariant mode sums a sequence's chunks in the canonical tree, but its {shape[step.dim]} "
                         f"positions in dim {step.dim} do not split evenly over {mesh.size()} ranks; "
                         "pad the sequence to a multiple of the chunks")
    return tree_scatter(x, step.dim, mesh, bound, wait)


TREE = {AllReduce: _tree_all_reduce, ReduceScatter: _tree_reduce_scatter}
"""The steps that sum partial sums, in invariant mode (``run(..., tree=True)``): by the canonical
tree (``tree_sum``, ``tree_scatter``), each rank's local tensor the root of its subtree."""


def run(step, x: torch.Tensor, mesh, shape: tuple, bound: Bound, wait: bool = True, tree: bool = False):
    """Local ``x`` of a tensor of global ``shape`` moved by the algebra's ``step`` on the 1-D
    ``mesh``, a new tensor (``x`` is never written): by its plain collective (``RUN``) waited with
    ``bound``, else (an all-to-all, uneven shards; simulated or fake ranks) by DTensor's
    redistribution, issued with the bound. ``wait=False``: a function that waits and returns it,
    the collective left running. ``tree``: a sum of partial sums by the canonical tree (``TREE``).

    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> run(AllReduce(), torch.ones(2, 3), mesh, (2, 3), Bound(mesh.get_group())).shape
    torch.Size([2, 3])
    """
    if tree and type(step) in TREE:
        out = TREE[type(step)](step, x, mesh, shape, bound, wait)
        if out is not None:
            return out
    plain = RUN.get(type(step))
    if plain is not None and _plain(x):
        out = plain(step, x, mesh, shape, bound, wait)
        if out is not None:
            return out
    out = _redistributed(x, mesh, shape, to_torch(step.src, len(shape)), to_torch(step.dst, len(shape)), bound)
    return out if wait else lambda: out
