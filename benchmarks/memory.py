"""Memory: peak RSS per rank when a model of over 2 GB (fp32) is built on the meta device,
parallelized with ``src_rank=None`` and materialized shard by shard.

Eight Linear(8192, 8192) layers, column-wise and row-wise in turn: 2.15 GB of parameters.
Each rank allocates only its shards (``to_empty``) and initializes them in place; nothing
ever holds the whole model. 2 gloo ranks; the peak is the growth of the resident set over
the process before the model (``VmHWM``, reset before each run).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from benchmarks.common import Table

LAYERS, WIDTH = 8, 8192


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak(variant: str) -> tuple:
    """(peak growth in bytes, model bytes) on this rank."""
    import gc

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import tpfn
    from tests.ranks import mesh

    m = mesh(2)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from now
    before = _kib("VmRSS")
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if variant == "tpfn":
        plan = {str(i): tpfn.colwise() if i % 2 == 0 else tpfn.rowwise() for i in range(LAYERS)}
        tpfn.parallelize(model, m, plan, src_rank=None)
    else:
        plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(LAYERS)}
        parallelize_module(model, m, plan, src_data_rank=None)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for layer in model:
            layer.reset_parameters()
    assert model(torch.ones(2, WIDTH)).shape == (2, WIDTH)
    peak = (_kib("VmHWM") - before) * 1024
    del model
    gc.collect()
    return peak, size


def run(quick: bool = False) -> Table:
    from tests.ranks import Ranks

    table = Table("memory", "Peak RSS per rank: a 2.15 GB fp32 model, meta -> parallelize -> "
                  "materialize, 2 ranks", ["variant", "model GB", "1/tp GB", "peak growth GB",
                                           "peak / (model / tp)"])
    for variant in ("native", "tpfn"):
        with Ranks(2) as ranks:
            results = ranks.run(_peak, variant)
        peak, size = max(r[0] for r in results), results[0][1]
        table.add(variant, size / 1e9, size / 2e9, peak / 1e9, peak / (size / 2))
        if variant == "tpfn":
            table.target("peak at most 1/tp of the model plus 15%", peak <= 1.15 * size / 2)
    table.notes.append("peak growth = VmHWM after materializing and one forward, minus VmRSS "
                       "before building the model, the larger of the two ranks")
    return table


if __name__ == "__main__":
    print(run().text())
