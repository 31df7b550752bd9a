"""Small models written as the libraries users bring to suggest write them (timm, torchvision,
nanoGPT, torch's own ``nn.Transformer``, a sparse mixture of experts), nothing downloaded: each class's forward is spelled as
its library's is. ``MODELS`` maps a name to ``(build, example input)``; ``tests/test_suggest.py``
runs them on fake and on gloo ranks, ``tools/shaped_sweep.py`` on 2 and 4 ranks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Mlp(nn.Module):
    """timm's ``Mlp``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TimmAttention(nn.Module):
    """timm's ``Attention``: q, k and v in one ``qkv``, unpacked by ``reshape(B, N, 3, H, D)``."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class TimmBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), TimmAttention(dim, num_heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmViT(nn.Module):
    """timm's ``VisionTransformer`` (``vit_tiny``: 192 features in 3 heads), its blocks an
    ``nn.Sequential``."""

    def __init__(self, dim: int = 192, num_heads: int = 3, depth: int = 2, image: int = 32, patch: int = 8):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[TimmBlock(dim, num_heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class SparseMoE(nn.Module):
    """A sparse top-2 mixture of experts routed by ``torch.where`` (Mixtral's reference loop)."""

    def __init__(self, dim: int = 32, hidden: int = 64, experts: int = 4, k: int = 2):
        super().__init__()
        self.k, self.gate = k, nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Mlp(dim, hidden) for _ in range(experts))

    def forward(self, x):
        b, t, c = x.shape
        x = x.reshape(-1, c)
        weights, chosen = torch.topk(F.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel():
                out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(b, t, c)


class MoEBlock(nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), TimmAttention(dim, 4)
        self.norm2, self.moe = nn.LayerNorm(dim), SparseMoE(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: its width read from ``x.size()``."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoMLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), NanoMLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's ``GPT``: a ``ModuleDict`` of embeddings, blocks and the final norm, its head
    tied to the token embedding; it takes token ids as floats (the tests ask for an input
    gradient)."""

    def __init__(self, vocab: int = 64, n_embd: int = 32, n_head: int = 4, n_layer: int = 2, block: int = 16):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block, n_embd),
            h=nn.ModuleList([NanoBlock(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx.long().clamp(0, 63)) + self.transformer.wpe(pos) + 0 * idx[..., None]
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class TorchTransformer(nn.Module):
    """``nn.Transformer`` (``nn.MultiheadAttention`` in every layer), its target the input's
    first positions, and a head (a sum of the final norm's output has no gradient)."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.transformer = nn.Transformer(dim, heads, 2, 2, 2 * dim, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        return self.head(self.transformer(x, x[:, :5]))


def _seeded(make):
    def build():
        torch.manual_seed(0)
        return make().eval()
    return build


MODELS = {
    "timm_vit_tiny": (_seeded(TimmViT), (2, 3, 32, 32)),
    "sparse_moe": (_seeded(MoEBlock), (2, 8, 32)),
    "nn_transformer": (_seeded(TorchTransformer), (2, 8, 32)),
    "nanogpt": (_seeded(NanoGPT), (2, 8)),
}


def example(name: str) -> torch.Tensor:
    """The example input of ``MODELS[name]``, seeded (nanoGPT's: token ids, as floats)."""
    gen = torch.Generator().manual_seed(1)
    if name == "nanogpt":
        return torch.randint(0, 64, MODELS[name][1], generator=gen).float()
    return torch.randn(MODELS[name][1], generator=gen)
