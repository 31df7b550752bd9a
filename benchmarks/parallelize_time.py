"""``parallelize`` time against model depth: 8 to 128 blocks, meta device, 8 fake ranks.

PyTorch's reference Transformer (dim 256) with sequence parallelism, built on the meta
device and parallelized over a fake process group of 8 ranks: tpfn's plan vs PyTorch's
``Transformer.parallelize``. The time per block should stay flat: linear growth.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from benchmarks.common import Table

DEPTHS = (8, 16, 32, 64, 128)


def _times(variants: dict, build, repeats: int) -> dict:
    """Median seconds of each variant, interleaved, each on a fresh model, after a collection."""
    times: dict = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            model = build()
            gc.collect()
            start = time.perf_counter()
            fn(model)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run(quick: bool = False) -> Table:
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    import tpfn
    from tests.models import transformer_plan
    from tpfn.dryrun import fake_mesh

    mesh = fake_mesh(8)
    plan = tpfn.plan(transformer_plan(sp=True))
    table = Table("parallelize_time", "parallelize time vs depth: reference Transformer, dim 256, "
                  "sequence parallel, meta, 8 fake ranks",
                  ["blocks", "native s", "tpfn s", "tpfn / native", "native ms per block",
                   "tpfn ms per block"])
    per_block = []
    for depth in (2, *(DEPTHS[:3] if quick else DEPTHS)):  # 2 blocks first, untimed: one-time costs
        def build():
            with torch.device("meta"):
                return Transformer(ModelArgs(dim=256, n_heads=8, n_layers=depth, vocab_size=32000,
                                             max_seq_len=2048, dropout_p=0.0))
        times = _times({"native": lambda m: Transformer.parallelize(m, mesh, True),
                        "tpfn": lambda m: tpfn.parallelize(m, mesh, plan)},
                       build, 3 if quick else 9)
        if depth == 2:
            continue
        native, mine = times["native"], times["tpfn"]
        table.add(depth, native, mine, mine / native, native / depth * 1e3, mine / depth * 1e3)
        per_block.append(mine / depth)
    table.target("tpfn at most native's time at every depth",
                 all(row[3] <= 1.0 for row in table.rows))
    growth = max(per_block) / min(per_block)
    table.target(f"linear growth: tpfn's time per block varies by at most 1.5x ({growth:.2f}x)",
                 growth <= 1.5)
    return table


if __name__ == "__main__":
    print(run().text())
