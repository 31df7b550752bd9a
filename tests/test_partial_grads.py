"""The partial gradients of replicated parameters (a sequence-parallel norm's): every backward
sums them at its end, in one bucketed all-reduce however many models it reached, and keeps
doing so after a failed backward, a swap of the parameters, or a parameter unfrozen later.

Two kinds of test on 2 gloo ranks. Those on ``Affine`` watch and arm by hand, as
``parallelize`` and a bound module's forward do (``PartialGrads.watch(module, name, fqn)``,
``PartialGrads.arm(output)``): they hold ``tpfn.interpret.state`` alone. Those on
``tpfn.parallelize`` with ``sequence_parallel()`` norms hold the whole path."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate as TReplicate

import tpfn
from tests.models import clone, counts, local_heads, max_rel_err, rel_err, transformer, transformer_plan
from tests.ranks import mesh
from tpfn import sequence_parallel
from tpfn.interpret import state
from tpfn.interpret.state import PartialGrads

# One forward and backward against one device (as in test_parallelize.py): sharding only
# changes the order of float32 sums, so a missing, doubled or misplaced reduction is of order 1.
TOL = 1e-5


class Affine(nn.Module):
    """``x * weight + bias``, per position. ``shard(model, grads)`` makes its parameters
    replicated DTensors used on this rank's positions (their gradients partial), watched by
    ``grads``, and its output armed: by hand what ``parallelize`` does for a bound norm."""

    def __init__(self, seed: int = 0, dim: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(dim, generator=g))
        self.bias = nn.Parameter(torch.randn(dim, generator=g))
        self.partial_grads = None

    def forward(self, x):
        w, b = self.weight, self.bias
        if isinstance(w, DTensor):
            w, b = (p.to_local(grad_placements=[TPartial()]) for p in (w, b))
        out = x * w + b
        if self.partial_grads is not None and torch.is_grad_enabled():
            self.partial_grads.arm(out)
        return out


def shard(model: Affine, grads: PartialGrads | None = None, prefix: str = "") -> Affine:
    m = mesh(2)
    for name in ("weight", "bias"):
        p = getattr(model, name)
        setattr(model, name, nn.Parameter(DTensor.from_local(p.detach().clone(), m, [TReplicate()],
                                                             run_check=False), p.requires_grad))
    model.partial_grads = PartialGrads() if grads is None else grads
    for name in ("weight", "bias"):
        model.partial_grads.watch(model, name, prefix + name)
    return model


def inputs(n: int = 1, dtype=torch.float32) -> list:
    """``n`` global inputs of 6 positions, alike on every rank."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 6, 8, generator=g, dtype=dtype) for _ in range(n)]


def mine(x: torch.Tensor) -> torch.Tensor:
    """This rank's positions of ``x``."""
    return x.chunk(2, dim=1)[dist.get_rank()]


def backward(loss) -> dict:
    """The collectives of ``loss.backward()``."""
    return counts(loss.backward)


def assert_replicated_like(tp: nn.Module, ref: nn.Module, names=None) -> None:
    """The gradients of ``names`` (all by default) are replicated DTensors equal to one device's."""
    theirs = dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        if names is None or name in names:
            assert isinstance(p.grad, DTensor) and p.grad.placements == (TReplicate(),), (name, p.grad)
            assert rel_err(p.grad, theirs[name].grad) <= TOL, name


# --- PartialGrads by hand --------------------------------------------------------------------


def _one_backward():
    ref = Affine()
    tp = shard(clone(ref))
    x, = inputs()
    comm = backward(tp(mine(x)).pow(2).sum())
    ref(x).pow(2).sum().backward()
    assert_replicated_like(tp, ref)
    return comm


def test_one_all_reduce_sums_every_watched_partial_gradient(ranks2):
    assert ranks2.run(_one_backward) == [{"all_reduce": 1}] * 2


class _Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("the loss fails backward")


def _failed(how: str, tp: nn.Module, x: torch.Tensor):
    """A backward of ``tp`` on ``x`` that raises midway, after ``tp``'s gradients came in."""
    x = x.clone().requires_grad_()
    if how == "hook":  # x's gradient comes last, after every parameter's
        x.register_hook(lambda grad: (_ for _ in ()).throw(ValueError("a hook fails")))
        loss = tp(x).pow(2).sum()
    else:  # the first node of the backward fails: nothing came in
        loss = _Fails.apply(tp(x)).pow(2).sum()
    with pytest.raises(ValueError):
        loss.backward()


def _after_a_failed_backward(how: str):
    ref = Affine()
    tp = shard(clone(ref))
    first, second = inputs(2)
    _failed(how, tp, mine(first))
    assert len(state._RUNNING) == 0  # the failed backward took what it would have summed along
    tp.zero_grad()
    comm = [backward(tp(mine(second)).pow(2).sum())]
    ref(second).pow(2).sum().backward()
    assert_replicated_like(tp, ref)
    tp.zero_grad()
    ref.zero_grad()
    comm.append(backward(tp(mine(first)).pow(2).sum()))  # and every later step
    ref(first).pow(2).sum().backward()
    assert_replicated_like(tp, ref)
    return comm


@pytest.mark.parametrize("how", ["hook", "function"])
def test_a_failed_backward_leaves_the_next_ones_summing(ranks2, how):
    assert ranks2.run(_after_a_failed_backward, how)[0] == [{"all_reduce": 1}] * 2


def _swap(model: nn.Module, how: str, ref: nn.Module) -> None:
    if how == "double":
        model.double()
    elif how == "to":
        model.to(torch.float64)
    elif how == "to_empty":  # then initialized anew, as after a meta-device build
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters()):
                p.to_local().copy_(r)
    else:  # load_state_dict(assign=True): new parameter objects
        model.load_state_dict({k: DTensor.from_local(v.detach().clone(), mesh(2), [TReplicate()],
                                                     run_check=False)
                               for k, v in ref.state_dict().items()}, assign=True)


def _after_a_swap(how: str):
    ref = Affine()
    tp = shard(clone(ref))
    first, second = inputs(2)
    tp(mine(first)).pow(2).sum().backward()  # hooked before the swap
    tp.zero_grad()
    _swap(tp, how, ref)
    dtype = torch.float64 if how in ("double", "to") else torch.float32
    ref.to(dtype)
    x = second.to(dtype)
    comm = backward(tp(mine(x)).pow(2).sum())
    ref(x).pow(2).sum().backward()
    assert_replicated_like(tp, ref)
    assert tp.weight.grad.dtype == dtype
    return comm


@pytest.mark.parametrize("how", ["double", "to", "to_empty", "assign"])
def test_a_swap_of_the_parameters_keeps_them_watched(ranks2, how):
    assert ranks2.run(_after_a_swap, how)[0] == {"all_reduce": 1}


def _unfrozen():
    ref = Affine()
    tp = shard(clone(ref))
    tp.weight.requires_grad_(False)
    ref.weight.requires_grad_(False)
    first, second = inputs(2)
    comm = [backward(tp(mine(first)).pow(2).sum())]
    ref(first).pow(2).sum().backward()
    assert tp.weight.grad is None
    assert_replicated_like(tp, ref, names=("bias",))
    for model in (tp, ref):
        model.zero_grad()
        model.weight.requires_grad_(True)
    comm.append(backward(tp(mine(second)).pow(2).sum()))
    ref(second).pow(2).sum().backward()
    assert_replicated_like(tp, ref)
    return comm


def test_a_parameter_frozen_when_watched_and_unfrozen_later_is_summed(ranks2):
    assert ranks2.run(_unfrozen)[0] == [{"all_reduce": 1}] * 2


def _two_models():
    refs = [Affine(0), Affine(1)]
    tps = [shard(clone(r)) for r in refs]  # a PartialGrads each, as two parallelize calls make
    x, = inputs()
    comm = backward(tps[1](tps[0](mine(x))).pow(2).sum())
    refs[1](refs[0](x)).pow(2).sum().backward()
    for tp, ref in zip(tps, refs):
        assert_replicated_like(tp, ref)
    # Two backwards, one model each: each sums its own, nothing of the other's.
    for model in (*tps, *refs):
        model.zero_grad()
    outs = [tp(mine(x)).pow(2).sum() for tp in tps]
    each = [backward(outs[0])]
    assert tps[1].weight.grad is None
    each.append(backward(outs[1]))
    for tp, ref in zip(tps, refs):
        ref(x).pow(2).sum().backward()
        assert_replicated_like(tp, ref)
    return comm, each


def test_one_all_reduce_per_backward_for_every_model_it_reached(ranks2):
    comm, each = ranks2.run(_two_models)[0]
    assert comm == {"all_reduce": 1}
    assert each == [{"all_reduce": 1}] * 2


def _accumulated():
    ref = Affine()
    tp = shard(clone(ref))
    xs = inputs(3)
    comm = []
    for x in xs:  # three backwards before a step: each adds onto the summed gradients
        comm.append(backward(tp(mine(x)).pow(2).sum()))
        ref(x).pow(2).sum().backward()
        assert_replicated_like(tp, ref)
    return comm


def test_accumulating_backwards_sums_once_each(ranks2):
    assert ranks2.run(_accumulated)[0] == [{"all_reduce": 1}] * 3


def _autograd_grad():
    ref = Affine()
    tp = shard(clone(ref))
    first, second = inputs(2)
    tp(mine(first)).pow(2).sum().backward()
    ref(first).pow(2).sum().backward()
    before = tp.weight.grad.to_local().clone()
    loss = tp(mine(second)).pow(2).sum()
    with torch.distributed.tensor.debug.CommDebugMode() as mode:
        grad, = torch.autograd.grad(loss, [tp.weight])
    expected, = torch.autograd.grad(ref(second).pow(2).sum(), [ref.weight])
    assert mode.get_total_counts() == 0  # nothing accumulated, nothing summed
    assert grad.placements == (TPartial(),) and rel_err(grad.full_tensor(), expected) <= TOL
    assert tp.weight.grad.placements == (TReplicate(),) and torch.equal(tp.weight.grad.to_local(), before)
    assert_replicated_like(tp, ref)
    return True


def test_autograd_grad_accumulates_and_sums_nothing(ranks2):
    assert all(ranks2.run(_autograd_grad))


def _nothing_partial():
    tp = shard(Affine())
    for p in tp.parameters():
        p.requires_grad_(False)
    x = mine(inputs()[0]).requires_grad_()
    comm = backward(tp(x).pow(2).sum())
    assert all(p.grad is None for p in tp.parameters()) and x.grad is not None
    return comm


def test_no_communication_where_nothing_is_partial(ranks2):
    assert ranks2.run(_nothing_partial) == [{}] * 2


def _freed():
    grads = PartialGrads()
    tp = shard(Affine(), grads)
    out = tp(mine(inputs()[0]))  # armed: its hook holds the PartialGrads, not the module
    assert grads.fqns == ("weight", "bias")
    gone = weakref.ref(tp)
    del tp
    gc.collect()
    assert gone() is None and grads.fqns == ()
    out.sum().backward()  # the module is gone: nothing to sum
    return True


def test_watching_keeps_no_module_alive(ranks2):
    assert all(ranks2.run(_freed))


# --- through tpfn.parallelize ----------------------------------------------------------------


def norms(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8))
    for p in model.parameters():
        nn.init.normal_(p)  # not ones and zeros: the gradients differ by parameter
    return model


SP = {"0": sequence_parallel(local=True), "1": sequence_parallel(local=True)}


def _parallelized_after_a_failed_backward():
    ref = norms()
    tp = tpfn.parallelize(clone(ref), mesh(2), SP)
    first, second = inputs(2)
    _failed("hook", tp, mine(first))
    tp.zero_grad()
    comm = [backward(tp(mine(second)).pow(2).sum())]
    ref(second).pow(2).sum().backward()
    assert_replicated_like(tp, ref)
    for model in (tp, ref):
        model.zero_grad()
    comm.append(backward(tp(mine(first)).pow(2).sum()))
    ref(first).pow(2).sum().backward()
    assert_replicated_like(tp, ref)
    return comm


def test_parallelized_norms_are_summed_after_a_failed_backward(ranks2):
    assert ranks2.run(_parallelized_after_a_failed_backward)[0] == [{"all_reduce": 1}] * 2


def _parallelized_after_a_swap(how: str):
    ref = norms()
    if how == "meta":  # built on the meta device, parallelized, made real, initialized
        with torch.device("meta"):
            tp = norms()
        tpfn.parallelize(tp, mesh(2), SP, src_rank=None)
        tp.to_empty(device="cpu")
        with torch.no_grad():
            for p, r in zip(tp.parameters(), ref.parameters()):
                p.to_local().copy_(r)
    else:
        tp = tpfn.parallelize(clone(ref), mesh(2), SP)
        tp(mine(inputs()[0])).pow(2).sum().backward()
        tp.zero_grad()
        tp.double() if how == "double" else tp.to(torch.float64)
        ref.double()
    x = inputs()[0].to(ref[0].weight.dtype)
    comm = backward(tp(mine(x)).pow(2).sum())
    ref(x).pow(2).sum().backward()
    assert_replicated_like(tp, ref)
    return comm


@pytest.mark.parametrize("how", ["double", "to", "meta"])
def test_parallelized_norms_are_summed_after_their_parameters_are_swapped(ranks2, how):
    assert ranks2.run(_parallelized_after_a_swap, how)[0] == {"all_reduce": 1}


def _parallelized_unfrozen():
    ref = norms()
    tp = clone(ref)
    tp[0].weight.requires_grad_(False)  # frozen when parallelized
    tpfn.parallelize(tp, mesh(2), SP)
    tp[0].weight.requires_grad_(True)
    x, = inputs()
    comm = backward(tp(mine(x)).pow(2).sum())
    ref(x).pow(2).sum().backward()
    assert_replicated_like(tp, ref)
    return comm


def test_a_norm_frozen_when_parallelized_and_unfrozen_later_is_summed(ranks2):
    assert ranks2.run(_parallelized_unfrozen)[0] == {"all_reduce": 1}


def _block_by_block():
    ref = nn.Sequential(norms(0), norms(1))
    tp = clone(ref)
    for block in tp:  # a parallelize call (a State) each
        tpfn.parallelize(block, mesh(2), SP)
    x, = inputs()
    comm = [backward(tp(mine(x)).pow(2).sum())]
    ref(x).pow(2).sum().backward()
    assert_replicated_like(tp, ref)
    comm.append(backward(tp(mine(x)).pow(2).sum()))  # accumulated: still one
    ref(x).pow(2).sum().backward()
    assert_replicated_like(tp, ref)
    return comm


def test_blocks_parallelized_one_by_one_share_one_all_reduce(ranks2):
    assert ranks2.run(_block_by_block)[0] == [{"all_reduce": 1}] * 2


def _transformer_block_by_block():
    ref = transformer(weight_tying=False, vocab_size=16)
    tp = clone(ref)
    plan = transformer_plan(sp=True)
    block = {k.removeprefix("layers.*."): v for k, v in plan.items() if k.startswith("layers.*.")}
    for layer in tp.layers:
        tpfn.parallelize(layer, mesh(2), block)
    tpfn.parallelize(tp, mesh(2), {k: v for k, v in plan.items() if not k.startswith("layers.")})
    local_heads(tp, 2)
    x = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(2))
    comm = backward(tp(x).sum())
    ref(x).sum().backward()
    assert max(max_rel_err(tp, ref, grads=True).values()) <= TOL
    norm_grads = [p.grad for name, p in tp.named_parameters() if "norm" in name]
    assert norm_grads and all(g.placements == (TReplicate(),) for g in norm_grads)
    return comm["all_reduce"], len(tp.layers)


def test_a_transformer_parallelized_block_by_block_sums_its_norms_once(ranks2):
    # Three parallelize calls (two blocks and the rest), one all-reduce of every norm's gradient.
    assert ranks2.run(_transformer_block_by_block)[0] == (1, 2)


def _bucket_summed_where_it_lies():
    from tpfn.bounded import Bound, all_reduce

    bound = Bound(mesh(2).get_group())
    mine = torch.full((3,), float(dist.get_rank() + 1))
    copied = all_reduce(mine, "sum", bound)  # a user's tensor: never written
    summed = {}
    real = state.all_reduce

    def spy(x, op, bound, **kw):
        out = real(x, op, bound, **kw)
        summed["same"] = out is x
        return out
    state.all_reduce = spy
    try:
        ref = transformer(weight_tying=False, vocab_size=16)
        tp = tpfn.parallelize(clone(ref), mesh(2), transformer_plan(sp=True))
        local_heads(tp, 2)
        tokens = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(2))
        tp(tokens).sum().backward()
        ref(tokens).sum().backward()
    finally:
        state.all_reduce = real
    return mine.tolist(), copied.tolist(), summed.get("same"), max(max_rel_err(tp, ref, grads=True).values())


def test_the_end_of_backward_bucket_is_summed_where_it_lies(ranks2):
    """The flat bucket of partial gradients is tpfn's own buffer: its all-reduce writes it, no copy."""
    for rank, (mine, copied, same, err) in enumerate(ranks2.run(_bucket_summed_where_it_lies)):
        assert mine == [rank + 1.0] * 3 and copied == [3.0] * 3
        assert same is True and err <= TOL, (same, err)
