"""Dropout in tensor-parallel regions: the same mask where replicated, distinct where sharded,
and the single device's masks where tpfn can draw them (sequence-parallel nn.Dropout)."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as TShard

import tpfn
from tests.models import local_heads, transformer, transformer_plan
from tests.ranks import mesh
from tpfn import Shard, on_shards, sequence_parallel


def _gathered(t: torch.Tensor) -> list:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _sequence_parallel_dropout(seq):
    m = mesh(2)
    rank = dist.get_rank()
    x = torch.randn(2, seq, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(0)
    expected = F.dropout(x, 0.3, training=True)
    after = torch.rand(3)
    torch.manual_seed(0)
    drop = tpfn.parallelize(nn.Dropout(0.3), m, sequence_parallel(local=True))
    local = x.detach().chunk(2, dim=1)[rank].requires_grad_()
    # A shard made here, not handed on by tpfn: a DTensor tells its global length.
    got = drop(DTensor.from_local(local, m, [TShard(1)], shape=x.shape, stride=x.stride()))
    got.sum().backward()
    expected.sum().backward()
    return (torch.equal(got, expected.chunk(2, dim=1)[rank]),
            torch.equal(local.grad, x.grad.chunk(2, dim=1)[rank]),
            torch.equal(torch.rand(3), after),     # the default stream moved as on one device
            drop.training)                         # and the module is left as it was


def test_sequence_parallel_dropout_draws_the_single_device_mask(ranks2):
    for seq in (6, 7):
        assert ranks2.run(_sequence_parallel_dropout, seq) == [(True,) * 4] * 2


class Noisy(nn.Module):
    """Dropout on an activation that is sharded across the ranks."""

    def forward(self, x):
        return F.dropout(x, 0.5, training=True)


def _sharded_masks():
    m = mesh(2)
    noisy = tpfn.parallelize(Noisy(), m, on_shards(Shard(1), output=Shard(1)))
    local = torch.ones(2, 8)
    torch.manual_seed(0)
    first = noisy(local)
    after = torch.rand(4)
    torch.manual_seed(0)
    again = noisy(local)
    replicated = F.dropout(torch.ones(16), 0.5)  # on every rank: a replicated activation
    return (not torch.equal(*_gathered(first)),        # distinct per shard
            torch.equal(first, again),                  # reproducible from the seed
            torch.equal(*_gathered(after)),             # the default stream moved alike everywhere
            torch.equal(*_gathered(replicated)))        # replicated: the same everywhere


def test_sharded_masks_differ_and_replicated_masks_agree(ranks2):
    assert ranks2.run(_sharded_masks) == [(True,) * 4] * 2


class Sampler(nn.Module):
    """In eval mode, a module on shards that draws nothing (fused experts), then noise drawn
    from the default stream after it (a diffusion model's canvas), and two modules on shards
    that draw (dropout applied whatever the mode)."""

    def __init__(self):
        super().__init__()
        self.scale, self.noisy = nn.Module(), nn.ModuleList([Noisy(), Noisy()])
        self.scale.forward = lambda x: x * 2

    def forward(self, x):
        return self.scale(x), torch.rand(4), self.noisy[0](x), self.noisy[1](x)


def _default_stream_after_shards():
    m = mesh(2)
    torch.manual_seed(0)
    expected = torch.rand(4)  # one device: the module on shards draws nothing from the stream
    model = tpfn.parallelize(Sampler(), m, {"scale": on_shards(Shard(1), output=Shard(1)),
                                            "noisy.*": on_shards(Shard(1), output=Shard(1))}).eval()
    torch.manual_seed(0)
    _, noise, first, second = model(torch.ones(2, 8))
    after = torch.rand(4)
    torch.manual_seed(0)
    _, _, again, _ = model(torch.ones(2, 8))
    model.train()  # in training each call draws its seed: a module called twice draws anew
    drop = model.noisy[0]
    return (torch.equal(noise, expected),               # one device's numbers after the shards
            not torch.equal(drop(torch.ones(2, 8)), drop(torch.ones(2, 8))),
            not torch.equal(first, second),             # two modules: two streams, no draw between
            torch.equal(first, again),                  # reproducible from the seed
            not torch.equal(*_gathered(first)),         # distinct per shard
            torch.equal(*_gathered(after)))             # the default stream alike everywhere


def test_in_eval_mode_a_module_on_shards_leaves_the_default_stream_as_one_device_does(ranks2):
    assert ranks2.run(_default_stream_after_shards) == [(True,) * 6] * 2


def _checkpointed_masks():
    """Activation checkpointing recomputes the forward: the shards must draw the same masks."""
    from torch.utils.checkpoint import checkpoint

    m = mesh(2)
    noisy = tpfn.parallelize(Noisy(), m, on_shards(Shard(1), output=Shard(1)))
    grads = []
    for ckpt in (False, True):
        x = torch.ones(2, 8, requires_grad=True)
        torch.manual_seed(0)
        y = checkpoint(noisy, x, use_reentrant=False) if ckpt else noisy(x)
        y.sum().backward()
        grads.append((y.detach(), x.grad))
    (y0, g0), (y1, g1) = grads
    return torch.equal(y0, y1), torch.equal(g0, g1), torch.equal(g0, (y0 != 0).float() * 2)


def test_activation_checkpointing_recomputes_the_same_sharded_masks(ranks2):
    assert ranks2.run(_checkpointed_masks) == [(True,) * 3] * 2


def _loss_curve(sp):
    """Dropout on the embeddings and both residual branches, attention dropout off."""
    def build():
        model = transformer(vocab_size=16, n_layers=2, dropout_p=0.2)
        for layer in model.layers:
            layer.attention.dropout_p = 0.0  # dropout inside SDPA cannot be sliced: see docs
        return model

    plan = transformer_plan(sp)
    if sp:
        plan.update({p: sequence_parallel(local=True) for p in (
            "dropout", "layers.*.attention.resid_dropout", "layers.*.feed_forward.resid_dropout")})
    curves = []
    for tp in (None, 2):
        torch.manual_seed(0)
        model = build()
        if tp:
            local_heads(tpfn.parallelize(model, mesh(2), plan), 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        torch.manual_seed(7)
        losses = []
        for _ in range(3):
            x, y = torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8))
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    return curves


def test_training_with_dropout_follows_the_single_device_loss_curve(ranks2):
    for sp in (False, True):
        for single, parallel in ranks2.run(_loss_curve, sp):
            assert all(abs(a - b) <= 1e-5 * a for a, b in zip(single, parallel)), (sp, single, parallel)
            assert len(set(single)) == 3
