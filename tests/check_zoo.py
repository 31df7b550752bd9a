"""Wrong plans, each a small model whose plan runs and computes other numbers than one device.

``WRONG`` maps a name to a ``Case``: ``build()`` returns ``(model, plan, inputs)``, ``module``
is the module ``tpfn.check`` must name, ``says`` a phrase of its finding. ``errors(names)``
runs each on the ranks of the default group against one device, outputs and every gradient,
and returns each case's largest relative error: every case is wrong on real ranks
(``tests/test_check.py``). ``RIGHT`` holds plans of the same models that are right.
"""

from __future__ import annotations

import copy
import types

import attrs
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import tpfn
from tpfn import Partial, Replicate, Shard, colwise, on_shards, params, per_rank, prepare_in, prepare_out, rowwise

DIM, HEADS, B, T = 16, 4, 2, 6


@attrs.frozen
class Case:
    build: object
    module: str
    says: str
    train: bool = False


WRONG: dict = {}
RIGHT: dict = {}


def wrong(module: str, says: str, train: bool = False):
    def register(fn):
        WRONG[fn.__name__] = Case(fn, module, says, train)
        return fn
    return register


def right(fn):
    RIGHT[fn.__name__] = Case(fn, "", "")
    return fn


def x():
    return torch.randn(B, T, DIM, generator=torch.Generator().manual_seed(1))


def ids():
    return torch.randint(0, 32, (B, T), generator=torch.Generator().manual_seed(1))


# -- attention that views its heads ---------------------------------------------------------


class Attention(nn.Module):
    """q, k, v, o; ``heads(t)`` views one projection's output as heads."""

    def __init__(self, how="attribute"):
        super().__init__()
        self.how, self.n_head, self.head_dim, self.dim = how, HEADS, DIM // HEADS, DIM
        self.cfg = types.SimpleNamespace(n_heads=HEADS)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def heads(self, t):
        b, s, _ = t.shape
        if self.how == "attribute":
            return t.view(b, s, self.n_head, -1)
        if self.how == "config":
            return t.view(b, s, self.cfg.n_heads, -1)
        if self.how == "width":   # the count from the global width
            return t.view(b, s, self.dim // self.head_dim, -1)
        return t.view(b, s, -1, self.head_dim)   # right on shards

    def forward(self, h):
        b, s, _ = h.shape
        q, k, v = (self.heads(p(h)).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


ATTENTION = {"": prepare_in(Replicate(), local=True), "[qkv]": colwise(), "o": rowwise()}


@wrong("", "self.n_head = 4")
def heads_by_attribute():
    return Attention("attribute"), ATTENTION, (x(),)


@wrong("", "the global one")
def heads_by_config():
    return Attention("config"), ATTENTION, (x(),)


@wrong("", "the global one")
def heads_by_global_width():
    return Attention("width"), ATTENTION, (x(),)


@right
def heads_by_head_size():
    return Attention("size"), ATTENTION, (x(),)


@right
def heads_held_per_rank():
    held = {**ATTENTION, "": prepare_in(Replicate(), local=True) >> per_rank("n_head")}
    return Attention("attribute"), held, (x(),)


@right
def heads_on_dtensors():
    return Scaled("head size"), {"[qkv]": colwise(local=False), "o": rowwise()}, (x(),)


class Fused(nn.Module):
    """q, k and v packed in one projection, unpacked by ``chunk``."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, h):
        b, s, _ = h.shape
        q, k, v = (t.view(b, s, -1, DIM // HEADS).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


@wrong("", "cuts dim 2 into pieces")
def fused_qkv_cut_across():
    return Fused(), {"qkv": colwise(), "o": rowwise()}, (x(),)


@right
def fused_qkv_in_parts():
    return Fused(), {"qkv": colwise(parts=3), "o": rowwise(parts=1)}, (x(),)


class Scaled(nn.Module):
    """q, k projections whose scores are scaled by ``how``."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, h):
        b, s, _ = h.shape
        q, k, v = (p(h).view(b, s, -1, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        scale = q.shape[1] ** -0.5 if self.how == "local heads" else (DIM // HEADS) ** -0.5
        y = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


@wrong("", "a value read from a local shape")
def scale_by_local_heads():
    return Scaled("local heads"), ATTENTION, (x(),)


# -- an MLP and what follows its row-wise output --------------------------------------------


class MLP(nn.Module):
    """up, an activation, down, and ``then``: what the model does with down's output."""

    def __init__(self, then=None, act=torch.relu, middle=None, bias=True):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM, bias=bias)
        self.then, self.act, self.middle = then, act, middle
        self.bias = nn.Parameter(torch.randn(DIM))
        self.norm = nn.LayerNorm(DIM)
        self.gate = nn.Linear(DIM, 1)
        self.width = 4 * DIM

    def forward(self, h):
        u = self.act(self.up(h))
        if self.middle is not None:
            u = self.middle(self, u, h)
        y = self.down(u)
        return y if self.then is None else self.then(self, y)


PAIR = {"up": colwise(), "down": rowwise()}
PARTIAL = {"up": colwise(), "down": rowwise() >> prepare_out(Partial())}


def _partial(then, says):
    return lambda: (MLP(then=then, bias=False), PARTIAL, (x(),))


for name, then, says, where in [
    ("relu_of_partial_sum", lambda m, y: torch.relu(y), "relu of a partial sum", ""),
    ("gelu_of_partial_sum", lambda m, y: F.gelu(y), "gelu of a partial sum", ""),
    ("softmax_of_partial_sum", lambda m, y: torch.softmax(y, -1), "of a partial sum", ""),
    ("norm_of_partial_sum", lambda m, y: m.norm(y), "of a partial sum", "norm"),
    ("max_of_partial_sum", lambda m, y: y.amax(-1, keepdim=True) * y, "of a partial sum", ""),
    ("comparison_of_partial_sum", lambda m, y: y * (y > 0), "of a partial sum", ""),
    ("square_of_partial_sum", lambda m, y: y.pow(2), "of a partial sum", ""),
    ("bias_added_to_partial_sum", lambda m, y: y + m.bias, "counts it 2 times", ""),
    ("number_added_to_partial_sum", lambda m, y: y + 1.0, "counts it 2 times", ""),
]:
    WRONG[name] = Case(_partial(then, says), where, says)


@right
def partial_sum_scaled_and_summed():
    return MLP(then=lambda m, y: (y * 0.5).sum(-1, keepdim=True) + 0 * y, bias=False), {
        "": prepare_out(Replicate(), given=Partial()), **PARTIAL}, (x(),)


def _sharded(middle, says, train=False):
    return lambda: (MLP(middle=middle), PAIR, (x(),))


for name, middle, says in [
    ("mean_over_sharded_features", lambda m, u, h: u - u.mean(-1, keepdim=True), "mean"),
    ("norm_over_sharded_features", lambda m, u, h: F.layer_norm(u, u.shape[-1:]), "norm"),
    ("rms_over_sharded_features", lambda m, u, h: u * u.pow(2).mean(-1, keepdim=True).rsqrt(), "mean"),
    ("softmax_over_sharded_features", lambda m, u, h: torch.softmax(u, -1), "softmax"),
    ("log_softmax_over_sharded_features", lambda m, u, h: F.log_softmax(u, -1), "log_softmax"),
    ("max_over_sharded_features", lambda m, u, h: u / u.amax(-1, keepdim=True), "amax"),
    ("cumsum_over_sharded_features", lambda m, u, h: u.cumsum(-1), "cumsum"),
    ("sort_over_sharded_features", lambda m, u, h: u.sort(-1).values, "sort"),
    ("topk_over_sharded_features", lambda m, u, h: u * (u >= u.topk(4, -1).values[..., -1:]), "topk"),
    ("vector_norm_over_sharded_features", lambda m, u, h: u / u.norm(dim=-1, keepdim=True), "norm"),
    ("index_into_sharded_features", lambda m, u, h: u * u[..., :1], "slice"),
    ("scale_by_local_width", lambda m, u, h: u * u.shape[-1] ** -0.5, "a value read from a local shape"),
    ("branch_on_local_width", lambda m, u, h: u * 2 if u.shape[-1] == m.width else u, "another path"),
    ("gate_broadcast_over_shards", lambda m, u, h: u * torch.sigmoid(m.gate(h)), "gate.weight"),
]:
    WRONG[name] = Case(_sharded(middle, says), "", says)


def _dropout(m, u, h):
    return F.dropout(u, 0.5, training=True)


@wrong("", "draws random numbers on a shard", train=True)
def dropout_on_shards():
    return MLP(middle=_dropout), PAIR, (x(),)


def _rank(m, y):
    if dist.is_initialized() and dist.get_rank() == 0:
        return y + m.bias
    return y


@wrong("", "the rank")
def branch_on_the_rank():
    return MLP(then=_rank), PAIR, (x(),)


# -- sequence parallelism --------------------------------------------------------------------


class Positions(nn.Module):
    """Positions looked up by the length of what arrives, then an MLP."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(64, DIM))
        self.mlp = MLP()

    def forward(self, h):
        return self.mlp(h + self.pos[: h.shape[1]])


SEQUENCE = {"": prepare_in(Shard(1), local=True) >> prepare_out(Replicate(), given=Shard(1)),
            "mlp": prepare_in(Shard(1), desired=Replicate()) >> prepare_out(Shard(1), given=Replicate()),
            "mlp.up": colwise(), "mlp.down": rowwise()}


@wrong("", "takes end=3 on a rank where one device takes 6")
def positions_by_local_length():
    return Positions(), SEQUENCE, (x(),)


class Pool(nn.Module):
    """A mean over the positions of a sequence-sharded input."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, h):
        return self.proj(h - h.mean(1, keepdim=True))


@wrong("", "mean")
def mean_over_sharded_sequence():
    return Pool(), {"": prepare_in(Shard(1), local=True),
                    "proj": prepare_in(Shard(1), desired=Replicate(), local=True)}, (x(),)


class Scale(nn.Module):
    """An RMS norm written by hand: a replicated weight on a shard of the sequence."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM))

    def forward(self, h):
        return h * h.pow(2).mean(-1, keepdim=True).rsqrt() * self.weight


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = Scale(), nn.Linear(DIM, DIM)

    def forward(self, h):
        return self.proj(self.norm(h))


@wrong("norm", "norm.weight")
def replicated_weight_on_sequence_shards():
    return Normed(), {"": prepare_in(Shard(1), local=True) >> prepare_out(Replicate()),
                      "norm": on_shards(Shard(1), output=Shard(1)),
                      "proj": prepare_in(Shard(1), desired=Replicate(), local=True)}, (x(),)


@right
def replicated_weight_with_partial_gradients():
    return Normed(), {"": prepare_in(Shard(1), local=True) >> prepare_out(Replicate()),
                      "norm": params(weight=Replicate()) >> on_shards(Shard(1), output=Shard(1),
                                                                      param_grads={"weight": Partial()}),
                      "proj": prepare_in(Shard(1), desired=Replicate(), local=True)}, (x(),)


class Attend(nn.Module):
    """Self-attention over the positions it is handed, then a projection."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(DIM, DIM)

    def forward(self, h):
        b, s, _ = h.shape
        q = h.view(b, s, HEADS, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


@wrong("", "attention")
def attention_over_sharded_positions():
    return Attend(), {"": prepare_in(Shard(1), local=True),
                      "out": prepare_in(Shard(1), desired=Replicate(), local=True)}, (x(),)


# -- slots that take a value as other than it is ----------------------------------------------


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM), nn.Linear(DIM, DIM)
        self.act = nn.Softmax(-1)

    def forward(self, h):
        return self.c(self.b(self.act(self.a(h))))


@wrong("c", "a partial sum")
def partial_sum_handed_on_as_replicated():
    return Chain(), {"a": colwise(), "b": rowwise() >> prepare_out(Partial()),
                     "c": colwise() >> prepare_out(Replicate())}, (x(),)


@wrong("act", "arrives as a shard")
def shard_handed_on_as_replicated():
    return Chain(), {"a": colwise(), "act": prepare_in(Replicate(), local=True), "b": rowwise()}, (x(),)


class Head(nn.Module):
    """Embeddings, an MLP, and a head whose logits the model turns into log-probabilities."""

    def __init__(self):
        super().__init__()
        self.embed, self.mlp, self.head = nn.Embedding(32, DIM), MLP(), nn.Linear(DIM, 32)

    def forward(self, i):
        return F.log_softmax(self.head(self.embed(i) + self.mlp(self.embed(i))), -1)


@wrong("", "log_softmax")
def log_softmax_over_sharded_vocabulary():
    return Head(), {"embed": rowwise(), "mlp.up": colwise(), "mlp.down": rowwise(), "head": colwise()}, (ids(),)


@right
def head_gathered():
    return Head(), {"embed": rowwise(), "mlp.up": colwise(), "mlp.down": rowwise(),
                    "head": colwise() >> prepare_out(Replicate())}, (ids(),)


# -- running the cases on real ranks ----------------------------------------------------------


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _error(a, b, floor: float = 0.0) -> float:
    """``||a - b|| / ||b||``, ``||b||`` at least ``floor`` per element (a gradient that is zero
    on one device up to rounding: a key's bias under a softmax)."""
    a, b = _full(a).detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).norm() / max(b.norm().item(), floor * b.numel() ** 0.5, 1e-12)).item()


def error(case: Case, mesh, detail: bool = False):
    """The largest relative error of ``case`` on the ranks of ``mesh`` against one device: the
    output and every gradient, one device's run on rank 0's seed, then broadcast."""
    torch.manual_seed(0)
    model, plan, inputs = case.build()
    model.train(case.train)
    ref = copy.deepcopy(model)
    rank = dist.get_rank()
    torch.manual_seed(1)
    expected = ref(*inputs)
    cot = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    (expected * cot).sum().backward()
    sent = [expected.detach(), {n: p.grad for n, p in ref.named_parameters()}]
    dist.broadcast_object_list(sent, src=0)   # one device: rank 0's (a model reading the rank reads 0)
    expected, grads = sent
    tp = tpfn.parallelize(copy.deepcopy(model), mesh, plan, src_rank=None)
    mount = tpfn.mounted(tp)
    given = mount.inputs.slots[0].given if mount is not None and mount.inputs.slots else None
    mine = tuple(t.chunk(mesh.size(), given.dim)[rank] if isinstance(given, Shard) else t for t in inputs)
    torch.manual_seed(1)
    out = tp(*mine)
    split = [d for d in range(out.dim()) if out.shape[d] != expected.shape[d]]
    if split:  # each rank's shard of the output (the others' gathered to compare)
        (out * cot.chunk(mesh.size(), split[0])[rank]).sum().backward()
        out = torch.cat(_all(out.detach()), split[0])
    else:
        (out * cot).sum().backward()
    errors = {"output": _error(out, expected)}
    known = [g for g in grads.values() if g is not None]
    floor = 1e-3 * (sum(g.double().pow(2).sum() for g in known) / sum(g.numel() for g in known)).sqrt().item() \
        if known else 0.0
    for name, p in tp.named_parameters():
        g = grads.get(name)
        if g is not None:
            errors[name] = _error(p.grad if p.grad is not None else torch.zeros_like(p), g, floor)
    return errors if detail else max(errors.values())


def _all(t):
    found = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(found, t.contiguous())
    return found


def errors(names: list) -> dict:
    """Each case's largest relative error on this job's ranks (call on every rank)."""
    from tests.ranks import mesh

    found = {}
    for name in names:
        try:
            found[name] = error(WRONG.get(name) or RIGHT[name], mesh(dist.get_world_size()))
        except Exception as e:
            raise RuntimeError(f"{name}: {type(e).__name__}: {e}") from e
    return found
