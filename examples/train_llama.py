"""tpfn's demo: train a small Llama-style model with tensor parallelism, check it against one process.

    python examples/train_llama.py                       # 2 CPU processes with gloo
    python examples/train_llama.py --sequence-parallel   # norms and residuals on sequence slices
    torchrun --nproc-per-node 2 examples/train_llama.py  # the same under torchrun (NCCL on GPUs)

Every rank holds half of every attention and MLP projection and half of the vocabulary;
the loss is computed on vocabulary-sharded logits. At the end, every rank trains the same model
from the same seed on its own, as one process would, and the two loss curves are compared.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpfn  # noqa: E402
from launch import device_type, run  # noqa: E402
from llama import Llama, llama_plan, synthetic_batch  # noqa: E402

CONFIG = dict(vocab=256, dim=64, layers=2, heads=8, kv_heads=4, hidden=128)


def train(model, steps: int, batch: int, seq: int, sharded_loss: bool, log=None) -> list:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        tokens, target = (t.to(device_type()) for t in synthetic_batch(step, batch, seq, CONFIG["vocab"]))
        opt.zero_grad()
        logits = model(tokens).flatten(0, 1)
        loss_fn = tpfn.cross_entropy if sharded_loss else torch.nn.functional.cross_entropy
        loss = loss_fn(logits, target.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log:
            log(step, losses[-1], batch * seq / (time.perf_counter() - start))
    return losses


def main(steps: int = 30, batch: int = 8, seq: int = 64, sequence_parallel: bool = False) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    mesh = init_device_mesh(device_type(), (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Llama(**CONFIG).to(device_type())
    params = sum(p.numel() for p in model.parameters())
    plan = llama_plan(sequence_parallel_=sequence_parallel, loss_parallel=True)
    tpfn.parallelize(model, mesh, plan)
    say(f"tpfn demo: a Llama-style model ({CONFIG['layers']} layers, dim {CONFIG['dim']}, "
        f"{CONFIG['heads']} heads, {CONFIG['kv_heads']} KV heads, {params / 1e3:.0f}k parameters)")
    say(f"tensor parallel over {world} ranks ({dist.get_backend()}, {device_type()}), sequence "
        f"parallel {'on' if sequence_parallel else 'off'}, vocab-parallel loss; the plan:")
    for pattern, style in plan.rules:
        say(f"  {pattern:<22} {style!r}")

    def log(step, loss, tokens_per_s):
        say(f"step {step:>3}/{steps}  loss {loss:.4f}  {tokens_per_s:>9,.0f} tokens/s")

    parallel = train(model, steps, batch, seq, sharded_loss=True, log=log)
    # Every rank trains the one-process model itself (the same numbers on each) and compares: no
    # rank waits at a collective while another works alone, however long the run, and every rank
    # ends alike.
    torch.manual_seed(0)
    single = train(Llama(**CONFIG).to(device_type()), steps, batch, seq, sharded_loss=False)
    problem = _compare(parallel, single, say)
    if problem:
        raise SystemExit(problem if rank == 0 else 1)


EARLY = 30  # steps compared closely: float32 sums in another order drift apart only later


def _compare(parallel: list, single: list, say=print) -> str | None:
    """Compare two loss curves as a user would: the first ``EARLY`` steps within 1e-3
    (relative), and every step within a twentieth of the first loss (absolute: near zero loss a
    relative gap means nothing, and over hundreds of Adam steps two orders of the same float32
    sums drift apart); the problem, or None. ``say`` prints the figures."""
    early = max(abs(a - b) / b for a, b in zip(parallel[:EARLY], single[:EARLY]))
    late = max(abs(a - b) for a, b in zip(parallel, single))
    say(f"one process, same seed: final loss {single[-1]:.4f} (tensor parallel {parallel[-1]:.4f}; "
          f"largest relative gap over the first {min(EARLY, len(single))} steps {early:.1e}, largest "
          f"absolute gap over all {len(single)} steps {late:.1e})")
    if early > 1e-3 or late > single[0] / 20 or not parallel[-1] < parallel[0]:
        return "the tensor-parallel run does not match the single-process run"
    return None

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--nproc", type=int, default=2, help="processes to start (not under torchrun)")
    a = parser.parse_args()
    run(main, a.nproc, a.steps, a.batch, a.seq, a.sequence_parallel)
