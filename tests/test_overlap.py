"""A column-wise nn.Linear's input-gradient reduction overlaps its weight gradient.

With ``parallelize(..., overlap=True)`` (the default) the backward of a linear kernel whose
input gradient its slot's move reduces (Megatron's f: an all-reduce, or a reduce-scatter under
sequence parallelism) starts that collective before computing its weight gradient and waits
after (``tpfn.kernels.linear``). ``overlap=False`` waits at once. The two give the same outputs
and gradients bit for bit and the same collectives; both match one device. Every case where a
reader's gradient goes missing or comes twice (an unused projection, a graph backwarded twice,
``torch.autograd.grad``) is checked.
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import tpfn
from tests.models import (
    Ops, clone, counts, full, local_heads, max_rel_err, rel_err, transformer, transformer_plan,
)
from tests.ranks import mesh
from tpfn import Replicate, colwise, prepare_in, prepare_out, rowwise

# One forward and backward against one device: sharding reorders float32 sums only (a few
# ulps); a lost or doubled reduction is off by order 1.
TOL = 1e-5


def _grads(model: nn.Module) -> dict:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _transformer_pair(sp: bool):
    """The reference Transformer, parallelized with and without overlap: outputs, gradients
    and collectives of one step, and the overlapped model's largest error against one device."""
    m = mesh(2)
    ref = transformer(vocab_size=64, dim=32, n_heads=4, n_layers=2, max_seq_len=16,
                      weight_tying=False)
    runs = {}
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for overlap in (True, False):
        tp = local_heads(tpfn.parallelize(clone(ref), m, transformer_plan(sp), overlap=overlap), 2)
        out = {}
        comm = counts(lambda: out.setdefault("y", tp(tokens)).float().pow(2).mean().backward())
        runs[overlap] = (out["y"].detach(), _grads(tp), comm, tp)
    ref(tokens).float().pow(2).mean().backward()
    error = max(max_rel_err(runs[True][3], ref, grads=True).values())
    same = torch.equal(runs[True][0], runs[False][0]) and runs[True][1].keys() == runs[False][1].keys() \
        and all(torch.equal(g, runs[False][1][n]) for n, g in runs[True][1].items())
    return same, runs[True][2], runs[False][2], error, len(runs[True][1]) == len(list(ref.parameters()))


@pytest.mark.parametrize("sp", [False, True], ids=["sp off", "sp on"])
def test_overlap_gives_the_synchronous_numbers_and_collectives(ranks2, sp):
    same, comm_on, comm_off, error, every = ranks2.run(_transformer_pair, sp)[0]
    assert same  # outputs and every gradient, bit for bit
    assert comm_on == comm_off
    assert error <= TOL
    assert every  # every parameter got its gradient


class _Products(Ops):
    """The matrix products (by their output's shape) and all-reduces of a run, in order."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func).startswith("aten.mm"):
            self.ops.append(tuple(out.shape))
        elif str(func).startswith("c10d.allreduce_"):
            self.ops.append("all_reduce")
        return out


def _backward_order(overlap: bool):
    m = mesh(2)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 12, bias=False), nn.ReLU(), nn.Linear(12, 6, bias=False))
    tp = tpfn.parallelize(mlp, m, {"0": colwise(), "2": rowwise()}, overlap=overlap)
    x = torch.randn(4, 8, requires_grad=True)
    loss = tp(x).sum()
    with _Products({}) as seen:
        loss.backward()
    return seen.ops


def test_the_reduction_starts_before_the_weight_gradients(ranks2):
    # local products: layer 2's input gradient (4, 6) and weight gradient (6, 6); layer 0's
    # input gradient (4, 8), the all-reduce's operand, then its weight gradient (6, 8), which
    # with overlap runs while the all-reduce does (without, after the wait).
    on, off = ranks2.run(_backward_order, True)[0], ranks2.run(_backward_order, False)[0]
    assert on == off == [(4, 6), (6, 6), (4, 8), "all_reduce", (6, 8)]


class QKV(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, use=("q", "k", "v")):
        h = sum(getattr(self, n)(x) for n in use)
        return self.o(h)


PLAN = {"": prepare_in(Replicate(), local=True), "q": colwise(), "k": colwise(),
        "v": colwise(), "o": rowwise()}


def _edge_cases():
    m = mesh(2)
    ref = QKV()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    errors, comms = {}, {}

    def check(name, fn):
        tp = tpfn.parallelize(clone(ref), m, PLAN)
        one = clone(ref)
        xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        if name == "autograd.grad":  # CommDebugMode's module tracker cannot run inside one
            fn(tp, xs[0])
        else:
            comms[name] = counts(lambda: fn(tp, xs[0]))
        fn(one, xs[1])
        mine, theirs = dict(tp.named_parameters()), dict(one.named_parameters())
        errors[name] = max(rel_err(xs[0].grad, xs[1].grad), *(
            (0.0 if p.grad is None else float("inf")) if theirs[n].grad is None else
            float("inf") if p.grad is None else rel_err(p.grad, theirs[n].grad)
            for n, p in mine.items()))

    def only_q(model, xi):  # k and v read the replica but hand back no gradient
        model(xi, use=("q",)).pow(2).sum().backward()

    def twice(model, xi):  # one graph backwarded twice: gradients accumulate
        loss = model(xi).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()

    def unused_v(model, xi):  # v's output is computed but not used
        model.v(xi)
        model(xi, use=("q", "k")).pow(2).sum().backward()

    def autograd_grad(model, xi):  # gradients returned, not accumulated
        loss = model(xi).pow(2).sum()
        params = [p for p in model.parameters()]
        grads = torch.autograd.grad(loss, [xi, *params])
        xi.grad = grads[0]
        for p, g in zip(params, grads[1:]):
            p.grad = g

    for name, fn in {"only q": only_q, "twice": twice, "unused v": unused_v,
                     "autograd.grad": autograd_grad}.items():
        check(name, fn)
    return errors, comms


def test_readers_that_hand_back_no_gradient_or_twice(ranks2):
    errors, comms = ranks2.run(_edge_cases)[0]
    for name, error in errors.items():
        assert error <= TOL, name
    assert comms["only q"] == {"all_reduce": 2}  # o's forward, q's input gradient
    assert comms["twice"] == {"all_reduce": 3}  # one forward, two backwards


class _Cases(QKV):
    """QKV's linears in forwards that move where k's, v's and o's weight gradients are
    computed: by q's backward, while the replica's reduction runs, or by their own nodes."""

    case = "plain"

    def forward(self, x):
        if self.case == "q unused":  # q's node is kept but not run: the others compute their own
            self.unused = self.q(x)
            return self.o(self.v(x.detach()) + self.k(x))
        h = self.q(x) + self.k(x) + self.v(x)
        if self.case == "o twice":
            return self.o(h) + self.o(h.tanh())
        return self.o(h)


def _later_cases():
    """Every gradient against one device, and the hooks each model's parameters and o ran."""
    m = mesh(2)
    ref = _Cases()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    results = {}

    def backward(model, xi):
        model(xi).pow(2).sum().backward()

    def two_forwards(model, xi):  # two graphs alive, one backward through both
        (model(xi).pow(2).sum() + model(2 * xi).pow(2).sum()).backward()

    def checkpointed(model, xi):
        torch.utils.checkpoint.checkpoint(model, xi, use_reentrant=False).pow(2).sum().backward()

    def reentrant(model, xi):  # recomputed, and backwarded, inside the outer backward
        torch.utils.checkpoint.checkpoint(model, xi, use_reentrant=True).pow(2).sum().backward()

    def tied(model, xi):  # k and v one weight: its two gradients summed
        backward(model, xi)

    def only_o(model, xi):  # o's gradient alone: q's node runs to hand it over
        (model.o.weight.grad,) = torch.autograd.grad(model(xi).pow(2).sum(), [model.o.weight])

    def only_x(model, xi):  # no parameter's gradient
        (xi.grad,) = torch.autograd.grad(model(xi).pow(2).sum(), [xi])

    def frozen_o(model, xi):
        model.o.requires_grad_(False)
        backward(model, xi)

    cases = {"plain": backward, "o twice": backward, "q unused": backward, "two forwards": two_forwards,
             "checkpoint": checkpointed, "reentrant": reentrant, "tied": tied, "only o": only_o, "only x": only_x, "frozen o": frozen_o}
    for name, fn in cases.items():
        models, seen = [clone(ref), clone(ref)], []
        if name == "tied":  # tied before parallelize, which keeps them one parameter
            for model in models:
                model.v.weight = model.k.weight
        models[0] = tpfn.parallelize(models[0], m, PLAN)
        xs = [x.clone().requires_grad_() for _ in models]
        for model, xi in zip(models, xs):
            model.case, hooks, calls = name if name in ("o twice", "q unused") else "plain", [], []
            for n, p in model.named_parameters():  # each once, with its whole gradient
                p.register_hook(lambda g, n=n: hooks.append((n, full(g))))
            model.o.register_full_backward_hook(lambda mod, gi, go: calls.append(full(go[0])))
            fn(model, xi)
            seen.append((dict(hooks) if len(dict(hooks)) == len(hooks) else None, calls))
        mine, theirs = dict(models[0].named_parameters()), dict(models[1].named_parameters())
        errors = [rel_err(xs[0].grad, xs[1].grad) if xs[1].grad is not None else float(xs[0].grad is not None)]
        for n, p in mine.items():
            if (p.grad is None) != (theirs[n].grad is None):
                errors.append(float("inf"))
            elif p.grad is not None:
                errors.append(rel_err(p.grad, theirs[n].grad))
        (hooks, calls), (their_hooks, their_calls) = seen
        if name == "only o":  # the backward runs on to q's node, which hands o's gradient over:
            calls = calls[1:]  # o's module hook sees its input gradient once, where one device's does not
        if hooks is None or their_hooks is None or hooks.keys() != their_hooks.keys() \
                or len(calls) != len(their_calls):
            errors.append(float("inf"))
        else:
            errors += [rel_err(g, their_hooks[n]) for n, g in hooks.items()]
            errors += [rel_err(a, b) for a, b in zip(calls, their_calls)]
        results[name] = max(errors)
    return results


def test_sibling_weight_gradients_computed_in_the_window_match_one_device(ranks2):
    # k's, v's and o's weight gradients are computed in q's backward while the replica's
    # reduction runs, where q's node runs later in that backward; else by their own nodes
    for name, error in ranks2.run(_later_cases)[0].items():
        assert error <= TOL, name


def _one_gradient(overlap: bool):
    """Each layer's weight gradient alone (``torch.autograd.grad``): the collectives issued
    and the largest error against one device."""
    m = mesh(2)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 6))
    tp = tpfn.parallelize(clone(ref), m, {"0": colwise(), "2": rowwise()}, overlap=overlap)
    x = torch.randn(4, 8, requires_grad=True)
    comms, errors = [], []
    for i in (0, 2):
        out = {}
        comms.append(counts(lambda: out.setdefault("g", torch.autograd.grad(tp(x).sum(), [tp[i].weight]))))
        (theirs,) = torch.autograd.grad(ref(x).sum(), [ref[i].weight])
        errors.append(rel_err(out["g"][0], theirs))
    return comms, max(errors)


def test_a_gradient_alone_starts_no_collective_no_one_waits_for(ranks2):
    # the second layer's weight gradient runs the first's node (which hands it over), and the
    # first's needs none of the input gradient's all-reduce: neither starts it
    for overlap in (True, False):
        comms, error = ranks2.run(_one_gradient, overlap)[0]
        assert comms == [{"all_reduce": 1}, {"all_reduce": 1}], overlap  # the forward's only
        assert error <= TOL


def _failed_backward():
    """A backward that fails between o's node and q's: nothing of the graph is kept."""
    import gc
    import weakref
    tp = tpfn.parallelize(QKV(), mesh(2), PLAN)
    nodes = []

    def fail(grad):  # after o's node has handed its gradient's operands in
        raise RuntimeError("out of memory")

    def keep(module, args, out):  # the linear's node (its output: the product's rows, viewed)
        nodes.append(weakref.ref(out.grad_fn.next_functions[0][0]))
        out.register_hook(fail)

    tp.q.register_forward_hook(keep)
    x = torch.randn(2, 5, 8, requires_grad=True)
    loss = tp(x).pow(2).sum()
    failed = False
    try:
        loss.backward()
    except RuntimeError as e:
        failed = "out of memory" in str(e)
    del loss
    gc.collect()
    return failed, nodes[0]() is None


def test_a_failed_backward_keeps_no_graph_alive(ranks2):
    assert ranks2.run(_failed_backward)[0] == (True, True)


def _second_order():
    tp = tpfn.parallelize(nn.Linear(8, 8), mesh(2), colwise())  # its output: the local shard
    x = torch.randn(2, 5, 8, requires_grad=True)
    y = tp(x)
    (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    return g


def test_a_second_order_gradient_is_refused(ranks2):
    with pytest.raises(AssertionError, match=r"a second-order gradient .* runs through input 0 of "
                       r"'<root>' \(Linear\), whose backward tpfn does not differentiate again"):
        ranks2.run(_second_order)


def _frozen_second_order():
    """Frozen linears on a one-rank mesh: no move and no parameter gradient, plain ops."""
    groups = [torch.distributed.new_group([r]) for r in range(torch.distributed.get_world_size())]
    one = DeviceMesh.from_group(groups[torch.distributed.get_rank()], "cpu")
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).requires_grad_(False)
    tp = tpfn.parallelize(clone(ref), one, {"0": colwise(), "2": rowwise()})
    penalties = []
    for model in (ref, tp):
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        (g,) = torch.autograd.grad(model(x).pow(2).sum(), x, create_graph=True)
        (h,) = torch.autograd.grad(g.pow(2).sum(), x)
        penalties.append(h)
    return rel_err(*penalties)


def test_frozen_linears_with_nothing_to_move_differentiate_twice(ranks2):
    for error in ranks2.run(_frozen_second_order):
        assert error <= TOL


def test_overlap_must_be_a_bool():
    with pytest.raises(TypeError, match=r"'overlap' must be True or False \(got 'yes'\)"):
        tpfn.parallelize(nn.Linear(2, 2), None, colwise(), overlap="yes")


COPIES = {"aten.clone": "clone", "aten.copy": "copy", "c10d.allreduce_": "all_reduce"}


def _forward_copies():
    """Forward ops of a column-wise then row-wise MLP, and its numbers against one device."""
    m = mesh(2)
    found = {}
    for name, shape, grad, frozen in (("3-D", (2, 5, 12), True, False), ("2-D", (10, 12), True, False),
                                      ("no grad", (2, 5, 12), False, False),
                                      ("inference mode", (2, 5, 12), None, False),
                                      ("frozen, 3-D", (2, 5, 12), True, True)):
        ref = _mlp()
        tp = tpfn.parallelize(clone(ref), m, {"0": colwise(), "2": rowwise()})
        for model in (ref, tp):
            model[2].requires_grad_(not frozen)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
        mine = x.detach().clone().requires_grad_()
        with torch.inference_mode() if grad is None else torch.set_grad_enabled(grad), Ops(COPIES) as seen:
            out = tp(mine)
        errors = [rel_err(out, ref(x))]
        if grad:
            out.pow(2).sum().backward()
            ref(x).pow(2).sum().backward()
            errors += [rel_err(mine.grad, x.grad), *(rel_err(p.grad, q.grad) for p, q in
                                                     zip(tp.parameters(), ref.parameters()) if q.grad is not None)]
        found[name] = (seen.ops, max(errors))
    return found


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 12))


def test_a_row_wise_linear_sums_a_copy_of_its_output(ranks2):
    """Megatron's g: the row-wise linear's all-reduce sums a copy, so no tensor that autograd
    or a user holds is ever written; the numbers match one device."""
    found = ranks2.run(_forward_copies)[0]
    for name, (ops, error) in found.items():
        assert error <= TOL, name
    assert {name: ops for name, (ops, _) in found.items()} == dict.fromkeys(found, ["clone", "all_reduce"])


def _empty_shard():
    """Linear(12, 1) column-wise on 2 ranks: rank 1 holds no output feature."""
    m = mesh(2)
    torch.manual_seed(0)
    ref = nn.Linear(12, 1)
    tp = tpfn.parallelize(clone(ref), m, colwise() >> prepare_out(Replicate()))
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mine = x.detach().clone().requires_grad_()
    with torch.no_grad():
        errors = [rel_err(tp(mine), ref(x))]
    tp(mine).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    return max(errors + [rel_err(mine.grad, x.grad), rel_err(tp.weight.grad, ref.weight.grad),
                         rel_err(tp.bias.grad, ref.bias.grad)]), tuple(tp.weight.to_local().shape)


def test_a_rank_holding_no_columns_computes_an_empty_shard(ranks2):
    results = ranks2.run(_empty_shard)
    assert [shape for _, shape in results] == [(1, 12), (0, 12)]
    assert max(error for error, _ in results) <= TOL
