"""Hand-written Megatron-style tensor parallelism: the baseline tpfn's step time is held to.

No DTensor, no hooks, no interpreter: each rank holds its weight shards as plain
``nn.Parameter`` tensors (sliced from the same full weights as the other variants), and the
forward calls the collectives itself through Megatron's autograd functions:

- ``f`` (``_CopyToTP``): identity forward, all-reduce backward (a column-parallel input);
- ``g`` (``_ReduceFromTP``): all-reduce forward, identity backward (a row-parallel output);
- with sequence parallelism, ``_GatherSeq`` (all-gather forward, reduce-scatter backward) in
  place of ``f`` and ``_ReduceScatterSeq`` (reduce-scatter forward, all-gather backward) in
  place of ``g``; the norms (and the row-parallel biases, added after the reduce-scatter)
  compute on the sequence shard, and their partial weight gradients are summed in one
  all-reduce of one flat buffer after backward (``finish_backward``);
- a masked vocab-parallel embedding (rows ``[lo, hi)`` of the vocabulary on each rank);
- a column-parallel head whose logits are all-gathered (``_GatherLast``: all-gather forward,
  this rank's slice backward), as the plans of ``benchmarks.step_time`` do
  (``colwise() >> prepare_out(Replicate())``, then ``F.cross_entropy`` on the full logits).

The collectives are the ones tpfn's recommended plan issues (20 per step without sequence
parallelism, 40 with, on 4 layers): same layouts, same count, same bytes.

``Comm(real=False)`` is the "compute alone" variant: every collective is left out and
replaced by the local op of the same output shape (an all-reduce by nothing, an all-gather by
n local copies, a reduce-scatter by this rank's slice), so the numbers are wrong by design and
only the time is meaningful.

Two models: PyTorch's reference ``Transformer`` (torch.testing's ``common_dtensor``) and
Hugging Face's ``LlamaForCausalLM`` (sdpa attention, GQA, rotary embeddings, RMSNorm).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Comm", "HandTransformer", "HandLlama"]


# --- plain torch.distributed collectives on local tensors -------------------------------


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, n: int, group) -> torch.Tensor:
    """The n ranks' ``x`` concatenated along ``dim``."""
    x = x.contiguous()
    if dim == 0:
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # rank-major, as gloo wants it
    dist.all_gather_into_tensor(out, x, group=group)
    shape = list(x.shape)
    shape[dim] *= n
    return out.view(n, *x.shape).movedim(0, dim).reshape(shape)


def _reduce_scatter(x: torch.Tensor, dim: int, n: int, group) -> torch.Tensor:
    """This rank's chunk along ``dim`` of the sum of the n ranks' ``x``."""
    shape = list(x.shape)
    shape[dim] //= n
    if dim != 0:  # chunks along dim, laid out rank-major for the collective
        x = x.unflatten(dim, (n, shape[dim])).movedim(dim, 0)
    x = x.contiguous()
    out = x.new_empty(shape)
    dist.reduce_scatter_tensor(out, x.reshape(n * shape[0], *shape[1:]), group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            x = x.contiguous()
        else:
            ctx.mark_dirty(x)  # summed in place, as Megatron does
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    """Sequence parallelism's f: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, dim, n, group):
        ctx.dim, ctx.n, ctx.group = dim, n, group
        return _all_gather(x, dim, n, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.n, ctx.group), None, None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """Sequence parallelism's g: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, n, group):
        ctx.dim, ctx.n, ctx.group = dim, n, group
        return _reduce_scatter(x, dim, n, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.n, ctx.group), None, None, None


class _GatherLast(torch.autograd.Function):
    """A column-parallel head's logits: all-gather forward (last dim), own slice backward."""

    @staticmethod
    def forward(ctx, x, n, rank, group):
        ctx.size, ctx.rank = x.shape[-1], rank
        return _all_gather(x, x.ndim - 1, n, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, ctx.rank * ctx.size, ctx.size).contiguous(), None, None, None


class Comm:
    """The collectives of one tensor-parallel group; ``real=False`` leaves every one out
    (``n``, ``rank``: the group's size and this rank, by default the process group's)."""

    def __init__(self, group=None, real: bool = True, n: int | None = None, rank: int | None = None):
        self.group, self.real = group, real
        self.n = dist.get_world_size(group) if n is None else n
        self.rank = dist.get_rank(group) if rank is None else rank

    def copy_to(self, x):  # f
        return _CopyToTP.apply(x, self.group) if self.real else x

    def reduce_from(self, x):  # g
        if not self.real:
            return x
        if x.requires_grad and torch.is_grad_enabled():
            return _ReduceFromTP.apply(x, self.group)
        return _all_reduce(x, self.group)

    def gather(self, x, dim: int):  # sequence parallelism's f
        if not self.real:
            return torch.cat([x] * self.n, dim)
        return _GatherSeq.apply(x, dim, self.n, self.group)

    def reduce_scatter(self, x, dim: int):  # sequence parallelism's g
        if not self.real:
            size = x.shape[dim] // self.n
            return x.narrow(dim, self.rank * size, size)
        return _ReduceScatterSeq.apply(x, dim, self.n, self.group)

    def gather_logits(self, x):
        if not self.real:
            return torch.cat([x] * self.n, -1)
        return _GatherLast.apply(x, self.n, self.rank, self.group)

    def all_reduce_grads(self, params: list) -> None:
        """Sum the partial gradients of ``params`` in one all-reduce of one flat buffer."""
        grads = [p.grad for p in params if p.grad is not None]
        if not self.real or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))


# --- shards of the full weights ----------------------------------------------------------


def _shard(t: torch.Tensor, dim: int, comm: Comm) -> nn.Parameter:
    """This rank's contiguous chunk of full tensor ``t`` along ``dim``, as a plain parameter."""
    return nn.Parameter(t.detach().chunk(comm.n, dim)[comm.rank].clone())


def _whole(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone())


def _vocab_embedding(ids, weight, lo: int):
    """Masked vocab-parallel lookup: rows [lo, lo + len(weight)); other ids give zeros."""
    mask = (ids < lo) | (ids >= lo + weight.shape[0])
    out = F.embedding((ids - lo).masked_fill(mask, 0), weight)
    return out.masked_fill(mask.unsqueeze(-1), 0)


# --- PyTorch's reference Transformer -------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, block, comm: Comm, heads: int):
        super().__init__()
        a, ff = block.attention, block.feed_forward
        self.ln1_w, self.ln1_b = _whole(block.attention_norm.weight), _whole(block.attention_norm.bias)
        self.ln2_w, self.ln2_b = _whole(block.ffn_norm.weight), _whole(block.ffn_norm.bias)
        self.eps = block.attention_norm.eps
        self.wq, self.wk, self.wv = (_shard(w.weight, 0, comm) for w in (a.wq, a.wk, a.wv))
        self.wo = _shard(a.wo.weight, 1, comm)
        self.w1, self.b1 = _shard(ff.w1.weight, 0, comm), _shard(ff.w1.bias, 0, comm)
        self.w2, self.b2 = _shard(ff.w2.weight, 1, comm), _whole(ff.w2.bias)
        self.heads, self.head_dim = heads // comm.n, a.head_dim

    def forward(self, h, comm: Comm, sp: bool):
        dim = h.shape[-1]
        x = F.layer_norm(h, (dim,), self.ln1_w, self.ln1_b, self.eps)
        x = comm.gather(x, 1) if sp else comm.copy_to(x)
        bsz, seq, _ = x.shape
        q, k, v = (F.linear(x, w).view(bsz, seq, self.heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, None, 0.0, True)
        o = F.linear(o.transpose(1, 2).reshape(bsz, seq, -1), self.wo)
        h = h + (comm.reduce_scatter(o, 1) if sp else comm.reduce_from(o))
        x = F.layer_norm(h, (dim,), self.ln2_w, self.ln2_b, self.eps)
        x = comm.gather(x, 1) if sp else comm.copy_to(x)
        y = F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2)
        y = comm.reduce_scatter(y, 1) if sp else comm.reduce_from(y)
        return h + (y + self.b2)

    def partial(self) -> list:
        return [self.ln1_w, self.ln1_b, self.ln2_w, self.ln2_b, self.b2]


class HandTransformer(nn.Module):
    """``model`` (the reference ``Transformer``, untied, no dropout) as Megatron would write it."""

    def __init__(self, model, comm: Comm, sp: bool):
        super().__init__()
        args = model.model_args
        if args.weight_tying or args.dropout_p:
            raise ValueError("the hand-written baseline takes an untied Transformer without dropout")
        self.comm, self.sp = comm, sp
        self.tok = _shard(model.tok_embeddings.weight, 0, comm)
        self.pos = _shard(model.pos_embeddings.weight, 0, comm)
        self.layers = nn.ModuleList(_Block(b, comm, args.n_heads) for b in model.layers)
        self.norm_w, self.norm_b = _whole(model.norm.weight), _whole(model.norm.bias)
        self.eps = model.norm.eps
        self.out = _shard(model.output.weight, 0, comm)

    def forward(self, tokens):
        comm, sp = self.comm, self.sp
        seq = tokens.shape[1]
        h = _vocab_embedding(tokens, self.tok, comm.rank * self.tok.shape[0])
        p = _vocab_embedding(torch.arange(seq), self.pos, comm.rank * self.pos.shape[0])
        if sp:
            h = comm.reduce_scatter(h, 1) + comm.reduce_scatter(p, 0)
        else:
            h = comm.reduce_from(h) + comm.reduce_from(p)
        for layer in self.layers:
            h = layer(h, comm, sp)
        h = F.layer_norm(h, (h.shape[-1],), self.norm_w, self.norm_b, self.eps)
        if sp:
            h = comm.gather(h, 1)
        else:
            h = comm.copy_to(h)
        return comm.gather_logits(F.linear(h, self.out)).float()

    def finish_backward(self) -> None:
        """Sequence parallelism: the norms' (and row biases') partial gradients, summed once."""
        if self.sp:
            self.comm.all_reduce_grads(
                [p for layer in self.layers for p in layer.partial()] + [self.norm_w, self.norm_b])


# --- Hugging Face's Llama -----------------------------------------------------------------


def _rms_norm(h, weight, eps: float):
    """LlamaRMSNorm as transformers computes it."""
    dtype = h.dtype
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _LlamaLayer(nn.Module):
    def __init__(self, layer, comm: Comm, config):
        super().__init__()
        a, mlp = layer.self_attn, layer.mlp
        self.ln1, self.ln2 = _whole(layer.input_layernorm.weight), _whole(layer.post_attention_layernorm.weight)
        self.eps = layer.input_layernorm.variance_epsilon
        self.q, self.k, self.v = (_shard(p.weight, 0, comm) for p in (a.q_proj, a.k_proj, a.v_proj))
        self.o = _shard(a.o_proj.weight, 1, comm)
        self.gate, self.up = _shard(mlp.gate_proj.weight, 0, comm), _shard(mlp.up_proj.weight, 0, comm)
        self.down = _shard(mlp.down_proj.weight, 1, comm)
        self.head_dim, self.scaling = a.head_dim, a.scaling
        self.gqa = a.num_key_value_groups > 1

    def forward(self, h, cos, sin, comm: Comm, sp: bool):
        x = _rms_norm(h, self.ln1, self.eps)
        x = comm.gather(x, 1) if sp else comm.copy_to(x)
        bsz, seq, _ = x.shape
        q, k, v = (F.linear(x, w).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
                   for w in (self.q, self.k, self.v))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                           scale=self.scaling, is_causal=True, enable_gqa=self.gqa)
        o = F.linear(o.transpose(1, 2).contiguous().reshape(bsz, seq, -1).contiguous(), self.o)
        h = h + (comm.reduce_scatter(o, 1) if sp else comm.reduce_from(o))
        x = _rms_norm(h, self.ln2, self.eps)
        x = comm.gather(x, 1) if sp else comm.copy_to(x)
        y = F.linear(F.silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.down)
        return h + (comm.reduce_scatter(y, 1) if sp else comm.reduce_from(y))


class HandLlama(nn.Module):
    """``model`` (a ``LlamaForCausalLM``, untied, no biases) as Megatron would write it."""

    def __init__(self, model, comm: Comm, sp: bool):
        super().__init__()
        config = model.config
        if config.tie_word_embeddings or config.attention_bias or config.mlp_bias:
            raise ValueError("the hand-written baseline takes an untied Llama without biases")
        self.comm, self.sp = comm, sp
        self.rotary = model.model.rotary_emb  # no parameters: inv_freq only
        self.embed = _shard(model.model.embed_tokens.weight, 0, comm)
        self.layers = nn.ModuleList(_LlamaLayer(layer, comm, config) for layer in model.model.layers)
        self.norm = _whole(model.model.norm.weight)
        self.eps = model.model.norm.variance_epsilon
        self.head = _shard(model.lm_head.weight, 0, comm)

    def forward(self, tokens):
        comm, sp = self.comm, self.sp
        bsz, seq = tokens.shape
        h = _vocab_embedding(tokens, self.embed, comm.rank * self.embed.shape[0])
        h = comm.reduce_scatter(h, 1) if sp else comm.reduce_from(h)
        cos, sin = self.rotary(h, torch.arange(seq).unsqueeze(0))  # attention sees the whole sequence
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer in self.layers:
            h = layer(h, cos, sin, comm, sp)
        h = _rms_norm(h, self.norm, self.eps)
        h = comm.gather(h, 1) if sp else comm.copy_to(h)
        return comm.gather_logits(F.linear(h, self.head))

    def finish_backward(self) -> None:
        if self.sp:
            self.comm.all_reduce_grads([p for layer in self.layers for p in (layer.ln1, layer.ln2)]
                                       + [self.norm])
