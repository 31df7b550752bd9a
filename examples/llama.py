"""A small Llama-style language model and its tensor-parallel plan, shared by the examples.

RMSNorm, rotary position embeddings, grouped-query attention, a SwiGLU MLP, tied input and
output embeddings. Attention views its heads with -1, so it runs unchanged on the local
heads that column-wise q, k, v hand on.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpfn import Replicate, Shard, colwise, plan, prepare_in, prepare_out, rowwise, sequence_parallel


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim, self.groups = dim // heads, heads // kv_heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = (t.repeat_interleave(self.groups, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn, self.mlp = Attention(dim, heads, kv_heads), MLP(dim, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab=256, dim=64, layers=2, heads=4, kv_heads=2, hidden=172, max_seq=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)
        angles = torch.outer(torch.arange(max_seq), 10000 ** (-torch.arange(0, dim // heads, 2) / (dim // heads)))
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.head(self.norm(h))


def synthetic_batch(step: int, batch: int, seq: int, vocab: int):
    """(tokens, targets) of training step ``step``, the same on every rank: sequences that
    count in steps of 7 from a random start, so the next token is learnable."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    tokens = (start + 7 * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def llama_plan(sequence_parallel_: bool = False, loss_parallel: bool = False):
    """Megatron's layout, at its communication minimum: q, k, v (and gate, up) share one
    annotated input, so each all-reduces its gradient once.

    With sequence parallelism the residual stream and the norms run on slices of the
    sequence, all-gathered before attention and the MLP and reduce-scattered after. With
    ``loss_parallel`` the head hands on its logits sharded over the vocabulary, a DTensor
    for ``tpfn.cross_entropy``; else they are gathered.
    """
    seq = Shard(1) if sequence_parallel_ else Replicate()
    block = {
        "attn": prepare_in(seq, desired=Replicate()),
        "attn.[qkv]": colwise(),
        "attn.o": rowwise() >> prepare_out(seq),
        "mlp": prepare_in(seq, desired=Replicate()),
        "mlp.gate": colwise(),
        "mlp.up": colwise(),
        "mlp.down": rowwise() >> prepare_out(seq),
    }
    if sequence_parallel_:
        block.update({"attn_norm": sequence_parallel(local=True), "mlp_norm": sequence_parallel(local=True)})
    return plan({
        "embed": rowwise() >> prepare_out(seq),
        "blocks.*": block,
        **({"norm": sequence_parallel(local=True)} if sequence_parallel_ else {}),
        "head": prepare_in(seq) >> (colwise(local=False) if loss_parallel
                                    else colwise() >> prepare_out(Replicate())),
    })
