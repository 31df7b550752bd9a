"""Train a tpfn model with transformers' Trainer, then with accelerate; check both against one process.

    python examples/train_hf.py                    # 2 CPU processes: tensor parallel over 2
    python examples/train_hf.py --nproc 4 --dp 2   # FSDP2 over 2 data ranks x tpfn over 2
    torchrun --nproc-per-node 2 examples/train_hf.py

A tiny Llama (built from a config: nothing is downloaded) is parallelized with its own
``tp_plan`` (``tpfn.from_hf``), its head left sharded over the vocabulary, so that
``labels=`` computes the vocabulary-parallel loss. accelerate's tensor-parallel path
(``ParallelismConfig(tp_size=...)``) builds the mesh, feeds every tensor-parallel rank the
same batch and clips gradients across meshes; the Trainer takes it through
``TrainingArguments(parallelism_config=...)``. Rank 0 trains the same model from the same
seed in one process alongside and compares the loss curves and gradient norms.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch import device_type, run  # noqa: E402

STEPS, BATCH, SEQ, VOCAB = 4, 4, 16, 64
LORA = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # column- and row-wise bases


def _lift_cpu_refusal() -> None:
    """accelerate (1.16) lends ``ParallelismConfig`` to accelerators only: on CPU it refuses with
    "ParallelismConfig is only compatible DistributedType.FSDP (version 2) or
    DistributedType.Multi{Device} ... but got DistributedType.MULTI_CPU", though its tensor-parallel
    path needs nothing of a GPU. To run that same path on CPU (gloo), this lifts the check for
    MULTI_CPU alone, where the sizes multiply to the number of processes; on GPUs nothing changes."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DistributedType

    check = ParallelismConfig._validate_accelerator

    def validate(self, accelerator):
        if accelerator.distributed_type != DistributedType.MULTI_CPU or self.total_size != accelerator.num_processes:
            check(self, accelerator)

    ParallelismConfig._validate_accelerator = validate


def build(lora: bool = False):
    """The tiny Llama, seeded (``lora``: with PEFT's LoRA adapters, initialised at random)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device_type())
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # B random too (init_lora_weights=False), so that every adapter weight counts
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA, init_lora_weights=False))


def parallel(model, mesh):
    """``model`` (or the one PEFT wraps) parallelized on accelerate's ``mesh`` by its own plan, the
    head left sharded over the vocabulary, FSDP2 over the data ranks; ready for accelerate."""
    import tpfn

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # the one PEFT wraps
    plan = tpfn.from_hf(hf.tp_plan, hf).override({"lm_head": tpfn.colwise(local=False)})
    tpfn.parallelize(hf, mesh["tp"], plan)
    if "dp_shard" in mesh.mesh_dim_names:
        from torch.distributed.fsdp import fully_shard

        for layer in hf.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(hf, mesh=mesh["dp_shard"])
    return tpfn.for_accelerate(model)


def dataset() -> list:
    """Runs of consecutive token ids from random starts: learnable within a few steps."""
    starts = torch.randint(0, VOCAB, (STEPS * BATCH, 1), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": ids, "labels": ids} for ids in (starts + torch.arange(SEQ)) % VOCAB]


def shared_directory() -> str:
    """A new temporary directory, the same on every rank."""
    path = [tempfile.mkdtemp(prefix="tpfn-train-hf-") if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(path, src=0)
    return path[0]


def with_trainer(pc, dp: int, lora: bool = False) -> tuple:
    """(losses, gradient norms) of ``transformers.Trainer``, the model and the directory it saved
    it in (a checkpoint at the last step, and ``trainer.save_model()``); ``pc``: accelerate's parallelism."""
    from transformers import Trainer, TrainingArguments

    model = build(lora)
    if pc is not None:
        model = parallel(model, pc.get_device_mesh(device_type()))
    settings = dict(max_steps=STEPS, save_steps=STEPS, per_device_train_batch_size=BATCH // dp, logging_steps=1,
                    learning_rate=5e-2 if lora else 1e-2, report_to=[], seed=0, disable_tqdm=True,
                    use_cpu=device_type() == "cpu")
    args = TrainingArguments(shared_directory(), parallelism_config=pc, max_grad_norm=0.5, save_only_model=True, **settings)
    trainer = Trainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    trainer.save_model()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return ([h["loss"] for h in logs], [h["grad_norm"] for h in logs]), model, args.output_dir


def saved_as_trained(model, directory: str, mesh, lora: bool) -> str | None:
    """Whether what the Trainer saved in ``directory`` (its last checkpoint and ``save_model()``'s)
    loads in transformers (or PEFT) on one device and in ``tpfn.from_pretrained`` on ``mesh``,
    equal to the trained ``model`` bit for bit; the problem, or None (rank 0 says)."""
    import tpfn

    full = tpfn.checkpoint.full_state_dict(model)
    problems = []
    for path in (directory, os.path.join(directory, f"checkpoint-{STEPS}")):
        if lora:
            if dist.get_rank() == 0:
                from peft import PeftModel

                reloaded = PeftModel.from_pretrained(build(), path)  # PEFT alone, one device
                adapters = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
                if len(adapters) != 2 * 2 * len(LORA) or any(not torch.equal(p, full[n]) for n, p in adapters.items()):
                    problems.append(f"{path}: PEFT reads adapters other than the trained ones")
            continue
        if dist.get_rank() == 0:
            from transformers import AutoModelForCausalLM

            plain = AutoModelForCausalLM.from_pretrained(path).state_dict()  # transformers alone, one device
            if plain.keys() != full.keys() or any(not torch.equal(t, full[k]) for k, t in plain.items()):
                problems.append(f"{path}: transformers loads weights other than the trained ones")
        again = tpfn.checkpoint.full_state_dict(tpfn.from_pretrained(path, mesh["tp"], progress=False))
        if again.keys() != full.keys() or any(not torch.equal(t, full[k]) for k, t in again.items()):
            problems.append(f"{path}: tpfn.from_pretrained loads weights other than the trained ones")
    return "; ".join(problems) or None


def refuses_optimizer_checkpoints(model, pc, directory: str) -> str | None:
    """Whether the Trainer refuses to checkpoint the optimizer state of ``model`` (which rank 0
    alone would write, its own shards only); the problem, or None."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(directory, parallelism_config=pc, save_only_model=False, report_to=[],
                             use_cpu=device_type() == "cpu")
    try:
        Trainer(model=model, args=args)
    except ValueError as e:
        if "Pass `save_only_model=True`" in str(e):
            return None
        raise
    return "the Trainer takes save_only_model=False, whose checkpoints hold rank 0's shards of the optimizer state"


def with_accelerate(pc, dp: int) -> tuple:
    """(losses, gradient norms) of a loop over ``accelerator.prepare``d model, optimizer and data."""
    from accelerate import Accelerator

    import tpfn

    accelerator = Accelerator(parallelism_config=pc, cpu=device_type() == "cpu")
    model = build() if pc is None else parallel(build(), accelerator.torch_device_mesh)
    optimizer = torch.optim.AdamW(tpfn.param_groups(model), lr=1e-2)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH // dp)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms = [], []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if dp > 1:  # each data rank's mean over its half of the batch
            dist.all_reduce(total, group=accelerator.torch_device_mesh["dp_shard"].get_group())
        losses.append(total.item() / dp)
    return losses, norms


TRAINER_RUNS = {"trainer": False, "trainer with LoRA": True}  # name: with PEFT's LoRA


def one_process() -> dict:
    curves = {}
    for name, lora in TRAINER_RUNS.items():
        curves[name], _, directory = with_trainer(None, 1, lora)
        shutil.rmtree(directory)
    curves["accelerate"] = with_accelerate(None, 1)
    return curves


def main(dp: int = 1, reference: str | None = None) -> None:
    """Train on every rank; ``reference``: a file of the one-process run's curves, made if missing."""
    from accelerate import ParallelismConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    single = None
    if rank == 0 and not (reference and os.path.exists(reference)):  # one process, alongside:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        single = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--one-process"],  # accelerate's
                                  stdout=subprocess.PIPE, env=env, text=True)  # state is one per process
    if device_type() == "cpu":
        _lift_cpu_refusal()
    pc = ParallelismConfig(tp_size=world // dp, dp_shard_size=dp)
    runs, problems = {}, []
    for name, lora in TRAINER_RUNS.items():
        if lora and dp > 1:
            continue  # LoRA on the tensor-parallel mesh alone
        runs[name], model, directory = with_trainer(pc, dp, lora)
        problems.append(saved_as_trained(model, directory, pc.get_device_mesh(device_type()), lora))
        problems.append(refuses_optimizer_checkpoints(model, pc, directory))
        dist.barrier()  # every rank has read it
        if rank == 0:
            shutil.rmtree(directory)
    runs["accelerate"] = with_accelerate(pc, dp)
    problem = [None]
    if rank == 0:
        from train_llama import _compare

        if single is not None:
            curves = single.communicate()[0].strip().splitlines()[-1]
            if reference:
                with open(reference, "w") as f:
                    f.write(curves)
        else:
            with open(reference) as f:
                curves = f.read()
        single = json.loads(curves)
        problem[0] = next((p for p in problems if p), None)
        print(f"the Trainer's checkpoints: {problem[0] or 'transformers and tpfn.from_pretrained load the trained weights'}")
        for name, (losses, norms) in runs.items():
            print(f"{name}: losses {[round(x, 4) for x in losses]}, gradient norms "
                  f"{[round(x, 4) for x in norms]} on a {dp} x {world // dp} mesh")
            gap = max(abs(a - b) / b for a, b in zip(norms, single[name][1]))
            problem[0] = problem[0] or _compare(losses, single[name][0]) or (
                f"{name}: the gradient norms leave one process's (relative gap {gap:.1e})" if gap > 1e-3 else None)
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise SystemExit(problem[0] if rank == 0 else 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes to start (not under torchrun)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (FSDP2); the rest tensor parallel")
    parser.add_argument("--reference", help="a file of the one-process run's curves (written if missing)")
    parser.add_argument("--one-process", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.one_process:
        print(json.dumps(one_process()))
    else:
        run(main, a.nproc, a.dp, a.reference)
