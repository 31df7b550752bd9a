"""Which slot of which bound module ran each collective of a dry run, and what each slot handed on.

``Slots`` observes every call of every bound module on the dry run's own copy of the model (it
is the model's ``State.observer``): the layout of each slot's value as it arrives, the autograd
sequence numbers around its input moves (from the call's start to its own computation) and
around its output moves (from its outputs' arrival to its forward hook), and the tensor each
slot hands on. A call's moves make their autograd nodes slot by slot, so
the node a handed-on tensor's gradient starts from closes its slot's range of sequence
numbers. A backward collective runs in a node: the slot whose range holds that node ran it.
A forward collective is noted with the number the next node will get (``record(...,
nodes=)``): the slot whose nodes were being made ran it; a slot that makes no node (an
input that needs no gradient) is told apart by the algebra's count of its steps.
"""

from __future__ import annotations

import functools

import attrs
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tpfn._torch import local_tensor, next_sequence_nr, sequence_nr
from tpfn.algebra import Chunk
from tpfn.dryrun.report import Flow
from tpfn.interpret.parallelize import runtime
from tpfn.interpret.state import recall
from tpfn.layout import from_torch, to_torch

__all__ = ["Slots", "storage_of"]


def storage_of(x):
    """The storage of a tensor, or of a DTensor's local shard."""
    return (local_tensor(x) if isinstance(x, DTensor) else x).untyped_storage()


@attrs.define
class _Window:
    """The moves of one side (inputs or outputs) of one call: the first sequence number they
    may use, the index of their first collective, and once they are done the end of both and
    the value each slot handed on, in slot order."""

    start: int
    first: int
    end: int | None = None
    last: int | None = None
    values: list | None = None
    made: tuple = ()

    def close(self, nodes: list, values: list, made: tuple = ()) -> None:
        """``made``: per slot, the autograd node that moved it, where its value has none (a
        kernel's input, moved inside the kernel's node)."""
        self.end, self.last, self.values, self.made = next_sequence_nr(), len(nodes), values, made

    def bounds(self) -> list:
        """The last sequence number of each slot's nodes (the one before, for a slot that made none)."""
        out, last = [], self.start - 1
        for i, x in enumerate(self.values):
            node = self.made[i] if i < len(self.made) and self.made[i] is not None else (
                x.grad_fn if isinstance(x, torch.Tensor) else None)
            if node is not None and self.start <= sequence_nr(node) < self.end:
                last = max(last, sequence_nr(node))
            out.append(last)
        return out


def _observe(x):
    """(layout or None for a plain tensor, ndim) of a tensor; None for anything else."""
    if isinstance(x, DTensor):
        return from_torch(x.placements), x.ndim
    return (None, x.ndim) if isinstance(x, torch.Tensor) else None


def _input(label: str, args: tuple, kwargs: dict, names: tuple):
    """The value of input slot ``label`` (``"input 0"``, ``"input 'mask'"``) in a call."""
    key = label.removeprefix("input ")
    if key.isdigit():
        i = int(key)
        return args[i] if i < len(args) else kwargs.get(names[i]) if i < len(names) else None
    return kwargs.get(key.strip("'"))


def _output(label: str, output):
    """The value of output slot ``label`` (``"output 0"``, ``"output 'logits'"``)."""
    key = label.removeprefix("output ")
    if not key.isdigit():
        return output.get(key.strip("'")) if isinstance(output, dict) else None
    items = list(output.values()) if isinstance(output, dict) else (
        list(output) if isinstance(output, (tuple, list)) else [output])
    return items[int(key)] if int(key) < len(items) else None


class Slots:
    """The observer of ``model`` (a dry run's copy, parallelized): ``labels`` holds each bound
    module's labels of the slots it moves, in the order it moves them; ``nodes`` is the list
    ``record`` fills alongside its collectives; ``seen[fqn][label]`` gets the layout and ndim
    of the first value each slot of each bound module received (``_observe``)."""

    def __init__(self, model: nn.Module, labels: dict, nodes: list, seen: dict):
        self.labels, self.nodes, self.seen = labels, nodes, seen
        self.calls: dict = {fqn: [] for fqn in labels}  # fqn -> [(inputs, outputs) window]
        self.open: dict = {fqn: [] for fqn in labels}
        for fqn, sub in model.named_modules():
            rt = runtime(sub)
            if rt is not None:
                rt.state.observer = self
                if fqn in labels:
                    end = functools.partial(self._end, fqn)
                    end.observes_only = True  # (changes no module: see tpfn._torch.hooked)
                    sub.register_forward_hook(end)

    def _window(self) -> _Window:
        return _Window(next_sequence_nr(), len(self.nodes))

    def _saw(self, fqn: str, label: str, x) -> None:
        found = self.seen.setdefault(fqn, {})
        if label not in found and _observe(x) is not None:
            found[label] = _observe(x)

    def inputs(self, rt, args: tuple, kwargs: dict) -> None:
        """A call of ``rt``'s module starts, its inputs as they arrive."""
        fqn, names = rt.mount.fqn, rt.mount.names or ()
        for i in range(max(len(args), len(rt.mount.inputs.slots))):
            self._saw(fqn, f"input {i}", _input(f"input {i}", args, kwargs, names))
        for name, _ in rt.mount.inputs.kwargs:
            self._saw(fqn, f"input {name!r}", kwargs.get(name))
        if fqn in self.labels:
            self.open[fqn].append([self._window(), None])

    def computes(self, rt, args: tuple, kwargs: dict, made: tuple = ()) -> None:
        """Its own computation starts on the inputs moved (``made``: per input, the node that
        moved it where its value has none: a kernel's input, moved inside the kernel's node)."""
        fqn = rt.mount.fqn
        if fqn in self.labels:
            inputs = [label for label in self.labels[fqn] if label.startswith("input")]
            names = rt.mount.names or ()
            self.open[fqn][-1][0].close(self.nodes, [_input(label, args, kwargs, names) for label in inputs], made)

    def outputs(self, rt, output) -> None:
        """Its computation ended with ``output``, before its output slots."""
        fqn = rt.mount.fqn
        items = list(output.values()) if isinstance(output, dict) else (
            list(output) if isinstance(output, (tuple, list)) else [output])
        for i, x in enumerate(items):
            self._saw(fqn, f"output {i}", x)
        for key, _ in rt.mount.outputs.keys:
            self._saw(fqn, f"output {key!r}", output.get(key) if isinstance(output, dict) else None)
        if fqn in self.labels and self.open[fqn]:
            self._outputs_start(fqn, self.open[fqn][-1])

    def _outputs_start(self, fqn: str, call: list) -> None:
        inputs = [label for label in self.labels[fqn] if label.startswith("input")]
        if call[0].end is None:  # the module's own forward never ran (a no-op dropout)
            call[0].close(self.nodes, [None] * len(inputs))
        if call[1] is None:
            call[1] = self._window()

    def _end(self, fqn: str, module, args, output) -> None:
        if not self.open[fqn]:
            return
        call = self.open[fqn].pop()
        self._outputs_start(fqn, call)
        outputs = [label for label in self.labels[fqn] if label.startswith("output")]
        call[1].close(self.nodes, [_output(label, output) for label in outputs])
        self.calls[fqn].append(call)

    def _owners(self, fqn: str, comms: tuple, transitions: dict) -> dict:
        """``{label: ([forward collective index], [backward collective index])}`` of ``fqn``."""
        out: dict = {label: ([], []) for label in self.labels[fqn]}
        for call in self.calls[fqn]:
            for side, window in zip(("input", "output"), call):
                labels = [lb for lb in self.labels[fqn] if lb.startswith(side)]
                if not labels:
                    continue
                bounds = window.bounds()
                steps = [sum(not isinstance(s, Chunk) for s in transitions[lb].steps)
                         if lb in transitions else 1 for lb in labels]
                taken = [0] * len(labels)
                for j in range(window.first, window.last):  # forward: in the order they ran
                    made = self.nodes[j] - 1  # the last node made when it ran
                    fits = [i for i in range(len(labels)) if made <= bounds[i]
                            and (i == 0 or made >= bounds[i - 1])]
                    free = [i for i in fits if taken[i] < steps[i]]
                    if fits:
                        i = (free or fits)[0]
                        taken[i] += 1
                        out[labels[i]][0].append(j)
                for j, c in enumerate(comms):
                    seq = self.nodes[j]
                    if c.phase != "backward" or c.fqn != fqn or seq is None \
                            or not window.start <= seq < window.end:
                        continue
                    i = next((i for i, b in enumerate(bounds) if seq <= b), None)
                    if i is not None:
                        out[labels[i]][1].append(j)
        return out

    def flows(self, comms: tuple, mesh, transitions: dict) -> tuple:
        """A ``Flow`` per slot that handed on a tensor (``transitions``: ``{fqn: {label:
        Transition}}`` of the slots seen): its first call's tensor, and the collectives of
        all its calls."""
        storages: list = []
        found = []
        for fqn, labels in self.labels.items():
            if not self.calls[fqn]:
                continue
            seen = transitions.get(fqn, {})
            owners = self._owners(fqn, comms, seen)
            ins, outs = self.calls[fqn][0]
            values = dict(zip([lb for lb in labels if lb.startswith("input")], ins.values))
            values.update(zip([lb for lb in labels if lb.startswith("output")], outs.values))
            for label in labels:
                x, t = values.get(label), seen.get(label)
                if not isinstance(x, torch.Tensor) or t is None:
                    continue
                shape = x.shape if isinstance(x, DTensor) else recall(x, to_torch(t.desired, x.ndim), mesh)
                storage = storage_of(x)
                index = next((i for i, s in enumerate(storages) if s is storage), None)
                if index is None:
                    index = len(storages)
                    storages.append(storage)
                found.append(Flow(fqn, label, tuple(shape), x.dtype.itemsize, index,
                                  *map(tuple, owners[label])))
        return tuple(found)
