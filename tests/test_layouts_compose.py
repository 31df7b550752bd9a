"""Unequal packed parts (``colwise(parts=(q, k, v))``) and replicated KV heads
(``colwise(heads=h)``) under torch.compile and under FSDP2 on a 2 x 2 mesh."""

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard

import tpfn
from tests.models import clone, rel_err
from tests.ranks import mesh
from tests.test_kv_heads import GQA
from tests.test_parts import FusedGQA
from tpfn import Replicate, colwise, prepare_in, rowwise
from tpfn.interpret.layouts import full_value, layouts

# float32, one forward and backward (or two optimizer steps) against eager or one device.
TOL = 1e-5

LAYOUTS = {
    "parts": (lambda: FusedGQA(), {"qkv_proj": colwise(parts=(32, 16, 16)), "o_proj": rowwise()}),
    # 4 query heads, 1 KV head: on 2 ranks the KV head is held by both.
    "heads": (lambda: GQA(kv_heads=1),
              {"": prepare_in(Replicate()), "q_proj": colwise(), "k_proj": colwise(heads=1),
               "v_proj": colwise(heads=1), "o_proj": rowwise()}),
}


def _errors(model, ref, out, expected) -> dict:
    placed = layouts(model)
    refs = dict(ref.named_parameters())
    errors = {"output": rel_err(out, expected)}
    for name, p in model.named_parameters():
        errors[name + ".grad"] = rel_err(full_value(p.grad, placed.get(name)), refs[name].grad)
    return errors


def _compiled(layout: str):
    """aot_eager: dynamo traces the slots and the kernels, AOTAutograd forward and backward."""
    build, plan = LAYOUTS[layout]
    torch.manual_seed(0)
    ref = build()
    model = tpfn.parallelize(clone(ref), mesh(2), plan)
    torch._dynamo.reset()
    counters.clear()
    run = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 6, 32)
    expected = ref(x)
    expected.sum().backward()
    out = run(x)
    out.sum().backward()
    return (_errors(model, ref, out, expected), counters["stats"]["unique_graphs"],
            sum(counters["graph_break"].values()))


def test_unequal_parts_compile_into_one_graph(ranks2):
    for errors, graphs, breaks in ranks2.run(_compiled, "parts"):
        assert max(errors.values()) <= TOL, errors
        assert (graphs, breaks) == (1, 0)


def test_replicated_kv_heads_compile_into_one_graph(ranks2):
    for errors, graphs, breaks in ranks2.run(_compiled, "heads"):
        assert max(errors.values()) <= TOL, errors
        assert (graphs, breaks) == (1, 0)


def _fsdp(layout: str):
    """tpfn on mesh["tp"], FSDP2 on mesh["dp"]: each data-parallel rank takes half the batch;
    two SGD steps against one device on the whole batch (Adam would turn the rounding noise
    of the k bias gradient, which softmax ignores, into whole steps)."""
    build, plan = LAYOUTS[layout]
    m = mesh(2, 2, names=("dp", "tp"))
    torch.manual_seed(0)
    ref = build()
    model = fully_shard(tpfn.parallelize(clone(ref), m["tp"], plan), mesh=m["dp"])
    opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (ref, model)]
    torch.manual_seed(1)
    half = m["dp"].get_local_rank()
    for _ in range(2):
        x = torch.randn(4, 6, 32)
        for net, opt, xs in zip((ref, model), opts, (x, x.chunk(2)[half])):
            opt.zero_grad()
            net(xs).pow(2).mean().backward()
            opt.step()
    x = torch.randn(4, 6, 32)
    placed = layouts(model)
    refs = dict(ref.named_parameters())
    errors = {"output": rel_err(model(x.chunk(2)[half]), ref(x).chunk(2)[half])}
    for name, p in model.named_parameters():
        errors[name] = rel_err(full_value(p, placed.get(name)), refs[name])
    return errors, dist.get_rank()


def test_unequal_parts_train_under_fsdp2_as_one_device(ranks4):
    for errors, _ in ranks4.run(_fsdp, "parts"):
        assert max(errors.values()) <= TOL, errors


def test_replicated_kv_heads_train_under_fsdp2_as_one_device(ranks4):
    for errors, _ in ranks4.run(_fsdp, "heads"):
        assert max(errors.values()) <= TOL, errors
