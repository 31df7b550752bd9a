"""Communication per training step, by phase: forward, backward, optimizer (Adam).

2 gloo ranks, PyTorch's reference 2-block Transformer. PyTorch leaves the gradients of
sequence-parallel norms partial, so each Adam op on them all-reduces (30 per step); tpfn
sums them all in one all-reduce at the end of backward. Also the bytes each rank sends
(measured from the collectives' tensors, ring model) against the Megatron formula.
"""

from __future__ import annotations

import torch

from benchmarks.common import Table

BATCH, SEQ, DIM = 4, 8, 16


def _phases(sp: bool) -> dict:
    from torch.distributed.tensor.experimental import implicit_replication

    import tpfn
    from tpfn.record import record
    from tests.models import clone, counts, local_heads, native_transformer, transformer, transformer_plan
    from tests.ranks import mesh

    m = mesh(2)
    ref = transformer(vocab_size=16, dim=DIM)
    models = {"native": local_heads(native_transformer(clone(ref), m, sp), 2),
              "tpfn": local_heads(tpfn.parallelize(clone(ref), m, transformer_plan(sp)), 2)}
    x = torch.randint(0, 16, (BATCH, SEQ))
    out = {}
    for name, model in models.items():
        opt = torch.optim.Adam(model.parameters(), lr=0.0)
        model(x).sum().backward()
        opt.step()  # Adam makes its state on the first step
        opt.zero_grad()
        phase = {}
        logits = []
        phase["forward"] = counts(lambda: logits.append(model(x)))
        phase["backward"] = counts(lambda: logits[0].sum().backward())

        def step():
            with implicit_replication():
                opt.step()
        phase["optimizer"] = counts(step)
        with record(model) as comms:  # the bytes of a second forward + backward
            model(x).sum().backward()
        blocks = sum(c.bytes for c in comms if (c.fqn or "").startswith("layers."))
        out[name] = phase, int(blocks)
    return out


def run(quick: bool = False) -> Table:
    from tests.ranks import Ranks

    table = Table("communication", "Collectives per training step, 2-block reference Transformer, 2 ranks",
                  ["sequence parallel", "variant", "forward", "backward", "optimizer", "total",
                   "block bytes", "Megatron bytes", "ratio"])
    megatron = 2 * 8 * (2 - 1) / 2 * BATCH * SEQ * DIM * 4  # 2 blocks, 4 (t-1)/t b s h e each way
    with Ranks(2) as ranks:
        for sp in (False, True):
            result = ranks.run(_phases, sp)[0]
            for name, (phase, blocks) in result.items():
                total = sum(sum(c.values()) for c in phase.values())
                fmt = lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"  # noqa: E731
                table.add("on" if sp else "off", name, fmt(phase["forward"]), fmt(phase["backward"]),
                          fmt(phase["optimizer"]), total, blocks, megatron, blocks / megatron)
            tpfn_optim = sum(result["tpfn"][0]["optimizer"].values())
            reductions = result["tpfn"][0]["backward"].get("all_reduce", 0) if sp else 0
            if sp:
                table.target("sp: at most one reduction per partial gradient (10), ideally one "
                             f"bucketed collective (tpfn: {reductions} in backward, {tpfn_optim} in "
                             "the optimizer)", tpfn_optim == 0 and reductions <= 1)
            table.target(f"sp {'on' if sp else 'off'}: block bytes equal the Megatron formula",
                         result["tpfn"][1] == megatron)
    table.notes.append("Megatron: per block 4(t-1)/t*b*s*h*e forward and the same backward; "
                       f"b={BATCH}, s={SEQ}, h={DIM}, fp32, t=2")
    return table


if __name__ == "__main__":
    print(run().text())
