"""State follows the model: what ordinary PyTorch does to a parallelized model gives one
device's numbers, or one named error on every rank, on both routes.

Each case runs on two gloo ranks with ``kernels=True`` and ``kernels=False`` against the same
model run unsharded in the rank's own process (a copy made before ``parallelize``): the output,
the input's gradient, every parameter and every gradient, over steps where the case is about
state that outlives a step.

1. A parameter replaced after ``parallelize``: by a DTensor laid out as the plan placed it,
   used (the partial-gradient sum of a sequence-parallel norm's included); by anything else,
   refused by name at the next forward.
2. ``copy.deepcopy`` of a parallelized model: a working model of its own, the original untouched.
3. A piece of the forward run in a worker thread.
4. In-place ops on a linear's output (``ReLU(inplace=True)``, ``mul_``, ``add_``), 2 to 4 dims.
5. Checkpointing, reentrant or not, one rank seconds slower than the other.
6. Batched gradients (``jacobian(vectorize=True)``, ``is_grads_batched=True``): refused by name.
7. Sequence-parallel ``nn.Dropout`` on a transposed activation, and with ``inplace=True``.
8. Parallelizing part by part, as PyTorch's own reference recipe does.
9. A compiled sequence-parallel model on a sequence the ranks do not split evenly: named.
"""

from __future__ import annotations

import concurrent.futures
import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as checkpoint
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

import tpfn
from tests.models import full, local_heads, transformer, transformer_plan
from tests.ranks import mesh
from tpfn import Replicate, Shard, colwise, prepare_in, prepare_out, rowwise, sequence_parallel

# One forward and backward against one device: sharding reorders float32 sums only, a few ulps
# (tests/test_trust.py); after three SGD steps the differences stay at that order. A lost,
# partial or doubled reduction is off by order 1.
TOL = 1e-5
D = 8
KERNELS = pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "reference"])
SP = pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence parallel"])
TIMEOUT = 120


class Attn(nn.Module):
    """q, k, v read the input; o projects; the input added to the output. ``thread``: k and a
    gate read straight from the input are computed in a worker thread, and nothing else reads
    the input. ``slow``: a hook in the backward sleeps (set per step)."""

    slow = 0.0

    def __init__(self, thread: bool = False):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.thread = thread

    def forward(self, x):
        if not self.thread:
            h = self.q(x) * self.k(x).sigmoid() + self.v(x)
        else:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                k, gate = pool.submit(self.k, x).result(), pool.submit(torch.tanh, x).result()
            h = self.q(x) * k.sigmoid() + self.v(x)
        if self.slow and h.requires_grad:  # (reached after a recomputation's early stop)
            h.register_hook(lambda g: time.sleep(self.slow))
        return self.o(h) + x if not self.thread else self.o(h) * gate


class Block(nn.Module):
    """``x + attn(norm(x))``; ``checkpointed``: the attention recomputed in the backward
    (``"reentrant"`` or ``"non-reentrant"``)."""

    def __init__(self, thread: bool = False, checkpointed: str | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(D)
        with torch.no_grad():
            self.norm.weight.normal_()
            self.norm.bias.normal_()
        self.attn = Attn(thread)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.norm(x)
        if self.checkpointed is None:
            return x + self.attn(h)
        return x + checkpoint.checkpoint(self.attn, h, use_reentrant=self.checkpointed == "reentrant")


def plan(sp: bool) -> dict:
    qkv = {"attn.q": colwise(), "attn.k": colwise(), "attn.v": colwise(), "attn.o": rowwise()}
    if not sp:
        return {"attn": prepare_in(Replicate(), local=True), **qkv}
    return {"norm": sequence_parallel(local=True),
            "attn": prepare_in(Shard(1), desired=Replicate(), local=True)
            >> prepare_out(Shard(1), given=Replicate(), local=True), **qkv}


def _mine(t, sp: bool):
    return t.chunk(2, dim=1)[dist.get_rank()] if sp else t


def _err(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    a, b = full(a).detach().double(), full(b).detach().double()
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _steps(tp, ref, sp: bool, steps: int = 3, before=None) -> dict:
    """``steps`` SGD steps of both models on one input: the largest error of the output, the
    input's gradient, every parameter and every gradient (a gradient left a partial sum, which
    every optimizer op would reduce again, counts as wrong), over the steps (``before(i)``: run
    before step ``i`` on each rank)."""
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(1))
    worst: dict = {}
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tp, ref)]
    for i in range(steps):
        if before is not None:
            before(i)
        x_tp, x_ref = _mine(x, sp).clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = tp(x_tp), ref(x_ref)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        found = {"output": _err(out, _mine(expected, sp)), "input.grad": _err(x_tp.grad, _mine(x_ref.grad, sp))}
        theirs = dict(ref.named_parameters())
        for name, p in tp.named_parameters():
            partial = isinstance(p.grad, DTensor) and any(q.is_partial() for q in p.grad.placements)
            found[name + ".grad"] = float("inf") if partial else _err(p.grad, theirs[name].grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for name, p in tp.named_parameters():
            found[name] = _err(p, theirs[name])
        for key, value in found.items():
            worst[key] = max(worst.get(key, 0.0), value)
    return worst


def _bad(errors: dict) -> dict:
    return {k: v for k, v in errors.items() if not v <= TOL}


def _models(kernels: bool, sp: bool, **kw):
    ref = Block(**kw)
    return ref, tpfn.parallelize(copy.deepcopy(ref), mesh(2), plan(sp), kernels=kernels)


# 1. A parameter replaced after parallelize -------------------------------------------------

REPLACED = {  # name: (sequence parallel, the parameter, how the plan places it)
    "a column-wise weight": (False, "attn.q.weight", Shard(0)),
    "a row-wise bias": (False, "attn.o.bias", Replicate()),
    "a sequence-parallel norm's weight": (True, "norm.weight", Replicate()),
}


def _replace(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, nn.Parameter(value))


def _replaced_by_dtensor(kernels: bool, case: str) -> dict:
    sp, name, placement = REPLACED[case]
    ref, tp = _models(kernels, sp)
    value = torch.randn(ref.get_parameter(name).shape, generator=torch.Generator().manual_seed(2))
    _replace(ref, name, value.clone())
    _replace(tp, name, distribute_tensor(value.clone(), mesh(2), tpfn.layout.to_torch(placement)))
    return _steps(tp, ref, sp)


@KERNELS
@pytest.mark.parametrize("case", list(REPLACED))
def test_a_parameter_replaced_by_a_dtensor_laid_out_alike_is_used(ranks2, kernels, case):
    # three steps: the replacement's values, its gradient (a norm's partial sums summed at the
    # end of the backward) and its steps are one device's
    for errors in ranks2.run(_replaced_by_dtensor, kernels, case, timeout=TIMEOUT):
        assert _bad(errors) == {}


def _replaced_by_plain(kernels: bool, case: str, kind: str) -> str:
    sp, name, placement = REPLACED[case]
    _, tp = _models(kernels, sp)
    value = torch.randn(tp.get_parameter(name).shape)
    if kind == "a DTensor laid out otherwise":
        other = Shard(0) if placement == Replicate() else Replicate()
        value = distribute_tensor(value, mesh(2), tpfn.layout.to_torch(other))
    _replace(tp, name, value)
    x = _mine(torch.randn(2, 6, D), sp)
    try:
        tp(x).sum().backward()
    except Exception as e:  # noqa: BLE001 - matched in the test
        return f"{type(e).__name__}: {e}"
    return "ran"


@KERNELS
@pytest.mark.parametrize("kind", ["a plain tensor", "a DTensor laid out otherwise"])
@pytest.mark.parametrize("case", list(REPLACED))
def test_a_parameter_replaced_by_anything_else_is_refused_by_name(ranks2, kernels, case, kind):
    _, name, placement = REPLACED[case]
    owner, _, leaf = name.rpartition(".")
    for said in ranks2.run(_replaced_by_plain, kernels, case, kind, timeout=TIMEOUT):
        assert said.startswith("ModuleError: "), said
        assert f"'{owner}'" in said and f"parameter {leaf!r}" in said, said
        assert f"placed it {placement!r}" in said and "replaced after parallelize" in said, said


# 2. A deep copy ----------------------------------------------------------------------------


def _deep_copied(kernels: bool, sp: bool) -> dict:
    ref, tp = _models(kernels, sp)
    copied = copy.deepcopy(tp)
    errors = _steps(copied, copy.deepcopy(ref), sp)
    errors["the original's gradients after the copy's steps"] = float(
        any(p.grad is not None for p in tp.parameters()))
    errors.update({f"original: {k}": v for k, v in _steps(tp, ref, sp).items()})
    return errors


@KERNELS
@SP
def test_a_deep_copy_is_a_model_of_its_own(ranks2, kernels, sp):
    # the copy trains as one device (its norm's partial gradients summed, not the original's),
    # and leaves the original as it was, which then trains as one device too
    for errors in ranks2.run(_deep_copied, kernels, sp, timeout=TIMEOUT):
        assert _bad(errors) == {}


# 3. A piece of the forward in a worker thread ----------------------------------------------


def _threaded(kernels: bool, sp: bool) -> dict:
    ref, tp = _models(kernels, sp, thread=True)
    return _steps(tp, ref, sp)


@KERNELS
@SP
def test_a_branch_computed_in_a_worker_thread_gives_one_devices_numbers(ranks2, kernels, sp):
    for errors in ranks2.run(_threaded, kernels, sp, timeout=TIMEOUT):
        assert _bad(errors) == {}


# 4. In-place ops on a linear's output ------------------------------------------------------

INPLACE_OPS = {
    "ReLU(inplace=True)": lambda h: nn.ReLU(inplace=True)(h),
    "relu_": lambda h: h.relu_(),
    "mul_": lambda h: h.mul_(2),
    "add_": lambda h: h.add_(1),
}


class OwnLinear(nn.Linear):
    """A linear layer with a forward of its own (Falcon's ``FalconLinear``): it computes on DTensors."""

    def forward(self, x):
        return x @ self.weight.T + self.bias if self.bias is not None else x @ self.weight.T


class MLP(nn.Module):
    def __init__(self, bias: bool, op: str, kind=nn.Linear):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = kind(D, 2 * D, bias=bias), nn.Linear(2 * D, D, bias=bias)
        self.op = op

    def forward(self, x):
        return self.fc2(INPLACE_OPS[self.op](self.fc1(x)))


def _in_place(kernels: bool, op: str, bias: bool, ndim: int, kind=nn.Linear) -> dict:
    ref = MLP(bias, op, kind)
    tp = tpfn.parallelize(copy.deepcopy(ref), mesh(2), {"fc1": colwise(), "fc2": rowwise()}, kernels=kernels)
    shape = (2, 3, 5, D)[4 - ndim:]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    x_tp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = tp(x_tp), ref(x_ref)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    errors = {"output": _err(out, expected), "input.grad": _err(x_tp.grad, x_ref.grad)}
    theirs = dict(ref.named_parameters())
    errors.update({n + ".grad": _err(p.grad, theirs[n].grad) for n, p in tp.named_parameters()})
    return errors


@KERNELS
@pytest.mark.parametrize("ndim", [2, 3, 4])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("op", list(INPLACE_OPS))
def test_an_in_place_op_on_a_linears_output_is_one_devices(ranks2, kernels, op, bias, ndim):
    for errors in ranks2.run(_in_place, kernels, op, bias, ndim, timeout=TIMEOUT):
        assert _bad(errors) == {}


@pytest.mark.parametrize("op", ["ReLU(inplace=True)", "add_"])
def test_an_in_place_op_on_the_output_of_a_module_computing_on_dtensors_is_one_devices(ranks2, op):
    # its output is handed on as a tensor of its own: DTensor's to_local() view cannot be written in place
    for errors in ranks2.run(_in_place, True, op, True, 3, OwnLinear, timeout=TIMEOUT):
        assert _bad(errors) == {}


def _hooked_then_in_place(kernels: bool, ndim: int, bias: bool) -> tuple:
    """Whether a hook put on fc1's output before ``relu_`` runs, here and on one device (on one
    device it runs where ATen's linear hands on a plain tensor, not where it hands on a view)."""
    seen = []

    def run(model, x):
        def hook(module, args, out):
            out.register_hook(lambda g: seen.append(model))
        model.fc1.register_forward_hook(hook)
        model(x).pow(2).sum().backward()
        return model in seen

    ref = MLP(bias, "relu_")
    tp = tpfn.parallelize(copy.deepcopy(ref), mesh(2), {"fc1": colwise(), "fc2": rowwise()}, kernels=kernels)
    x = torch.randn((2, 3, 5, D)[4 - ndim:], generator=torch.Generator().manual_seed(1))
    return run(tp, x), run(ref, x)


@KERNELS
@pytest.mark.parametrize("ndim", [2, 3, 4])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
def test_a_hook_on_a_linears_output_changed_in_place_runs_as_on_one_device(ranks2, kernels, ndim, bias):
    for here, one_device in ranks2.run(_hooked_then_in_place, kernels, ndim, bias, timeout=TIMEOUT):
        assert here == one_device == (ndim == 2 or not bias)


# 5. Checkpointing, one rank slower ----------------------------------------------------------


def _checkpointed(kernels: bool, sp: bool, how: str) -> dict:
    ref = Block(checkpointed=how)
    tp = tpfn.parallelize(copy.deepcopy(ref), mesh(2), plan(sp), kernels=kernels, timeout=60)

    def slow(i):  # rank 1, in step 1's backward after the recomputation: past a wait's first
        # slices and PATIENCE, well within the bound
        tp.attn.slow = 6.0 if dist.get_rank() == 1 and i == 1 else 0.0
    return _steps(tp, ref, sp, before=slow)


@KERNELS
@SP
@pytest.mark.parametrize("how", ["non-reentrant", "reentrant"])
def test_checkpointing_with_a_slower_rank_gives_one_devices_numbers(ranks2, kernels, sp, how):
    # torch's own early stop of a non-reentrant recomputation is no error: no rank is told of it
    for errors in ranks2.run(_checkpointed, kernels, sp, how, timeout=TIMEOUT):
        assert _bad(errors) == {}


# 6. Batched gradients --------------------------------------------------------------------


def _batched(kernels: bool, how: str) -> str:
    _, tp = _models(kernels, False)
    x = torch.randn(1, 2, D, requires_grad=True)
    try:
        if how == "jacobian":
            torch.autograd.functional.jacobian(lambda x: tp(x).sum((0, 1)), x, vectorize=True)
        else:
            out = tp(x).sum((0, 1))
            torch.autograd.grad(out, x, torch.eye(D), is_grads_batched=True)
    except Exception as e:  # noqa: BLE001 - matched in the test
        return f"{type(e).__name__}: {e}"
    return "ran"


@KERNELS
@pytest.mark.parametrize("how", ["jacobian", "is_grads_batched"])
def test_batched_gradients_are_refused_by_name_on_every_rank(ranks2, kernels, how):
    for said in ranks2.run(_batched, kernels, how, timeout=TIMEOUT):
        assert said.startswith("RuntimeError: ") and "batched" in said, said
        assert "'attn" in said and "CollectiveError" not in said, said


# 7. Sequence-parallel dropout ------------------------------------------------------------


class Dropped(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.drop = nn.Dropout(0.5, inplace=inplace)

    def forward(self, x):  # x: (batch, sequence, features), dropped as (sequence, batch, features)
        return self.drop(x.transpose(0, 1))


def _dropout(inplace: bool) -> dict:
    x = torch.randn(3, 6, 5)
    torch.manual_seed(7)
    one = x.clone()
    expected = Dropped(inplace)(one)
    tp = tpfn.parallelize(Dropped(inplace), mesh(2), {"drop": sequence_parallel(dim=0, local=True)})
    mine = _mine(x, True).clone()
    torch.manual_seed(7)
    out = tp(mine)
    errors = {"output": _err(out, expected.chunk(2, dim=0)[dist.get_rank()])}
    if inplace:  # the caller's tensor is the output, as one device's is
        errors["the input written in place"] = _err(mine, one.chunk(2, dim=1)[dist.get_rank()])
    return errors


@pytest.mark.parametrize("inplace", [False, True], ids=["dropout", "dropout in place"])
def test_sequence_parallel_dropout_on_a_transposed_activation_draws_one_devices_mask(ranks2, inplace):
    for errors in ranks2.run(_dropout, inplace, timeout=TIMEOUT):
        assert _bad(errors) == {}


# 8. Part by part, as PyTorch's reference recipe -------------------------------------------


def _part_by_part(sp: bool) -> dict:
    """``Transformer.parallelize`` of PyTorch's tests (one call per part, the tied output bound
    last, the tie set again after; local attention outputs), each call through
    ``tpfn.from_torch``, in float64 as PyTorch's training tests; three Adam steps."""
    ref = transformer(weight_tying=True, n_layers=2, dim=16, n_heads=4, vocab_size=16, max_seq_len=8).double()
    model = copy.deepcopy(ref)
    S, R, tp_mesh = TShard, TReplicate, mesh(2)
    root = ({"tok_embeddings": RowwiseParallel(input_layouts=R(), output_layouts=S(1)),
             "pos_embeddings": RowwiseParallel(input_layouts=R(), output_layouts=S(0)), "norm": SequenceParallel()}
            if sp else {"tok_embeddings": RowwiseParallel(input_layouts=R(), output_layouts=R()),
                        "pos_embeddings": RowwiseParallel(input_layouts=R(), output_layouts=R())})
    tpfn.parallelize(model, tp_mesh, tpfn.from_torch(root))
    for layer in model.layers:
        part = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=S(1)) if sp else RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(input_layouts=S(1)) if sp else ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=S(1)) if sp else RowwiseParallel()}
        if sp:
            part.update({"attention": PrepareModuleInput(input_layouts=S(1), desired_input_layouts=R()),
                         "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        tpfn.parallelize(layer, tp_mesh, tpfn.from_torch(part))
    output = ColwiseParallel(input_layouts=S(1), output_layouts=R()) if sp else ColwiseParallel(output_layouts=R())
    tpfn.parallelize(model.output, tp_mesh, tpfn.from_torch(output))
    local_heads(model, 2)  # (the recipe's local_output_for_attn=True: attention on local heads)
    model.output.weight = model.tok_embeddings.weight
    ids = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (model, ref)]
    worst = {}
    for _ in range(3):
        out, expected = model(ids), ref(ids)
        out.sum().backward()
        expected.sum().backward()
        theirs = dict(ref.named_parameters())
        found = {"output": _err(out, expected)}
        found.update({n + ".grad": _err(p.grad, theirs[n].grad) for n, p in model.named_parameters()})
        for opt in opts:
            opt.step()
            opt.zero_grad()
        found.update({n: _err(p, theirs[n]) for n, p in model.named_parameters()})
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in found.items()}
    return worst


@SP
def test_parallelizing_part_by_part_as_pytorchs_recipe_trains_as_one_device(ranks2, sp):
    for errors in ranks2.run(_part_by_part, sp, timeout=TIMEOUT):
        assert _bad(errors) == {}


# 9. A compiled model on a sequence the ranks do not split evenly --------------------------


def _compiled_uneven() -> str:
    """PyTorch's reference Transformer with sequence parallelism, compiled, on 7 positions:
    its embedding's output reduce-scattered into shards of 4 and 3."""
    model = local_heads(tpfn.parallelize(transformer(vocab_size=16, n_layers=2), mesh(2), transformer_plan(True)), 2)
    run = torch.compile(model, backend="aot_eager")
    try:
        run(torch.randint(0, 16, (2, 7))).sum().backward()
    except Exception as e:  # noqa: BLE001 - matched in the test
        return f"{type(e).__name__}: {e}"
    return "ran"


def test_a_compiled_model_on_an_uneven_sequence_is_refused_by_name(ranks2):
    for said in ranks2.run(_compiled_uneven, timeout=300):
        assert said.startswith("LayoutError: the output of 'tok_embeddings' (Embedding): compiled code"), said
        assert "the 7 in dim 1 do not split evenly over 2 ranks" in said and "TORCHDYNAMO" not in said, said
