"""torch.compile on parallelized models: the same numbers as eager."""

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

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
    torch._dynamo.reset()
    counters.clear()
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
    return (rel_err(run(x), eager(x)), max(max_rel_err(compiled, eager).values()),
            counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


def test_a_compiled_transformer_trains_like_eager(ranks2):
    for sp in (False, True):
        out, params, graphs, breaks = ranks2.run(_transformer, sp)[0]
        assert out <= 1e-6 and params <= 1e-6, sp
        assert (graphs, breaks) == (1, 0), sp  # the hooks and collectives trace into one graph


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


def _dynamic_shapes():
    """A new batch size recompiles with symbolic shapes; the layouts still apply."""
    m = mesh(2)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    compiled = tpfn.parallelize(clone(ref), m, {"0": colwise(), "2": rowwise()})
    torch._dynamo.reset()
    counters.clear()
    run = torch.compile(compiled, backend="aot_eager")
    errs = []
    for batch in (4, 6, 7):
        x = torch.randn(batch, 3, 8)
        errs.append(rel_err(run(x), ref(x)))
    return max(errs), counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_a_compiled_model_takes_new_shapes(ranks2):
    for err, graphs, breaks in ranks2.run(_dynamic_shapes):
        assert err <= 1e-5 and (graphs, breaks) == (2, 0)  # static, then one symbolic graph


def _warnings():
    import warnings

    m = mesh(2)
    model = local_heads(tpfn.parallelize(transformer(vocab_size=16, n_layers=2), m,
                                         transformer_plan(True)), 2)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = torch.compile(model, backend="aot_eager")
        run(torch.randint(0, 16, (4, 8))).sum().backward()
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught]


def test_compiling_a_parallelized_transformer_warns_nothing_of_tpfns(ranks2):
    """No warning from tpfn's own code under torch.compile (Dynamo warns about caches it
    cannot trace, for instance)."""
    found = [w for w in ranks2.run(_warnings)[0] if "tpfn" in w]
    assert found == []
