"""Hook overhead: what a parallelized module adds to its plain forward, tpfn vs native TP.

A Linear(64, 64) - ReLU - Linear(64, 64) MLP, column-wise then row-wise, on one gloo rank
(no collective does any work), batch 4: the cost is all bookkeeping. Without gradients,
and with a backward (gradients set to None first, as a training step does).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from benchmarks.common import Table, interleaved


def _measure(quick: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import tpfn

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1,))

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))

    models = {
        "plain": mlp(),
        "native": parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}),
        "tpfn": tpfn.parallelize(mlp(), mesh, {"0": tpfn.colwise(), "2": tpfn.rowwise()}),
    }
    x = torch.randn(4, 64)
    xg = torch.randn(4, 64, requires_grad=True)
    repeats, calls = (5, 200) if quick else (21, 1000)
    out = {}
    with torch.no_grad():
        for _ in range(200):
            [m(x) for m in models.values()]
        out["forward"] = interleaved({k: (lambda m=m: m(x)) for k, m in models.items()}, repeats, calls)
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

    with Ranks(1) as ranks:
        measured = ranks.run(_measure, quick)[0]
    table = Table("hook_overhead", "Hook overhead per call: MLP 64-64, 1 gloo rank, batch 4",
                  ["pass", "plain us", "native us", "tpfn us", "native adds us",
                   "tpfn adds us", "tpfn / native added"])
    for phase, t in measured.items():
        plain, native, mine = (t[k] * 1e6 for k in ("plain", "native", "tpfn"))
        ratio = (mine - plain) / (native - plain)
        table.add(phase, plain, native, mine, native - plain, mine - plain, ratio)
        table.target(f"{phase}: tpfn's added overhead at most half of native's", ratio <= 0.5)
    table.notes.append("medians of interleaved repeats; native = torch.distributed.tensor.parallel")
    return table


if __name__ == "__main__":
    print(run().text())
