"""Hook overhead: what a parallelized module adds to its plain forward, tpfn vs native TP.

A Linear(64, 64) - ReLU - Linear(64, 64) MLP, column-wise then row-wise, batch 4. On one
gloo rank no collective does any work: the cost is all bookkeeping. On two, each pass also
runs its all-reduces, the same ones for native, tpfn and the hand-written MLP (plain weight
shards, Megatron's f and g: ``benchmarks.handwritten.Comm``), whose time is the collectives
and the local compute alone. Without gradients, and with a backward (gradients set to None
first, as a training step does).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from benchmarks.common import Table, interleaved
from benchmarks.handwritten import Comm


class _HandMLP(nn.Module):
    """``mlp`` by hand on this rank's shards: f, column shard, ReLU, row shard, g, bias."""

    def __init__(self, full: nn.Sequential, comm: Comm):
        super().__init__()
        self.comm, n, r = comm, comm.n, comm.rank
        self.w1 = nn.Parameter(full[0].weight.detach().chunk(n, 0)[r].clone())
        self.b1 = nn.Parameter(full[0].bias.detach().chunk(n, 0)[r].clone())
        self.w2 = nn.Parameter(full[2].weight.detach().chunk(n, 1)[r].clone())
        self.b2 = nn.Parameter(full[2].bias.detach().clone())

    def forward(self, x):
        h = torch.relu(nn.functional.linear(self.comm.copy_to(x), self.w1, self.b1))
        return self.comm.reduce_from(nn.functional.linear(h, self.w2)) + self.b2


def _measure(quick: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import tpfn

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))

    models = {
        "plain": mlp(),
        "native": parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}),
        "tpfn": tpfn.parallelize(mlp(), mesh, {"0": tpfn.colwise(), "2": tpfn.rowwise()}),
        "reference": tpfn.parallelize(mlp(), mesh, {"0": tpfn.colwise(), "2": tpfn.rowwise()}, kernels=False),
        "hand": _HandMLP(mlp(), Comm(real=mesh.size() > 1)),  # one rank: no collective, as Megatron
    }
    xs = torch.randn(4, 64, requires_grad=True)
    outs = [m(xs) for m in models.values()]
    assert all(torch.allclose(outs[0], o, atol=1e-5) for o in outs[1:])  # the same MLP, five ways
    x = torch.randn(4, 64)
    xg = torch.randn(4, 64, requires_grad=True)
    repeats, calls = (5, 200) if quick else (21, 1000)
    out = {}
    with torch.no_grad():
        for _ in range(200):
            [m(x).sum() for m in models.values()]
        # .sum() uses the output: a collective that finishes lazily (native's) is waited for
        out["forward"] = interleaved({k: (lambda m=m: m(x).sum()) for k, m in models.items()},
                                     repeats, calls)
    def step(m):
        m.zero_grad(set_to_none=True)
        m(xg).sum().backward()

    for _ in range(50):
        [step(m) for m in models.values()]
    out["forward + backward"] = interleaved(
        {k: (lambda m=m: step(m)) for k, m in models.items()}, repeats, calls // 4)
    return out


def run(quick: bool = False) -> Table:
    from tests.ranks import Ranks

    table = Table("hook_overhead", "Overhead per call: MLP 64-64, batch 4, on 1 and 2 gloo ranks",
                  ["ranks", "pass", "plain us", "native us", "tpfn us", "kernels=False us", "native adds us",
                   "tpfn adds us", "tpfn / native added", "kernels=False / native added", "hand-written us",
                   "tpfn / hand-written"])
    for world_size in (1, 2):
        with Ranks(world_size) as ranks:
            measured = ranks.run(_measure, quick)[0]
        for phase, t in measured.items():
            plain, native, mine, ref, hand = (t[k] * 1e6 for k in ("plain", "native", "tpfn", "reference", "hand"))
            ratio = (mine - plain) / (native - plain)
            table.add(world_size, phase, plain, native, mine, ref, native - plain, mine - plain, ratio,
                      (ref - plain) / (native - plain), hand, mine / hand)
            if world_size == 1:
                table.target(f"{phase}, 1 rank: tpfn's added overhead at most half of native's",
                             ratio <= 0.5)
            else:
                table.target(f"{phase}, 2 ranks: tpfn adds no more than native", ratio <= 1.0)
    table.notes.append("medians of interleaved repeats; plain = the MLP alone on each rank; "
                       "native = torch.distributed.tensor.parallel; kernels=False = tpfn's reference route; hand-written = plain shards and "
                       "Megatron's f and g, the collectives and local compute alone")
    return table


if __name__ == "__main__":
    print(run().text())
