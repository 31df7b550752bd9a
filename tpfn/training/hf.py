"""A parallelized model in Hugging Face's training stack: its causal-LM loss, and accelerate.

``causal_lm_loss`` is transformers' ``ForCausalLMLoss`` (labels shifted one position left,
``ignore_index`` -100, a sum over ``num_items_in_batch`` when the Trainer counts the tokens)
on logits sharded over the vocabulary: the vocabulary-parallel ``tpfn.cross_entropy``, which
never gathers them. Set as a model's ``loss_function``, it is what ``model(ids, labels=ids)``
computes.

``for_accelerate(model)`` readies a parallelized model for accelerate's tensor-parallel path
(``ParallelismConfig(tp_size=n)``, which ``transformers.Trainer`` takes through
``TrainingArguments(parallelism_config=...)``): it tells accelerate the model's degree where
accelerate reads it, refuses data-parallel ranks that nothing would keep in step, and sets the
loss function of a model whose logits the plan leaves sharded (docs/integrations.md).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tpfn.interpret.parallelize import runtime
from tpfn.layout import Shard
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


def for_accelerate(model: nn.Module) -> nn.Module:
    """``model``, parallelized by tpfn, made ready for ``accelerator.prepare`` under
    ``ParallelismConfig(tp_size=n)`` and for ``transformers.Trainer``; returns ``model``.

    - Its tensor-parallel degree is put where accelerate reads it: a transformers model's
      ``config.distributed_config`` (as ``{"tp_size": n}``), another module's ``tp_size``.
    - On more ranks than the degree (``dp_shard_size`` > 1), every trainable parameter must be
      sharded over the data ranks by FSDP2 (``fully_shard(model, mesh=mesh["dp_shard"])``
      first): accelerate's tensor-parallel path adds no data-parallel gradient sum of its own,
      so the data ranks would train apart. Refused with a ``ValueError`` naming them.
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
        names = ", ".join(map(repr, apart[:3])) + (f" and {len(apart) - 3} more" if len(apart) > 3 else "")
        raise ValueError(
            f"for_accelerate: {world} ranks and a tensor-parallel degree of {degree}, so {world // degree} "
            f"data-parallel ranks, but {names} {'is' if len(apart) == 1 else 'are'} not sharded over "
            f"them{sharded}: accelerate's tensor-parallel path sums no gradients over the data ranks, "
            "so they would train apart. Shard the model over them with FSDP2 first: "
            "fully_shard(model, mesh=mesh['dp_shard']) (and each block before it).")
    if isinstance(getattr(type(model), "tp_size", None), property):  # transformers' read-only tp_size
        config = model.config
        held = getattr(config, "distributed_config", None)
        if held is not None and not isinstance(held, dict):
            raise ValueError(f"for_accelerate: the model's config already holds {held!r}: transformers "
                             "sharded it itself; parallelize a model loaded without distributed_config.")
        config.distributed_config = {"tp_size": degree}
    else:
        model.tp_size = degree
    set_loss(model)
    return model
