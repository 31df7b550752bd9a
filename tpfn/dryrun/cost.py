"""A step's time predicted from a dry run: local work at a machine's rates, collectives over its links.

A ``Machine`` is what one rank's device and the links between ranks sustain: ``flops``
(FLOP/s of matrix products), ``bandwidth`` (bytes/s of the other ops), ``op`` (seconds each op
costs beyond its work: dispatch, launch, the framework's code around it), and a ``Link`` per
collective kind (seconds per ring step, bytes/s a rank sends, and the times measured at
sizes from 4 KiB to 16 MiB). ``calibrate(mesh)`` measures them on the ranks of ``mesh``;
figures from elsewhere can be written as a ``Machine`` value.

``predict(report, machine)`` reads a ``tpfn.explain`` report: each phase's local work
(``tpfn.dryrun.work``) takes ``flops / machine.flops + bytes / machine.bandwidth + ops *
machine.op``, each collective the time its kind's link took at that size (interpolated
between the sizes measured), else ``steps * latency + bytes / bandwidth`` (the ring model: an
all-reduce takes ``2(n-1)`` steps, the others ``n-1``; ``bytes`` as the report counts them),
and Adam's step reads and writes seven times each rank's parameter bytes.
Nothing is assumed to overlap: on a few CPU cores gloo's transfers are work for the cores
that compute (docs/performance.md).

>>> machine = Machine(flops=1e11, bandwidth=2e10, op=5e-6,
...                   links=(("all_reduce", Link(5e-4, 1e9)),))
>>> machine.collective("all_reduce", 2, 4_000_000)   # two ring steps and 4 MB
0.005
>>> eval(repr(machine)) == machine
True
"""

from __future__ import annotations

import statistics
import time

import attrs
import torch
import torch.distributed as dist

__all__ = ["Link", "Machine", "Phase", "StepTime", "SIZES", "calibrate", "predict"]


@attrs.frozen
class Link:
    """One collective kind between the ranks: ``latency`` seconds per ring step and the
    ``bandwidth`` in bytes/s at which a rank sends (the ring model). ``measured``: the seconds
    it took among ``ranks`` ranks, as ``(bytes a rank sent, seconds)`` pairs by size; where
    given, a collective among that many ranks takes the time interpolated between them (its
    cost is seldom linear in its bytes: gloo's all-reduce on 2 CPU cores more than doubled
    from 256 KiB to 512 KiB), and the ring model beyond them.

    >>> link = Link(1e-4, 1e9, measured=((1e3, 1e-4), (1e6, 3e-3)), ranks=2)
    >>> round(link.seconds(2, 5.005e5) * 1e3, 3), round(link.seconds(2, 2e6) * 1e3, 3)
    (1.55, 4.0)
    """

    latency: float
    bandwidth: float
    measured: tuple = ()
    ranks: int = 0

    def seconds(self, steps: int, sent: float, n: int | None = None) -> float:
        """Seconds of one collective of ``steps`` ring steps among ``n`` ranks in which a rank sends
        ``sent`` bytes."""
        points = self.measured if n in (None, self.ranks) else ()
        if not points or sent < points[0][0]:
            return steps * self.latency + sent / self.bandwidth
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if sent <= b1:
                return t0 + (t1 - t0) * (sent - b0) / (b1 - b0)
        last, took = points[-1]
        return took + (sent - last) / self.bandwidth


def _ring_steps(kind: str, n: int) -> int:
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


ADAM_PASSES = 7  # Adam reads a parameter, its gradient and two moments, and writes three


@attrs.frozen
class Machine:
    """The rates a step's time is predicted from (see the module docstring); ``links`` pairs
    each collective kind with its ``Link``."""

    flops: float
    bandwidth: float
    op: float
    links: tuple = ()

    def compute(self, work) -> float:
        """Seconds of one phase's local ``work`` (a ``tpfn.dryrun.work.Work``)."""
        return work.flops / self.flops + work.bytes / self.bandwidth + work.ops * self.op

    def collective(self, kind: str, n: int, sent) -> float:
        """Seconds of one ``kind`` collective among ``n`` ranks in which a rank sends ``sent`` bytes."""
        link = dict(self.links).get(kind)
        if link is None:
            raise ValueError(f"this Machine has no link figures for {kind!r} (it has "
                             f"{', '.join(k for k, _ in self.links) or 'none'}); calibrate it on "
                             "a mesh, or give Link(latency, bandwidth) for it.")
        return link.seconds(_ring_steps(kind, n), float(sent), n)

    def optimizer(self, param_bytes) -> float:
        """Seconds of Adam's step on a rank that holds ``param_bytes`` of parameters: it reads
        and writes them ``ADAM_PASSES`` times at ``bandwidth``."""
        return ADAM_PASSES * float(param_bytes) / self.bandwidth


@attrs.frozen
class Phase:
    """One phase's predicted seconds: its local ``compute`` and its ``collectives``."""

    compute: float
    collectives: float

    @property
    def total(self) -> float:
        return self.compute + self.collectives


@attrs.frozen
class StepTime:
    """A step's predicted seconds on one rank: ``forward``, ``backward`` (``Phase`` values) and
    the ``optimizer``'s step.

    >>> step = StepTime(Phase(0.010, 0.002), Phase(0.020, 0.003), 0.001)
    >>> round(step.total, 6), str(step)
    (0.036, 'forward 12.0 ms (compute 10.0, collectives 2.0); backward 23.0 ms (compute 20.0, collectives 3.0); optimizer 1.0 ms; step 36.0 ms')
    """

    forward: Phase
    backward: Phase
    optimizer: float

    @property
    def total(self) -> float:
        return self.forward.total + self.backward.total + self.optimizer

    def __str__(self) -> str:
        ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
        phase = lambda name, p: (f"{name} {ms(p.total)} ms (compute {ms(p.compute)}, "  # noqa: E731
                                 f"collectives {ms(p.collectives)})")
        return (f"{phase('forward', self.forward)}; {phase('backward', self.backward)}; "
                f"optimizer {ms(self.optimizer)} ms; step {ms(self.total)} ms")


def predict(report, machine: Machine, *, optimizer: bool = True) -> StepTime:
    """The step time of ``report``'s plan on ``machine`` (see the module docstring);
    ``optimizer=False`` leaves the optimizer's step out."""
    if not report.work:
        raise ValueError("this report ran nothing (tpfn.explain without example_inputs): give it "
                         "example inputs to predict a step's time.")
    work = dict(report.work)

    def phase(name: str) -> Phase:
        comms = sum(machine.collective(c.kind, int(c.group_size), c.bytes)
                    for c in report.comms if c.phase == name)
        return Phase(machine.compute(work[name]), comms)
    adam = machine.optimizer(report.param_bytes) if optimizer else 0.0
    return StepTime(phase("forward"), phase("backward"), adam)


# --- measuring a machine -------------------------------------------------------------------------


def _seconds(fn, repeats: int, sync) -> float:
    """The median seconds of ``fn()`` over ``repeats`` calls, after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _overhead_model(device) -> torch.nn.Module:
    """Small layers whose time is mostly the cost per op: what ``Machine.op`` is fitted on."""
    layers = [m for _ in range(8) for m in (torch.nn.LayerNorm(64), torch.nn.Linear(64, 64), torch.nn.GELU())]
    return torch.nn.Sequential(*layers).to(device)


def calibrate(mesh, *, repeats: int = 20, size: int = 1 << 20) -> Machine:
    """Measure a ``Machine`` on the ranks of the 1-D ``mesh`` (call it on every rank; every rank
    returns rank 0's figures): a 1024-cube matrix product, an addition over ``size``-element
    tensors, a forward and backward of small layers for the cost per op, and each collective
    kind at each of ``SIZES`` between two pieces of local work, for its link as a step sees it.

    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> machine = calibrate(init_device_mesh("cpu", (1,)), repeats=2)
    >>> machine.flops > 0 and machine.op > 0 and dict(machine.links)["all_reduce"].latency >= 0
    True
    """
    from tpfn.dryrun.work import count

    device = torch.device(mesh.device_type)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    a = torch.randn(1024, 1024, device=device)
    flops = 2 * 1024**3 / _seconds(lambda: a @ a, repeats, sync)
    x, y = torch.randn(size, device=device), torch.randn(size, device=device)
    bandwidth = 3 * x.nbytes / _seconds(lambda: x + y, repeats, sync)
    model, h = _overhead_model(device), torch.randn(8, 64, device=device, requires_grad=True)
    step = lambda: model(h).sum().backward()  # noqa: E731
    with count() as counts:
        model(h).sum().backward()  # (one phase: the fit needs the step's work, not its parts)
    work = counts.of("forward")
    seconds = _seconds(step, repeats, sync)
    op = max(seconds - work.flops / flops - work.bytes / bandwidth, 0.0) / work.ops
    links = tuple((kind, _link(kind, mesh, repeats, sync)) for kind in ("all_reduce", "all_gather", "reduce_scatter"))
    figures = [flops, bandwidth, op, *(v for _, link in links for v in (
        link.latency, link.bandwidth, *(x for point in link.measured for x in point)))]
    if mesh.size() > 1:  # every rank takes rank 0's figures
        shared = torch.tensor(figures, dtype=torch.float64, device=device)
        dist.broadcast(shared, group=mesh.get_group(), group_src=0)
        figures = shared.tolist()
    flops, bandwidth, op, *rest = figures
    width = 2 + 2 * len(links[0][1].measured)  # (each link measured at the same sizes)
    return Machine(flops, bandwidth, op, tuple((kind, _unpacked(rest[i * width:(i + 1) * width], mesh.size()))
                                               for i, (kind, _) in enumerate(links)))


def _unpacked(figures: list, n: int) -> Link:
    latency, bandwidth, *flat = figures
    return Link(latency, bandwidth, tuple(zip(flat[::2], flat[1::2])), n if flat else 0)


SIZES = tuple(1 << k for k in range(10, 23))  # elements (float32) of the whole tensor: 4 KiB to 16 MiB


def _link(kind: str, mesh, repeats: int, sync) -> Link:
    """``kind``'s link on ``mesh``: the time one collective adds between two pieces of local work
    the size of a layer's (as inside a step: the transfer, the wait for the slower rank, and
    caches the work has filled with other data) at each of ``SIZES``, a larger one never taken
    to cost less; the ring model fitted on the smallest and the largest."""
    n, group = mesh.size(), mesh.get_group()
    if n == 1:
        return Link(0.0, float("inf"))
    device = mesh.device_type
    x, w = torch.randn(512, 256, device=device), torch.randn(256, 1024, device=device)
    y, z = torch.randn(1 << 21, device=device), torch.randn(1 << 21, device=device)
    work = lambda: (x @ w, y + z)  # noqa: E731  (a layer's matrix product, 24 MiB read and written)
    dist.barrier(group=group)
    alone = _seconds(work, repeats, sync)
    measured, took = [], 0.0
    for numel in SIZES:
        whole = torch.randn(numel, device=mesh.device_type)
        piece = whole[: numel // n].clone()
        if kind == "all_reduce":
            collective = lambda: dist.all_reduce(whole, group=group)  # noqa: E731
        elif kind == "all_gather":
            collective = lambda: dist.all_gather_into_tensor(whole, piece, group=group)  # noqa: E731
        else:
            collective = lambda: dist.reduce_scatter_tensor(piece, whole, group=group)  # noqa: E731
        sent = (_ring_steps(kind, n) if kind == "all_reduce" else n - 1) / n * whole.nbytes
        dist.barrier(group=group)
        took = max(_seconds(lambda: (work(), collective()), repeats, sync) - alone, took)
        measured.append((sent, took))
    (b0, t0), (b1, t1) = measured[0], measured[-1]
    bandwidth = (b1 - b0) / max(t1 - t0, 1e-9)
    latency = max(t0 - b0 / bandwidth, 0.0) / _ring_steps(kind, n)
    return Link(latency, bandwidth, tuple(measured), n)
