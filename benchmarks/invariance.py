"""Invariant mode's cost: step time and bytes moved, ``parallelize(..., invariant=True)`` against the default.

2 gloo ranks, the step-time benchmark's configurations (``benchmarks.step_time``: PyTorch's
reference Transformer and a Hugging Face Llama, dim 256, 4 layers, vocab 2048, batch 8 x 64
tokens, with and without sequence parallelism, tpfn's recommended plan, fused Adam). The two
modes are stepped in turn on the same batches; the ratio of median step times is what to read.
Bytes: what each rank sends in one step (forward and backward), from the collectives' tensors
(``tpfn.record``, ring model), and the collectives by kind. Each invariant run's losses are
also checked for the same bits on one rank (a 1-rank mesh per rank, the same batches).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import Counter

import torch

from benchmarks.common import Table

MODES = ("default", "invariant")


def _steps(model_name: str, sp: bool, steps: int) -> dict:
    import tpfn
    from benchmarks.step_time import BATCH, SEQ, VOCAB, _llama, _loss, _reference
    from tests.models import local_heads
    from tests.ranks import mesh
    from tpfn.record import record

    torch.set_num_threads(1)
    meshes = {2: mesh(2), 1: mesh(2, 1, names=("dp", "tp"))["tp"]}
    build, _, recommended = (_reference if model_name == "reference" else _llama)(sp)

    def made(invariant: bool, tp: int):
        model = build()
        plan = recommended if recommended is not None else tpfn.from_hf(model.tp_plan, model)
        tpfn.parallelize(model, meshes[tp], plan, invariant=invariant)
        if model_name == "reference":
            local_heads(model, tp)
        return model, torch.optim.Adam(tpfn.param_groups(model), lr=1e-4, fused=True)

    models = {mode: made(mode == "invariant", 2) for mode in MODES}
    one = made(True, 1)  # invariant mode on one rank: the same bits as on two
    gen = torch.Generator().manual_seed(0)
    times: dict = {mode: [] for mode in MODES}
    losses: dict = {mode: [] for mode in (*MODES, "invariant, 1 rank")}
    for step in range(steps + 3):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        for mode in (MODES if step % 2 else MODES[::-1]):
            model, opt = models[mode]
            torch.distributed.barrier()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, tokens, target)
            loss.backward()
            opt.step()
            if step >= 3:
                times[mode].append(time.perf_counter() - start)
            losses[mode].append(loss.item())
        if step < 3:  # one rank alone, on the first batches only (not timed)
            model, opt = one
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, tokens, target)
            loss.backward()
            opt.step()
            losses["invariant, 1 rank"].append(loss.item())
    sent = {}
    for mode in MODES:
        model, opt = models[mode]
        opt.zero_grad(set_to_none=True)
        with record(model) as comms:
            _loss(model, tokens, target).backward()
        sent[mode] = (int(sum(c.bytes for c in comms)), dict(Counter(c.kind for c in comms)))
    return {"median": {k: statistics.median(v) for k, v in times.items()}, "times": times, "losses": losses,
            "bytes": sent}


def _kinds(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def run(quick: bool = False) -> Table:
    from tests.ranks import Ranks

    table = Table("invariance", "Invariant mode against the default, 2 gloo ranks (fused Adam)",
                  ["model", "sequence parallel", "default ms", "invariant ms", "invariant / default",
                   "default MB", "invariant MB", "default collectives", "invariant collectives"])
    steps = 5 if quick else 40
    spreads = []
    with Ranks(2) as ranks:
        for model, sp in itertools.product(("reference", "llama"), (False, True)):
            result = ranks.run(_steps, model, sp, steps, timeout=900)[0]
            default, invariant = (result["median"][k] * 1e3 for k in MODES)
            (dbytes, dkinds), (ibytes, ikinds) = (result["bytes"][k] for k in MODES)
            name = "PyTorch reference Transformer" if model == "reference" else "HF Llama"
            label = f"{model}, sp {'on' if sp else 'off'}"
            table.add(name, "on" if sp else "off", default, invariant, invariant / default, dbytes / 2 ** 20,
                      ibytes / 2 ** 20, _kinds(dkinds), _kinds(ikinds))
            table.target(f"{label}: invariant step at most 1.25 of the default's", invariant / default <= 1.25)
            losses = result["losses"]
            table.target(f"{label}: invariant losses on 2 ranks the bits of 1 rank's (3 steps)",
                         losses["invariant"][:3] == losses["invariant, 1 rank"])
            pairs = sorted(a / b for a, b in zip(result["times"]["invariant"], result["times"]["default"]))
            q = statistics.quantiles(pairs, n=4)
            spreads.append(f"{label} {q[0]:.2f}-{q[2]:.2f}")
    table.notes.append(f"dim 256, 4 layers, 8 heads, vocab 2048, batch 8 x 64 tokens; tpfn's recommended plan, fused "
                       f"Adam; medians of {steps} steps per mode, stepped in turn; MB: what a rank sends in one forward "
                       "and backward (ring model)")
    table.notes.append("invariant / default step by step, quartiles: " + "; ".join(spreads))
    return table


if __name__ == "__main__":
    print(run().text())
