"""Small models written as the libraries users bring to suggest write them (timm, torchvision's
ResNet, ConvNeXt, MobileNetV2 and VGG, a diffusers-shaped UNet, Swin, nanoGPT, torch's own
``nn.Transformer``, Mamba, an LSTM, a sparse mixture of experts), nothing downloaded: each
class's forward is spelled as its library's is. ``MODELS`` maps a name to ``(build, example
input)``; ``tests/test_suggest.py`` runs them on fake and on gloo ranks,
``tools/shaped_sweep.py`` on 2 and 4 ranks.
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


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock``."""

    def __init__(self, planes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn1, self.relu = nn.BatchNorm2d(planes), nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False), nn.BatchNorm2d(planes)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


class ResNet(nn.Module):
    """torchvision's ResNet, one stage of ``BasicBlock``s."""

    def __init__(self, planes: int = 16, blocks: int = 2, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, planes, 7, 2, 3, bias=False)
        self.bn1, self.relu = nn.BatchNorm2d(planes), nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(*[BasicBlock(planes) for _ in range(blocks)])
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(planes, classes)

    def forward(self, x):
        x = self.layer1(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class CNBlock(nn.Module):
    """torchvision's ConvNeXt block: a depthwise 7x7 convolution, a LayerNorm and an MLP."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1, self.act, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 1e-6) * 1e4)

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y)))).permute(0, 3, 1, 2)
        return x + self.layer_scale * y


class ConvNeXt(nn.Module):
    def __init__(self, dim: int = 32, blocks: int = 3, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.stages = nn.Sequential(*[CNBlock(dim) for _ in range(blocks)])
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class InvertedResidual(nn.Module):
    """torchvision's MobileNetV2 block: a 1x1 expansion, a depthwise 3x3 convolution, a 1x1
    projection, each convolution followed by a BatchNorm, the input added back."""

    def __init__(self, c: int, expand: int = 4):
        super().__init__()
        hidden = c * expand
        self.conv = nn.Sequential(
            nn.Conv2d(c, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True), nn.Conv2d(hidden, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, c: int = 16, blocks: int = 2, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU6(inplace=True),
                                      *[InvertedResidual(c) for _ in range(blocks)])
        self.classifier = nn.Linear(c, classes)

    def forward(self, x):
        return self.classifier(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


class VGG(nn.Module):
    """torchvision's VGG, small: convolutions and ReLUs between max pools, then a classifier on
    the flattened features."""

    def __init__(self, c: int = 16, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(inplace=True))
        self.avgpool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(nn.Linear(8 * c, 4 * c), nn.ReLU(True), nn.Linear(4 * c, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class ResnetBlock2D(nn.Module):
    """diffusers' ``ResnetBlock2D``: GroupNorm, SiLU and a 3x3 convolution twice, a 1x1 shortcut
    where the channels change."""

    def __init__(self, cin: int, cout: int, groups: int = 4):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class UNet(nn.Module):
    """A UNet as diffusers' ``UNet2DModel`` shapes one: a down block, a strided downsampling
    convolution, a middle block, a transposed-convolution upsampler, the skip concatenated on
    the channels, an up block."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.conv_in = nn.Conv2d(3, c, 3, padding=1)
        self.down = ResnetBlock2D(c, c)
        self.downsample = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.mid = ResnetBlock2D(2 * c, 2 * c)
        self.upsample = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.up = ResnetBlock2D(2 * c, c)
        self.norm_out, self.conv_out = nn.GroupNorm(4, c), nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, x):
        skip = self.down(self.conv_in(x))
        h = self.upsample(self.mid(self.downsample(skip)))
        h = self.up(torch.cat([h, skip], dim=1))
        return self.conv_out(F.silu(self.norm_out(h)))


class SwinAttention(nn.Module):
    """Swin's window attention as some ports write it: its parent reads ``qkv``'s weight
    through ``F.linear``."""

    def __init__(self, dim: int = 32, num_heads: int = 4):
        super().__init__()
        self.num_heads, self.qkv, self.proj = num_heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, -1)
        return self.proj(x)


class Swin(nn.Module):
    def __init__(self, dim: int = 32, blocks: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict(dict(norm1=nn.LayerNorm(dim), attn=SwinAttention(dim),
                                                       norm2=nn.LayerNorm(dim), mlp=Mlp(dim, 4 * dim)))
                                    for _ in range(blocks))
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["attn"](layer["norm1"](x))
            x = x + layer["mlp"](layer["norm2"](x))
        return self.head(x.mean(1))


class MambaMixer(nn.Module):
    """Mamba's mixer (the reference scan): ``in_proj``, a depthwise ``conv1d``, the selective
    scan over each channel, ``out_proj``."""

    def __init__(self, d_model: int = 32, d_state: int = 4, d_conv: int = 4, expand: int = 2):
        super().__init__()
        self.d_inner, self.d_state, self.dt_rank = expand * d_model, d_state, 4
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=False)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1).float()).repeat(self.d_inner, 1))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def forward(self, hidden):
        L = hidden.shape[1]
        x, z = self.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)
        x = F.silu(self.conv1d(x)[..., :L])
        dt, b, c = torch.split(self.x_proj(x.transpose(1, 2)), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt)).transpose(1, 2)
        a = -torch.exp(self.A_log)
        h, ys = x.new_zeros(x.shape[0], self.d_inner, self.d_state), []
        for t in range(L):
            h = torch.exp(dt[:, :, t, None] * a) * h + dt[:, :, t, None] * b[:, None, t] * x[:, :, t, None]
            ys.append((h * c[:, None, t]).sum(-1))
        y = (torch.stack(ys, -1) + x * self.D[:, None]) * F.silu(z)
        return self.out_proj(y.transpose(1, 2))


class Mamba(nn.Module):
    def __init__(self, d_model: int = 32, blocks: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict(dict(norm=nn.LayerNorm(d_model), mixer=MambaMixer(d_model)))
                                    for _ in range(blocks))
        self.head = nn.Linear(d_model, 10)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["mixer"](layer["norm"](x))
        return self.head(x)


class LSTMTagger(nn.Module):
    """An ``nn.LSTM`` between a projection and a head."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.proj, self.lstm, self.head = nn.Linear(dim, dim), nn.LSTM(dim, 2 * dim, batch_first=True), nn.Linear(2 * dim, 10)

    def forward(self, x):
        return self.head(self.lstm(self.proj(x))[0])


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
    "resnet": (_seeded(ResNet), (2, 3, 32, 32)),
    "convnext": (_seeded(ConvNeXt), (2, 3, 32, 32)),
    "unet": (_seeded(UNet), (2, 3, 8, 8)),
    "mobilenet_v2": (_seeded(MobileNetV2), (2, 3, 16, 16)),
    "vgg": (_seeded(VGG), (2, 3, 16, 16)),
    "swin": (_seeded(Swin), (2, 16, 32)),
    "mamba": (_seeded(Mamba), (2, 6, 32)),
    "lstm": (_seeded(LSTMTagger), (2, 6, 32)),
}


def example(name: str) -> torch.Tensor:
    """The example input of ``MODELS[name]``, seeded (nanoGPT's: token ids, as floats)."""
    gen = torch.Generator().manual_seed(1)
    if name == "nanogpt":
        return torch.randint(0, 64, MODELS[name][1], generator=gen).float()
    return torch.randn(MODELS[name][1], generator=gen)
