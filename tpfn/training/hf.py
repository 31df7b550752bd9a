"""A parallelized model in Hugging Face's training stack: its causal-LM loss, and accelerate.

``causal_lm_loss`` is transformers' ``ForCausalLMLoss`` (labels shifted one position left,
``ignore_index`` -100, a sum over ``num_items_in_batch`` when the Trainer counts the tokens)
on logits sharded over the vocabulary: the vocabulary-parallel ``tpfn.cross_entropy``, which
never gathers them. Set as a model's ``loss_function``, it is what ``model(ids, labels=ids)``
computes.

``for_accelerate(model)`` readies a parallelized model for ``transformers.Trainer`` and for
accelerate's tensor-parallel path (``ParallelismConfig(tp_size=n)``): it records the model as
transformers records a model it shards itself, so that the Trainer trains it unwrapped and
saves it through transformers' own gathering (``save_pretrained`` on every rank); it refuses
data-parallel ranks that nothing would keep in step and layouts transformers would save out of
order, and sets the loss function of a model whose logits the plan leaves sharded
(docs/integrations.md).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tpfn.interpret.layouts import layouts
from tpfn.interpret.parallelize import runtime
from tpfn.layout import Shard, as_layout
from tpfn.training.loss import cross_entropy

__all__ = ["causal_lm_loss", "for_accelerate"]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                   num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, *, mesh: DeviceMesh | None = None,
                   **kwargs: object) -> torch.Tensor:
    """transformers' causal-LM loss on logits whole or sharded over the vocabulary.

    ``logits`` (batch, sequence, vocab): a DTensor sharded on the vocabulary (a head ending
    in ``colwise(local=False)``), a local slice of it with ``mesh`` given, or a plain tensor
    (the whole vocabulary: ``F.cross_entropy``). ``labels`` (batch, sequence) are shifted one
    position left (the last position predicts nothing) unless ``shift_labels`` is given;
    ``ignore_index`` positions count for nothing; the mean is over the counted positions, or
    the sum over ``num_items_in_batch`` when it is given (the Trainer's count across its
    batches). ``vocab_size`` and other keywords are transformers' and checked or ignored alike.
    Set it as a transformers model's loss: ``model.loss_function = tpfn.causal_lm_loss``.

    >>> import torch
    >>> logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    >>> expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    >>> torch.allclose(causal_lm_loss(logits, labels, 11), expected)
    True
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    local_slice = mesh is not None and not isinstance(logits, DTensor)
    if vocab_size is not None and not local_slice and vocab_size != logits.shape[-1]:
        raise ValueError(f"causal_lm_loss: the logits hold {logits.shape[-1]} classes, the model's "
                         f"vocab_size is {vocab_size}: a head whose output is this rank's slice of the "
                         "vocabulary must hand it on as a DTensor (colwise(local=False)) or pass mesh=.")
    target = shift_labels.reshape(-1).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    if isinstance(logits, DTensor) and all(p.is_replicate() for p in logits.placements):
        logits = logits.to_local()
    flat = logits.float().flatten(0, -2)
    if isinstance(flat, DTensor) or mesh is not None:
        loss = cross_entropy(flat, target, ignore_index=ignore_index, reduction=reduction, mesh=mesh)
    else:
        loss = F.cross_entropy(flat, target, ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                       else num_items_in_batch)
    return loss


def _refused_loss(loss_type: str, *args, **kwargs):
    raise ValueError(
        f"this model's logits are sharded over the vocabulary, and its loss ({loss_type}) is "
        "transformers' own, which would need them whole: call the model without labels= and "
        "compute the loss from the sharded logits with tpfn.cross_entropy, or gather the head's "
        "output (colwise() >> prepare_out(Replicate())).")


def sharded_logits(model: nn.Module):
    """``(mesh, local)`` where ``model``'s output head (``get_output_embeddings()``) hands on its
    logits sharded over the vocabulary (``local``: as this rank's slice), else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    rt = runtime(head) if isinstance(head, nn.Module) else None
    if rt is None or not rt.mount.outputs.slots:
        return None
    last = rt.mount.outputs.slots[0].out
    if isinstance(last, Shard) and last.dim in (-1, 2):
        return rt.mesh, rt.mount.outputs.local
    return None


def set_loss(model: nn.Module) -> None:
    """Where ``model``'s plan leaves its logits sharded over the vocabulary, make its
    ``labels=`` loss the vocabulary-parallel ``causal_lm_loss`` (a causal LM), or one that
    raises, naming ``tpfn.cross_entropy`` (any other loss)."""
    found = sharded_logits(model)
    if found is None or not hasattr(model, "loss_function"):
        return
    mesh, local = found
    loss_type = getattr(model, "loss_type", None) or "ForCausalLM"
    if loss_type == "ForCausalLM":
        model.loss_function = functools.partial(causal_lm_loss, mesh=mesh) if local else causal_lm_loss
    else:
        model.loss_function = functools.partial(_refused_loss, loss_type)


def _tensor_parallel_mesh(model: nn.Module):
    meshes = {id(rt.mesh): rt.mesh for rt in map(runtime, model.modules()) if rt is not None}
    if len(meshes) != 1:
        raise ValueError("for_accelerate: the model is not parallelized by tpfn (no module runs a style)"
                         if not meshes else
                         f"for_accelerate: the model runs on {len(meshes)} tensor-parallel meshes; accelerate "
                         "knows one degree: parallelize the whole model over one mesh.")
    return next(iter(meshes.values()))


def _apart(model: nn.Module, tp_mesh) -> list:
    """The trainable parameters nothing keeps in step across data-parallel ranks: plain ones,
    and DTensors on the tensor-parallel mesh alone (FSDP2 would have put them on the data mesh)."""
    return [name for name, p in model.named_parameters() if p.requires_grad
            and (not isinstance(p, DTensor) or p.device_mesh == tp_mesh)]


def _transformers_model(model: nn.Module):
    """The transformers model in ``model`` (itself, or the base model PEFT wraps), or None."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return inner if isinstance(getattr(type(inner), "tp_size", None), property) else None


def _out_of_order(model: nn.Module) -> list:
    """The tensors whose DTensor a plain ``full_tensor()`` gathers out of order: packed of
    unequal parts (``Shard(d, parts=(q, k, v))``), which DTensor has no placement for."""
    return [name for name, layout in layouts(model).items()
            if any(isinstance(p, Shard) and isinstance(p.parts, tuple) for p in as_layout(layout))]


def _declare(model: nn.Module, degree: int, data: int) -> None:
    """Record on a transformers ``model`` what ``from_pretrained(distributed_config=...)`` records
    on a model it shards, which the Trainer, accelerate, PEFT and ``save_pretrained`` read: a
    ``DistributedConfig`` on a config of its own (a copy: a config other models share stays
    as it was), the degree, and that the model keeps its own placement and gradients."""
    from transformers import DistributedConfig

    shared = model.config
    own = copy.copy(shared)
    own.distributed_config = DistributedConfig(tp_size=degree, fsdp_size=data)
    for module in model.modules():
        if module.__dict__.get("config") is shared:
            module.config = own
    model._tp_size = degree
    model._is_distributed_loading_by_transformers = True


def for_accelerate(model: nn.Module) -> nn.Module:
    """``model``, parallelized by tpfn, made ready for ``transformers.Trainer`` and for
    ``accelerator.prepare`` under ``ParallelismConfig(tp_size=n)``; returns ``model``.

    - A transformers model (or a PEFT model around one) is recorded as transformers records a
      model it shards itself (``from_pretrained(distributed_config=...)``): its config, copied
      so that no other model sees it, holds a ``transformers.DistributedConfig`` of the
      tensor-parallel degree and the data-parallel one; ``model.tp_size`` is the degree. The
      Trainer then trains it unwrapped, and ``trainer.save_model()`` and its checkpoints
      (``save_only_model=True``) gather it on every rank and write a checkpoint that
      transformers and ``tpfn.from_pretrained`` load. Another module gets ``tp_size`` (what
      accelerate reads).
    - On more ranks than the degree (``dp_shard_size`` > 1), every trainable parameter must be
      sharded over the data ranks by FSDP2 (``fully_shard(model, mesh=mesh["dp_shard"])``
      first): accelerate's tensor-parallel path adds no data-parallel gradient sum of its own,
      so the data ranks would train apart. Refused with a ``ValueError`` naming them.
    - A transformers model holding tensors packed of unequal parts (``colwise(parts=(q, k,
      v))``) is refused: transformers' saving gathers them with DTensor's ``full_tensor()``,
      which puts their parts out of order (``tpfn.save_pretrained`` does not).
    - Where the plan leaves the logits sharded over the vocabulary, ``labels=`` computes
      ``causal_lm_loss`` on them (a causal LM; another loss raises, naming ``tpfn.cross_entropy``).

    >>> import torch.nn as nn, tpfn
    >>> mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    >>> model = tpfn.parallelize(nn.Sequential(nn.Linear(4, 4)), mesh, {"0": tpfn.colwise()})
    >>> for_accelerate(model).tp_size
    1
    """
    mesh = _tensor_parallel_mesh(model)
    degree = mesh.size()
    world = dist.get_world_size() if dist.is_initialized() else 1
    apart = _apart(model, mesh) if world > degree else []
    if apart:
        sharded = " (fully_shard covers only some of it)" if any(
            isinstance(m, FSDPModule) for m in model.modules()) else ""
        raise ValueError(
            f"for_accelerate: {world} ranks and a tensor-parallel degree of {degree}, so {world // degree} "
            f"data-parallel ranks, but {_some(apart)} {'is' if len(apart) == 1 else 'are'} not sharded over "
            f"them{sharded}: accelerate's tensor-parallel path sums no gradients over the data ranks, "
            "so they would train apart. Shard the model over them with FSDP2 first: "
            "fully_shard(model, mesh=mesh['dp_shard']) (and each block before it).")
    hf = _transformers_model(model)
    if hf is not None:
        unequal = _out_of_order(model)
        if unequal:
            raise ValueError(
                f"for_accelerate: {_some(unequal)} {'is' if len(unequal) == 1 else 'are'} packed of unequal "
                "parts (parts=(...)), which DTensor has no placement for: transformers' save_pretrained, "
                "which trainer.save_model() and the Trainer's checkpoints call, would gather "
                f"{'it' if len(unequal) == 1 else 'them'} with full_tensor() and write the parts out of order. "
                "Shard the fused projection with equal parts or contiguously (the model's own plan: "
                "tpfn.from_hf), or train it in a loop of your own and save with tpfn.save_pretrained.")
        _declare(hf, degree, world // degree)
    else:
        model.tp_size = degree
    set_loss(model if hf is None else hf)
    return model


def _some(names: list) -> str:
    """The first three of ``names``, quoted, and how many more."""
    return ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
