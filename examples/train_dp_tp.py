"""Train a small Llama with data x tensor parallelism, then resume at another tensor-parallel degree.

    python examples/train_dp_tp.py                  # 4 CPU processes with gloo
    torchrun --nproc-per-node 4 examples/train_dp_tp.py [checkpoint directory]

The checkpoint goes to rank 0's temporary directory unless a directory is given; across
nodes, give one on a file system every node shares.

Phase 1 trains on a 2 x 2 mesh (FSDP2 over 2 data-parallel ranks, tpfn over 2
tensor-parallel ranks, sequence parallel, vocab-parallel loss) and checkpoints after step 4.
Phase 2 builds the model afresh on a 1 x 4 mesh (4-way tensor parallel), loads the
checkpoint and trains on: its losses continue those of an uninterrupted run.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpfn  # noqa: E402
from launch import device_type, run  # noqa: E402
from llama import Llama, llama_plan, synthetic_batch  # noqa: E402

VOCAB, BATCH, SEQ, SAVE_AT, STEPS = 256, 8, 32, 4, 8


def build(dp: int, tp: int):
    mesh = init_device_mesh(device_type(), (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Llama(vocab=VOCAB, dim=64, layers=2, heads=8, kv_heads=4, hidden=128).to(device_type())
    tpfn.parallelize(model, mesh["tp"], llama_plan(sequence_parallel_=True, loss_parallel=True))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, mesh, opt, steps) -> list:
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    losses = []
    for step in steps:
        global_batch = synthetic_batch(step, BATCH, SEQ, VOCAB)
        tokens, target = (t.chunk(dp)[dp_rank].to(device_type()) for t in global_batch)
        opt.zero_grad()
        logits = model(tokens)
        loss = tpfn.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss.backward()
        tpfn.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["dp"].get_group())
        losses.append(total.item() / dp)
    return losses


def main(directory: str) -> None:
    shared = [directory]
    dist.broadcast_object_list(shared, src=0)  # under torchrun each process made its own
    path = os.path.join(shared[0], "step-4")
    model, mesh, opt = build(dp=2, tp=2)
    first = train(model, mesh, opt, range(1, SAVE_AT + 1))
    tpfn.checkpoint.save(path, model, opt)
    straight_on = train(model, mesh, opt, range(SAVE_AT + 1, STEPS + 1))

    model, mesh, opt = build(dp=1, tp=4)
    tpfn.checkpoint.load(path, model, opt)
    resumed = train(model, mesh, opt, range(SAVE_AT + 1, STEPS + 1))

    if dist.get_rank() == 0:
        print(f"{'step':>4}  {'dp=2 x tp=2':>12}  {'resumed at tp=4':>16}")
        for step, loss in enumerate(first, 1):
            print(f"{step:>4}  {loss:>12.5f}")
        for step, (a, b) in enumerate(zip(straight_on, resumed), SAVE_AT + 1):
            print(f"{step:>4}  {a:>12.5f}  {b:>16.5f}")
        worst = max(abs(a - b) / a for a, b in zip(straight_on, resumed))
        print(f"the resumed run continues the uninterrupted one (largest relative gap {worst:.1e})")
        assert worst < 1e-4 and resumed[-1] < first[0]


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(main, 4, sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            run(main, 4, tmp)
