"""A local replica that only column-wise modules read reduces their gradients once.

``prepare_in(Replicate(), local=True)`` on a parent of q, k and v hands its forward a plain
local tensor; the three projections hand their partial input gradients, unreduced, to the
replica's node, which reduces their sum once (Megatron's one f for the three: the linear
kernel's hand-off, ``tpfn.interpret.moves.Moved``), with the whole gradient of anything else
that reads it (a residual) added after. Where something observes what a reader receives (a
user's backward hook on a reader), each reader reduces its own, as native TP does. Every case is
checked against one device (outputs, the input's gradient and every parameter's) and by its
exact collective count.
"""

import torch
import torch.nn as nn

import tpfn
from tests.models import MATMULS, Ops, clone, counts, max_rel_err, rel_err
from tests.ranks import mesh
from tpfn import Partial, Replicate, Shard, colwise, prepare_in, rowwise

# One forward and backward against one device (no optimizer step): sharding reorders float32
# sums only, a few ulps (worst measured here 2.4e-7); a missing or doubled reduction is off by
# order 1.
TOL = 1e-5


class QKV(nn.Module):
    """Attention-shaped: q, k, v read the input; ``mix`` also uses it directly."""

    def __init__(self, mix: bool):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.mix = mix

    def forward(self, x):
        h = self.q(x) * self.k(x).sigmoid() + self.v(x)
        out = self.o(h)
        return out + x.tanh() if self.mix else out  # a reader that is not column-wise


PLAN = {"q": colwise(), "k": colwise(), "v": colwise(), "o": rowwise()}


def _run(mix: bool, parent, hooks: bool = False, split=None):
    m = mesh(2)
    ref = QKV(mix)
    tp = tpfn.parallelize(clone(ref), m, {"": parent, **PLAN})
    if hooks:  # full backward hooks wrap the children's inputs in identities
        seen = []
        for child in (tp.q, tp.k, tp.v):
            child.register_full_backward_hook(lambda mod, gin, gout: seen.append(gin[0].shape))
    torch.manual_seed(1)
    x = torch.randn(2, 6, 8, requires_grad=True)
    mine = x.detach().clone().requires_grad_()
    rank = torch.distributed.get_rank()
    local = mine if split is None else mine.chunk(2, dim=split)[rank]
    comm = counts(lambda: tp(local).pow(2).sum().backward())
    ref(x).pow(2).sum().backward()
    grads = (mine.grad, x.grad) if split is None else (  # each rank: its own shard's gradient
        mine.grad.chunk(2, dim=split)[rank], x.grad.chunk(2, dim=split)[rank])
    errors = [rel_err(*grads), *max_rel_err(tp, ref, grads=True).values()]
    return comm, max(errors), (len(seen) if hooks else None)


def _cases():
    shared = prepare_in(Replicate(), local=True)
    return {
        "children only": _run(False, shared),
        "a direct reader too": _run(True, shared),
        "behind backward hooks": _run(True, shared, hooks=True),
        "as DTensors": _run(False, prepare_in(Replicate())),
        "gathered from a sequence shard": _run(
            False, prepare_in(Shard(1), desired=Replicate(), local=True), split=1),
        "gathered, a direct reader too": _run(
            True, prepare_in(Shard(1), desired=Replicate(), local=True), split=1),
    }


def test_a_shared_replica_reduces_its_readers_gradients_once(ranks2):
    cases = ranks2.run(_cases)[0]
    for name, (_, error, _) in cases.items():
        assert error <= TOL, name
    # forward: o's all-reduce; backward: one all-reduce for q, k and v together
    assert cases["children only"][0] == {"all_reduce": 2}
    # a direct reader's gradient is whole: added to the readers' reduced sum, still one reduction
    assert cases["a direct reader too"][0] == {"all_reduce": 2}
    # a user's backward hook on a reader sees its whole input gradient: each reduces its own
    assert cases["behind backward hooks"][0] == {"all_reduce": 4}
    assert cases["behind backward hooks"][2] == 3  # the user's hooks ran
    assert cases["as DTensors"][0] == {"all_reduce": 2}
    # all-gather forward (after the ranks exchange the hand-split input's local shapes, a
    # second all-gather); reduce-scatter of the summed partial gradients backward
    assert cases["gathered from a sequence shard"][0] == {
        "all_gather": 2, "all_reduce": 1, "reduce_scatter": 1}
    # the readers' sum reduce-scattered, the direct reader's whole gradient chunked, added
    assert cases["gathered, a direct reader too"][0] == {"all_gather": 2, "all_reduce": 1, "reduce_scatter": 1}


def _twice():
    """One graph backwarded twice: each backward reduces its own gradients, never the other's."""
    m = mesh(2)
    ref = QKV(True)
    tp = tpfn.parallelize(clone(ref), m, {"": prepare_in(Replicate(), local=True), **PLAN})
    x = torch.randn(2, 6, 8)
    loss = tp(x).pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    ref_loss = ref(x).pow(2).sum()
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    return max(max_rel_err(tp, ref, grads=True).values())


def test_a_graph_backwarded_twice_reduces_each_backward_apart(ranks2):
    assert ranks2.run(_twice)[0] <= TOL


def _only_some_readers():
    """A backward that reaches the replica through one reader only (the others cut off)."""
    m = mesh(2)
    ref = QKV(False)
    tp = tpfn.parallelize(clone(ref), m, {"": prepare_in(Replicate(), local=True), **PLAN})
    x = torch.randn(2, 6, 8, requires_grad=True)
    mine = x.detach().clone().requires_grad_()
    for model, inp in ((tp, mine), (ref, x)):
        model.k.weight.requires_grad_(False)
        grad, = torch.autograd.grad(model.q(inp).pow(2).sum(), inp)
        inp.grad = grad
    return rel_err(mine.grad, x.grad)


def test_one_reader_alone_gets_its_gradient_reduced(ranks2):
    assert ranks2.run(_only_some_readers)[0] <= TOL


class _NoGradK(QKV):
    """k read without gradients, in the middle of a forward that q and v differentiate."""

    def forward(self, x):
        with torch.no_grad():
            gate = self.k(x).sigmoid()
        return self.o(self.q(x) * gate + self.v(x))


def _a_reader_without_gradients():
    m = mesh(2)
    ref = _NoGradK(False)
    tp = tpfn.parallelize(clone(ref), m, {"": prepare_in(Replicate(), local=True), **PLAN})
    torch.manual_seed(1)
    x = torch.randn(2, 6, 8, requires_grad=True)
    mine = x.detach().clone().requires_grad_()
    loss = tp(mine).pow(2).sum()
    with Ops(MATMULS) as seen:
        comm = counts(loss.backward)
    ref(x).pow(2).sum().backward()
    with torch.no_grad():  # and a whole forward without gradients
        error = rel_err(tp(mine), ref(x))
    ref_params = dict(ref.named_parameters())
    assert all((p.grad is None) == name.startswith("k.") == (ref_params[name].grad is None)
               for name, p in tp.named_parameters())
    grads = [rel_err(p.grad, ref_params[name].grad) for name, p in tp.named_parameters() if p.grad is not None]
    return comm, max(rel_err(mine.grad, x.grad), error, *grads), seen.ops


def test_a_reader_without_gradients_is_not_waited_for(ranks2):
    comm, error, ops = ranks2.run(_a_reader_without_gradients)[0]
    assert error <= TOL
    assert comm == {"all_reduce": 1}  # backward: q and v's one reduction
    # o's, v's and q's input and weight gradients, then the replica's node reduces the sum
    assert ops == ["mm"] * 6 + ["all_reduce"], ops



def _graph():
    """The autograd nodes each projection adds: its output's node and that node's inputs."""
    tp = tpfn.parallelize(QKV(False), mesh(2), {"": prepare_in(Replicate(), local=True), **PLAN})
    seen = {}

    def past_views(node):  # (a linear's output: the rows of its product, viewed in the input's shape)
        return node.next_functions[0][0] if type(node).__name__ in ("ViewBackward0", "UnsafeViewBackward0") else node

    def look(module, args, out):
        node = past_views(out.grad_fn)
        inputs = [type(past_views(n)).__name__ for n, _ in node.next_functions if n is not None]
        seen[module] = (type(node).__name__, inputs)

    look.observes_only = True  # (a hook of tpfn's kind: it changes no route, see tpfn._torch.hooked)

    # a reader whose gradient goes back as terms (grads=) keeps its slot's own move
    terms = tpfn.parallelize(QKV(False), mesh(2), {
        "": prepare_in(Replicate(), local=True), **PLAN,
        "q": prepare_in(Replicate(), grads=Partial(), local=True) >> colwise()})
    for child in (tp.q, tp.o, terms.q):
        child.register_forward_hook(look)
    tp(torch.randn(2, 6, 8, requires_grad=True))
    terms(torch.randn(2, 6, 8, requires_grad=True))
    return seen[tp.q], seen[tp.o], seen[terms.q]


def test_each_linear_is_one_autograd_node_over_its_parameters(ranks2):
    q, o, terms_q = ranks2.run(_graph)[0]
    # q reads the shared replica (its parent's move) as it is: no move of its own, no parameter views
    assert q == ("_LinearBackward", ["_MoveBackward", "AccumulateGrad", "AccumulateGrad"])
    # o: its output's all-reduce, over one node for the linear and its bias (added once)
    assert o == ("_MoveBackward", ["_LinearBackward"])
    # a reader whose gradient goes back as terms splits them inside its own node
    assert terms_q == ("_LinearBackward", ["_MoveBackward", "AccumulateGrad", "AccumulateGrad"]), terms_q
