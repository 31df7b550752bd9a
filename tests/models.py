"""Models, plans and comparisons shared by the multi-rank tests."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
from torch.utils._python_dispatch import TorchDispatchMode

import tpfn
from tpfn import Replicate, Shard, colwise, prepare_in, prepare_out, rowwise, sequence_parallel


def full(t: torch.Tensor) -> torch.Tensor:
    """The global value of a DTensor (a plain tensor as it is)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 for two zero tensors)."""
    a, b = full(a).double(), full(b).double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_rel_err(model: nn.Module, reference: nn.Module, grads: bool = False) -> dict:
    """Relative error of every parameter (or its gradient) against the reference model's."""
    ref = dict(reference.named_parameters())
    out = {}
    for name, p in model.named_parameters():
        a, b = (p.grad, ref[name].grad) if grads else (p, ref[name])
        out[name] = rel_err(a, b)
    return out


def counts(fn) -> dict:
    """Collective counts by kind while ``fn()`` runs."""
    with CommDebugMode() as mode:
        fn()
    return tpfn.trace.counts(mode)


def one_step(tp: nn.Module, ref: nn.Module, x: torch.Tensor) -> tuple:
    """One forward and backward (of the output's sum) of ``tp`` and of the one-device ``ref``
    on ``x``: the relative errors of the output, the input's gradient, every parameter and
    every gradient (global values, packed layouts included), and the collective counts of
    the forward and of the backward."""
    from tpfn.interpret.layouts import full_value, layouts

    x, x2 = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    expected = ref(x)
    expected.sum().backward()
    with CommDebugMode() as forward:
        out = tp(x2)
    with CommDebugMode() as backward:
        out.sum().backward()
    placed, theirs = layouts(tp), dict(ref.named_parameters())
    errors = {"output": rel_err(out, expected), "input.grad": rel_err(x2.grad, x.grad)}
    for name, p in tp.named_parameters():
        errors[name] = rel_err(full_value(p, placed.get(name)), theirs[name])
        errors[name + ".grad"] = rel_err(full_value(p.grad, placed.get(name)), theirs[name].grad)
    return errors, tpfn.trace.counts(forward), tpfn.trace.counts(backward)


def transformer(seed: int = 0, **kw) -> Transformer:
    """PyTorch's reference Transformer (no dropout unless asked) with fixed weights."""
    torch.manual_seed(seed)
    return Transformer(ModelArgs(**{"dropout_p": 0.0, **kw}))


def local_heads(model: Transformer, tp: int) -> Transformer:
    """Attention that views local heads: what colwise q/k/v with local outputs need."""
    for layer in model.layers:
        layer.attention.n_heads = model.model_args.n_heads // tp
    return model


def transformer_plan(sp: bool, minimal: bool = True) -> dict:
    """tpfn's plan for the reference Transformer (``minimal``: q, k, v share one input grad)."""
    if not sp:
        return {
            "tok_embeddings": rowwise(),
            "pos_embeddings": rowwise(),
            **({"layers.*.attention": prepare_in(Replicate(), local=True)} if minimal else {}),
            "layers.*.attention.w[qkv]": colwise(),
            "layers.*.attention.wo": rowwise(),
            "layers.*.feed_forward.w1": colwise(),
            "layers.*.feed_forward.w2": rowwise(),
            "output": colwise() >> prepare_out(Replicate()),
        }
    return {
        "tok_embeddings": rowwise() >> prepare_out(Shard(1)),
        "pos_embeddings": rowwise() >> prepare_out(Shard(0)),
        "norm": sequence_parallel(local=True),
        "layers.*.attention_norm": sequence_parallel(local=True),
        "layers.*.ffn_norm": sequence_parallel(local=True),
        "layers.*.attention": prepare_in(Shard(1), desired=Replicate(), local=True),
        "layers.*.attention.w[qkv]": colwise(),
        "layers.*.attention.wo": rowwise() >> prepare_out(Shard(1)),
        "layers.*.feed_forward.w1": prepare_in(Shard(1)) >> colwise(),
        "layers.*.feed_forward.w2": rowwise() >> prepare_out(Shard(1)),
        "output": prepare_in(Shard(1)) >> colwise() >> prepare_out(Replicate()),
    }


def native_transformer(model: Transformer, mesh, sp: bool) -> Transformer:
    """PyTorch's own plan for its reference Transformer, with local attention heads."""
    return Transformer.parallelize(model, mesh, sp, local_output_for_attn=True)


def native_transformer_plan(sp: bool) -> dict:
    """The same plan as ``Transformer.parallelize`` in PyTorch styles, as one FQN dict."""
    S, R = TShard, TReplicate
    if not sp:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=R(), output_layouts=R()),
            "pos_embeddings": RowwiseParallel(input_layouts=R(), output_layouts=R()),
            "layers.*.attention.wq": ColwiseParallel(),
            "layers.*.attention.wk": ColwiseParallel(),
            "layers.*.attention.wv": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward.w1": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(),
            "output": ColwiseParallel(output_layouts=R()),
        }
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=R(), output_layouts=S(1)),
        "pos_embeddings": RowwiseParallel(input_layouts=R(), output_layouts=S(0)),
        "norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=S(1), desired_input_layouts=R()),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=S(1)),
        "layers.*.feed_forward.w1": ColwiseParallel(input_layouts=S(1)),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=S(1)),
        "output": ColwiseParallel(input_layouts=S(1), output_layouts=R()),
    }


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


MATMULS = {"aten.mm": "mm", "c10d.allreduce_": "all_reduce"}  # for Ops: matrix products, all-reduces


class Ops(TorchDispatchMode):
    """The ops of a run named in ``labels`` (op name prefix -> label), in order, by label:
    ``with Ops({"aten.mm": "mm", "c10d.allreduce_": "all_reduce"}) as seen: ...``."""

    def __init__(self, labels: dict):
        super().__init__()
        self.labels, self.ops = labels, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        for prefix, label in self.labels.items():
            if name.startswith(prefix):
                self.ops.append(label)
                break
        return func(*args, **(kwargs or {}))
