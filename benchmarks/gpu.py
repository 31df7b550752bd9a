"""The speed benchmarks on GPUs with NCCL: hook overhead (1 GPU) and step time (2 GPUs).

    python -m benchmarks.gpu               # where CUDA is available; else it says so and exits
    python -m benchmarks.gpu --device cpu  # the same code on gloo, to check the script itself

Nothing else needs it. It prints a table like the CPU benchmarks and writes
benchmarks/results/gpu.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import Table


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, device: str, calls: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _measure(device: str, quick: bool, results: list) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )

    import tpfn
    from tests.models import local_heads, native_transformer_plan, transformer, transformer_plan

    world = dist.get_world_size()
    mesh = init_device_mesh(device, (world,))
    single = init_device_mesh(device, (world, 1), mesh_dim_names=("dp", "tp"))["tp"]  # 1 rank each
    calls, repeats = (50, 3) if quick else (500, 11)

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).to(device)

    x = torch.randn(4, 64, device=device)
    mlps = {"plain": mlp(),
            "native": parallelize_module(mlp(), single, {"0": ColwiseParallel(), "2": RowwiseParallel()}),
            "tpfn": tpfn.parallelize(mlp(), single, {"0": tpfn.colwise(), "2": tpfn.rowwise()})}
    with torch.no_grad():
        hook = {k: _median_time(lambda m=m: m(x).sum(), device, calls, repeats)  # output used
                for k, m in mlps.items()}

    step = {}
    for sp in (False, True):
        def build():
            return transformer(vocab_size=2048, dim=512, n_heads=8, n_layers=4, max_seq_len=256,
                               weight_tying=False).to(device)
        models = {"native": parallelize_module(build(), mesh, native_transformer_plan(sp)),
                  "tpfn": tpfn.parallelize(build(), mesh, transformer_plan(sp))}
        tokens = torch.randint(0, 2048, (8, 256), device=device)
        for name, model in models.items():
            local_heads(model, world)
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)

            def train(model=model, opt=opt):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten()).backward()
                with implicit_replication():
                    opt.step()
            train()
            step[(sp, name)] = _median_time(train, device, 3 if quick else 10, repeats)
    if dist.get_rank() == 0:
        results.append((hook, step))


def main(device: str, quick: bool = False) -> Table:
    from examples.launch import run as launch

    if device == "cuda" and not torch.cuda.is_available():
        print("no GPU here: benchmarks.gpu runs where CUDA is available (see --device cpu)")
        return None
    world = min(2, torch.cuda.device_count()) if device == "cuda" else 2
    results = torch.multiprocessing.Manager().list()
    launch(_measure, world, device, quick, results)
    hook, step = results[0]
    table = Table("gpu", f"On {device} ({world} ranks, {'NCCL' if device == 'cuda' else 'gloo'})",
                  ["measure", "native", "tpfn", "tpfn / native"])
    added = {k: (hook[k] - hook["plain"]) * 1e6 for k in ("native", "tpfn")}
    table.add("hook overhead us (MLP 64, 1 rank)", added["native"], added["tpfn"],
              added["tpfn"] / added["native"])
    for sp in (False, True):
        native, mine = step[(sp, "native")] * 1e3, step[(sp, "tpfn")] * 1e3
        table.add(f"step ms, reference Transformer, sp {'on' if sp else 'off'}", native, mine,
                  mine / native)
        table.target(f"step time sp {'on' if sp else 'off'}: tpfn / native <= 1.00", mine <= native)
    table.target("hook overhead: tpfn adds at most half of native's", added["tpfn"] <= added["native"] / 2)
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result = main(args.device, args.quick)
    if result is not None:
        print(result.text())
        result.save()
