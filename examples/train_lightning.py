"""Train with Lightning's ModelParallelStrategy (Fabric, then the Trainer), tpfn parallelizing; check against one process.

    python examples/train_lightning.py                   # 2 CPU processes (gloo)
    python examples/train_lightning.py --nproc 4 --dp 2  # FSDP2 over 2 data ranks x tpfn over 2
    torchrun --nproc-per-node 2 examples/train_lightning.py

Lightning builds the (data_parallel, tensor_parallel) mesh and hands it with the model to
``parallelize_fn``, which parallelizes with tpfn over ``mesh["tensor_parallel"]`` (and shards
with FSDP2 over ``mesh["data_parallel"]``); ``DistributedSampler`` arguments come from the
data-parallel dim, so every tensor-parallel rank reads the same batch. The Lightning Trainer's
``ModelParallelStrategy`` takes no ``parallelize_fn``: its ``LightningModule.configure_model``
calls the same function with ``self.device_mesh``. Rank 0 then trains the same model from the
same seed in one process and compares the loss curves.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpfn  # noqa: E402
from launch import device_type, run  # noqa: E402
from llama import Llama, llama_plan, synthetic_batch  # noqa: E402
from train_llama import _compare  # noqa: E402

CONFIG = dict(vocab=128, dim=32, layers=2, heads=4, kv_heads=2, hidden=64)
STEPS, BATCH, SEQ = 4, 4, 16


def parallelize(model, mesh):
    """Lightning's ``parallelize_fn``: tpfn over the tensor-parallel dim, FSDP2 over the data one."""
    tpfn.parallelize(model, mesh["tensor_parallel"], llama_plan(loss_parallel=True))
    if mesh["data_parallel"].size() > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(model, mesh=mesh["data_parallel"])
    return model


def train(model, optimizer, backward, sharded: bool, dp_rank: int = 0, dp: int = 1, batches=synthetic_batch) -> list:
    """The losses of ``STEPS`` steps on this data rank's part of each of the ``batches``."""
    losses = []
    for step in range(1, STEPS + 1):
        tokens, target = (t.chunk(dp)[dp_rank] for t in batches(step, BATCH, SEQ, CONFIG["vocab"]))
        logits = model(tokens.to(device_type())).flatten(0, 1)
        loss_fn = tpfn.cross_entropy if sharded else torch.nn.functional.cross_entropy
        loss = loss_fn(logits, target.flatten().to(device_type()))
        backward(loss)
        tpfn.clip_grad_norm_(model.parameters(), 1.0)  # the norm over every mesh
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def with_fabric(dp: int) -> list:
    """This rank's losses under Lightning Fabric."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    world = dist.get_world_size()
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=dp,
                                     tensor_parallel_size=world // dp)
    fabric = Fabric(accelerator=device_type(), devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(Llama(**CONFIG))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = strategy.device_mesh["data_parallel"]
    return mean(train(model, optimizer, fabric.backward, True, data.get_local_rank(), dp), data)


def with_trainer(dp: int) -> list:
    """This rank's losses under the Lightning Trainer: its ``DistributedSampler`` shuffles (seed 0)
    and hands each data rank every ``dp``-th row of the shuffled order."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model, self.losses = Llama(**CONFIG), []

        def configure_model(self):
            parallelize(self.model, self.device_mesh)

        def training_step(self, batch, _):
            loss = tpfn.cross_entropy(self.model(batch[0]).flatten(0, 1), batch[1].flatten())
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            tpfn.clip_grad_norm_(self.model.parameters(), gradient_clip_val)  # the norm over every mesh

    world = dist.get_world_size()
    strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=world // dp)
    trainer = pl.Trainer(accelerator=device_type(), devices=world, strategy=strategy, max_steps=STEPS,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(rows(), batch_size=BATCH // dp))
    return mean(module.losses, strategy.device_mesh["data_parallel"])


def mean(losses: list, data) -> list:
    """The losses over the whole batch: each data rank's is the mean over its part of it."""
    if data.size() == 1:
        return losses
    total = torch.tensor(losses)
    dist.all_reduce(total, group=data.get_group())
    return (total / data.size()).tolist()


def rows() -> list:
    """The rows of every step's batch, in order."""
    return [row for step in range(1, STEPS + 1) for row in zip(*synthetic_batch(step, BATCH, SEQ, CONFIG["vocab"]))]


def shuffled(step: int, batch: int, seq: int, vocab: int) -> tuple:
    """Step ``step``'s whole batch in the order the Trainer's sampler draws the rows."""
    every = rows()
    order = list(torch.utils.data.DistributedSampler(every, num_replicas=1, rank=0))
    tokens, target = zip(*[every[i] for i in order[(step - 1) * batch:step * batch]])
    return torch.stack(tokens), torch.stack(target)


def main(dp: int = 1) -> None:
    world = dist.get_world_size()
    runs = {"Fabric": with_fabric(dp), "the Trainer": with_trainer(dp)}
    problem = [None]
    if dist.get_rank() == 0:
        for name, losses in runs.items():
            torch.manual_seed(0)
            single = Llama(**CONFIG).to(device_type())
            batches = synthetic_batch if name == "Fabric" else shuffled
            expected = train(single, torch.optim.AdamW(single.parameters(), lr=1e-2), torch.Tensor.backward, False,
                             batches=batches)
            print(f"{name} on a {dp} x {world // dp} mesh: losses {[round(x, 4) for x in losses]}")
            problem[0] = problem[0] or _compare(losses, expected)
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise SystemExit(problem[0] if dist.get_rank() == 0 else 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes to start (not under torchrun)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (FSDP2); the rest tensor parallel")
    a = parser.parse_args()
    run(main, a.nproc, a.dp)
