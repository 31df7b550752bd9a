"""torch.compile on parallelized models: the same numbers as eager."""

import torch
import torch.nn as nn

import tpfn
from tests.models import clone, local_heads, max_rel_err, rel_err, transformer, transformer_plan
from tests.ranks import mesh
from tpfn import colwise, rowwise


def _transformer(sp: bool):
    """aot_eager: dynamo traces the hooks, AOTAutograd the forward and backward graphs."""
    m = mesh(2)
    ref = transformer(vocab_size=16, n_layers=2)
    eager = local_heads(tpfn.parallelize(clone(ref), m, transformer_plan(sp)), 2)
    compiled = local_heads(tpfn.parallelize(clone(ref), m, transformer_plan(sp)), 2)
    run = torch.compile(compiled, backend="aot_eager")
    opts = [torch.optim.AdamW(net.parameters(), lr=0.01) for net in (eager, compiled)]
    torch.manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 16, (4, 8))
        for fn, opt in zip((eager, run), opts):
            opt.zero_grad()
            fn(x).pow(2).mean().backward()
            opt.step()
    x = torch.randint(0, 16, (4, 8))
    return rel_err(run(x), eager(x)), max(max_rel_err(compiled, eager).values())


def test_a_compiled_transformer_trains_like_eager(ranks2):
    for sp in (False, True):
        out, params = ranks2.run(_transformer, sp)[0]
        assert out <= 1e-6 and params <= 1e-6, sp


def _inductor():
    m = mesh(2)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    eager = tpfn.parallelize(clone(ref), m, {"0": colwise(), "2": rowwise()})
    compiled = tpfn.parallelize(clone(ref), m, {"0": colwise(), "2": rowwise()})
    run = torch.compile(compiled)  # inductor, generating C++ for the CPU
    x = torch.randn(4, 16, requires_grad=True)
    run(x).sum().backward()
    eager(x).sum().backward()
    return rel_err(run(x), eager(x)), max(max_rel_err(compiled, eager, grads=True).values())


def test_inductor_compiles_a_parallelized_mlp(ranks2):
    out, grads = ranks2.run(_inductor)[0]
    assert out <= 1e-5 and grads <= 1e-5
