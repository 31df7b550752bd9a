"""Overlap probe: what hiding one collective behind independent work saves on this machine.

Tensor parallelism can overlap a collective with computation in two ways:

- **backward** (what ``parallelize(..., overlap=True)`` does): q, k and v's input gradient is
  all-reduced (without sequence parallelism) or reduce-scattered (with it) while their weight
  gradients are computed, which need no collective;
- **forward, by decomposition** (PyTorch's micro-pipeline TP, Megatron's userbuffers): under
  sequence parallelism, q, k and v read the all-gathered sequence; each rank computes the
  rows of its own slice while the all-gather brings the others', then the rest. One
  all-gather either way, the same numbers (checked: bit-identical).

Each pattern is timed three ways on 2 gloo ranks, one thread each: the collective alone, the
compute alone, and both, in sequence and overlapped. ``hidden`` is how much of the collective's
own time the overlap saves: (sequential - overlapped) / collective alone. The sizes are those
of ``benchmarks.step_time`` (a 256-wide model, 8 x 64 tokens, q, k and v of 128 columns a
rank), then 4 times wider and longer. On CPUs gloo's transfer is itself work for the cores
that compute, so hiding it pays only where a rank waits for the other; on GPUs NCCL moves
data on its own, which is where the forward decomposition is meant to pay
(``python -m benchmarks.gpu``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import Table, interleaved

SIZES = ((8, 64, 256), (8, 256, 1024))  # batch, sequence, width


def _measure(batch: int, seq: int, width: int, quick: bool) -> dict:
    torch.set_num_threads(1)
    n, r = dist.get_world_size(), dist.get_rank()
    s, cols = seq // n, width // 2 // n  # a rank's sequence slice; q, k, v's columns a rank
    torch.manual_seed(r)
    x_local = torch.randn(batch, s, width)
    x_full = torch.randn(batch, seq, width)
    ws = [torch.randn(cols, width) for _ in range(3)]
    grads = [torch.randn(batch * seq, cols) for _ in ws]
    rows = x_full.reshape(-1, width)

    def gather(x):
        out = x.new_empty((n * batch, s, width))
        return out, dist.all_gather_into_tensor(out, x, async_op=True)

    def gathered(buf):
        return buf.view(n, batch, s, width).movedim(0, 1).reshape(batch, seq, width)

    def gather_then_linears():
        buf, work = gather(x_local)
        work.wait()
        full = gathered(buf)
        return [F.linear(full, w) for w in ws]

    def own_rows_first():
        buf, work = gather(x_local)
        ys = [x_local.new_empty(batch, seq, cols) for _ in ws]
        for y, w in zip(ys, ws):
            y[:, r * s:(r + 1) * s] = F.linear(x_local, w)
        work.wait()
        parts = buf.view(n, batch, s, width)
        for k in range(n):
            if k != r:
                for y, w in zip(ys, ws):
                    y[:, k * s:(k + 1) * s] = F.linear(parts[k], w)
        return ys

    def input_grad():
        return sum(g.mm(w) for g, w in zip(grads, ws))

    def reduce_then_weight_grads():
        gx = input_grad()
        dist.all_reduce(gx)
        return gx, [g.t().mm(rows) for g in grads]

    def weight_grads_while_reducing():
        gx = input_grad()
        work = dist.all_reduce(gx, async_op=True)
        gw = [g.t().mm(rows) for g in grads]
        work.wait()
        return gx, gw

    assert all(torch.equal(a, b) for a, b in zip(gather_then_linears(), own_rows_first()))
    gx = input_grad()
    variants = {
        "forward: collective": lambda: gather(x_local)[1].wait(),
        "forward: compute": lambda: [F.linear(x_full, w) for w in ws],
        "forward: sequential": gather_then_linears,
        "forward: overlapped": own_rows_first,
        "backward: collective": lambda: dist.all_reduce(gx.clone()),
        "backward: compute": lambda: [g.t().mm(rows) for g in grads],
        "backward: sequential": reduce_then_weight_grads,
        "backward: overlapped": weight_grads_while_reducing,
    }
    repeats, calls = (7, 3) if quick else (21, 10)
    dist.barrier()
    return interleaved(variants, repeats, calls)  # one seed: both ranks run the same order


def run(quick: bool = False) -> Table:
    from tests.ranks import Ranks

    table = Table("overlap_probe", "Overlap probe: one collective hidden behind independent work (2 gloo ranks)",
                  ["pattern", "tokens x width", "collective ms", "compute ms", "sequential ms",
                   "overlapped ms", "overlapped / sequential", "hidden"])
    with Ranks(2) as ranks:
        for batch, seq, width in SIZES:
            t = ranks.run(_measure, batch, seq, width, quick)[0]
            for pattern, label in (("forward", "all-gather + q, k, v (own rows first)"),
                                   ("backward", "all-reduce + q, k, v weight gradients")):
                c, m, a, b = (t[f"{pattern}: {k}"] * 1e3 for k in
                              ("collective", "compute", "sequential", "overlapped"))
                table.add(label, f"{batch * seq} x {width}", c, m, a, b, b / a, f"{(a - b) / c:.0%}")
    table.notes.append("medians of interleaved repeats on rank 0; hidden = (sequential - overlapped) "
                       "/ collective alone; the forward's two ways give bit-identical outputs")
    return table


if __name__ == "__main__":
    print(run().text())
