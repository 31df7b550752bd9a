"""Many ranks in one process: under PyTorch's ``LocalTensorMode`` (what its CPU CI runs its
own tensor-parallel tests under) a parallelized model gives one device's numbers, with no
process per rank. The mode runs every op once per simulated rank of a fake world."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import tpfn
from tests.models import clone, local_heads, rel_err, transformer, transformer_plan
from tests.test_parts import FusedGQA
from tpfn import Replicate, Shard, colwise, prepare_out, rowwise, sequence_parallel
from tpfn.interpret.layouts import full_value, layouts

# float32, two forwards and backwards against one device, as tests/test_compile.py allows.
TOL = 1e-5
# The packed-parts model runs in float64 (tests/test_parts.py: rounding ~1e-16 relative).
TOL64 = 1e-12


@pytest.fixture(params=[2, 4], ids=lambda n: f"{n}ranks")
def world(request):
    """A fake world of n ranks in this process (the mode simulates every one) and its mesh,
    built outside the mode, as PyTorch's own local-tensor tests do."""
    assert not dist.is_initialized(), (
        "this process has a default process group already: a test before this one left it")
    dist.init_process_group("fake", rank=0, world_size=request.param, store=FakeStore())
    try:
        yield request.param, init_device_mesh("cpu", (request.param,))
    finally:
        dist.destroy_process_group()


def whole(t, layout=None):
    """One device's value of ``t``: a DTensor's global value (``layout``: its tpfn layout);
    a LocalTensor, whose ranks must hold the same, as one tensor."""
    t = full_value(t, layout) if isinstance(t, DTensor) else t
    return t.reconcile() if isinstance(t, LocalTensor) else t


def errors(model, ref, out, expected) -> dict:
    """Relative errors of the output, every parameter and every gradient against one device."""
    placed, theirs = layouts(model), dict(ref.named_parameters())
    found = {"output": rel_err(whole(out), expected)}
    for name, p in model.named_parameters():
        found[name] = rel_err(whole(p, placed.get(name)), theirs[name])
        found[name + ".grad"] = rel_err(whole(p.grad, placed.get(name)), theirs[name].grad)
    return found


def two_steps(model, x):
    """Two forwards and backwards (the gradients accumulate); the last output."""
    for _ in range(2):
        out = model(x)
        out.sum().backward()
    return out


@pytest.mark.parametrize("sp, length", [(False, 8), (True, 8), (True, 7)],
                         ids=["tp", "sp", "sp-uneven"])
def test_the_reference_transformer_equals_one_device_on_simulated_ranks(world, sp, length):
    n, mesh = world
    ref = transformer(vocab_size=15, n_layers=2)  # 15 ids: an uneven vocabulary on 2 and 4
    torch.manual_seed(1)
    tokens = torch.randint(0, 15, (4, length))
    expected = two_steps(ref, tokens)
    with LocalTensorMode(n):
        model = local_heads(tpfn.parallelize(clone(ref), mesh, transformer_plan(sp)), n)
        out = two_steps(model, tokens)
        found = errors(model, ref, out, expected)
    assert len(found) == 1 + 2 * len(list(ref.parameters()))
    assert max(found.values()) <= TOL, found


def test_a_model_made_under_the_mode_equals_one_device(world):
    n, mesh = world
    ref = transformer(vocab_size=16, n_layers=1)
    torch.manual_seed(1)
    tokens = torch.randint(0, 16, (4, 8))
    expected = two_steps(ref, tokens)
    with LocalTensorMode(n):  # every tensor made here is a LocalTensor, parameters included
        model = transformer(vocab_size=16, n_layers=1)
        model = local_heads(tpfn.parallelize(clone(model), mesh, transformer_plan(True)), n)
        torch.manual_seed(1)
        tokens = torch.randint(0, 16, (4, 8))
        assert isinstance(tokens, LocalTensor)
        found = errors(model, ref, two_steps(model, tokens), expected)
    assert max(found.values()) <= TOL, found


def _simulated(n: int, mesh, ref: nn.Module, plan, x) -> dict:
    """The errors of ``plan`` on a copy of ``ref`` run under the mode, two steps on ``x``."""
    expected = two_steps(ref, x)
    with LocalTensorMode(n):
        model = tpfn.parallelize(clone(ref), mesh, plan)
        return errors(model, ref, two_steps(model, x), expected)


def test_an_uneven_vocabulary_equals_one_device(world):
    n, mesh = world
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(15, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    plan = {"0": rowwise() >> prepare_out(Shard(1)), "1": sequence_parallel(),
            "2": tpfn.prepare_in(Shard(1)) >> colwise() >> prepare_out(Replicate())}
    found = _simulated(n, mesh, ref, plan, torch.arange(15).reshape(3, 5) % 15)
    assert max(found.values()) <= TOL, found


def test_packed_parts_equal_one_device(world):
    n, mesh = world
    heads, kv = 2 * n, n  # each rank one KV head and two query heads
    torch.manual_seed(0)
    ref = FusedGQA(dim=8 * heads, heads=heads, kv_heads=kv).double()
    plan = {"qkv_proj": colwise(parts=(8 * heads, 8 * kv, 8 * kv)), "o_proj": rowwise()}
    found = _simulated(n, mesh, ref, plan, torch.randn(2, 6, 8 * heads, dtype=torch.float64))
    assert max(found.values()) <= TOL64, found


def test_dropout_gives_each_simulated_rank_its_slice_of_one_devices_noise(world):
    n, mesh = world
    drop, x = nn.Dropout(0.5), torch.randn(2, 7, 4)  # 7 positions: uneven pieces
    torch.manual_seed(3)
    expected = drop(x)
    with LocalTensorMode(n):
        model = tpfn.parallelize(clone(drop), mesh, sequence_parallel() >> prepare_out(Replicate()))
        torch.manual_seed(3)  # every simulated rank's generator
        pieces = LocalTensor({r: x.chunk(n, 1)[r].clone() for r in range(n)})  # each rank its own
        out = model(pieces)
        assert torch.equal(whole(out), expected)
