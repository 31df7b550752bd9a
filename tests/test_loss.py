"""tpfn.cross_entropy on vocab-sharded logits equals F.cross_entropy on the full logits."""

import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.utils._python_dispatch import TorchDispatchMode

import tpfn
from tests.models import clone, max_rel_err, rel_err
from tests.ranks import mesh
from tpfn import colwise, rowwise
from tpfn.trace import kind

CASES = list(itertools.product(
    ["mean", "sum", "none"],           # reduction
    [-100, 3],                         # ignore_index (3 occurs in the targets)
    [False, True],                     # class weights
    [0.0, 0.2],                        # label smoothing
))


def _matches_f_cross_entropy(vocab):
    m = mesh(2)
    torch.manual_seed(0)
    logits = torch.randn(7, vocab, dtype=torch.float64)
    target = torch.tensor([3, 0, vocab - 1, 3, 5, 1, 2])
    target[1] = -100
    weight = torch.rand(vocab, dtype=torch.float64) + 0.5
    problems = []
    for reduction, ignore, weighted, smoothing in CASES:
        kw = dict(weight=weight if weighted else None, ignore_index=ignore,
                  reduction=reduction, label_smoothing=smoothing)
        full = logits.clone().requires_grad_()
        expected = F.cross_entropy(full, target.clamp_min(0) if ignore != -100 else target, **kw)
        sharded = distribute_tensor(logits, m, [TShard(1)]).requires_grad_()
        got = tpfn.cross_entropy(sharded, target.clamp_min(0) if ignore != -100 else target, **kw)
        grad_out = torch.rand_like(expected)
        expected.backward(grad_out)
        got.backward(grad_out)
        if not torch.allclose(got, expected, rtol=1e-12, atol=1e-12):
            problems.append(("value", reduction, ignore, weighted, smoothing))
        if not torch.allclose(sharded.grad.full_tensor(), full.grad, rtol=1e-10, atol=1e-12):
            problems.append(("grad", reduction, ignore, weighted, smoothing))
    return problems


def test_every_option_matches_f_cross_entropy(ranks2):
    assert ranks2.run(_matches_f_cross_entropy, 12) == [[], []]


def test_an_uneven_vocabulary_matches_too(ranks2):
    assert ranks2.run(_matches_f_cross_entropy, 11) == [[], []]


class _Sizes(TorchDispatchMode):
    """The element counts of every collective, by kind."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kind(func):  # (a c10d op takes a list of tensors, a functional collective one)
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.seen.append((kind(func), first.numel()))
        return func(*args, **(kwargs or {}))


def _only_per_token_statistics_move():
    m = mesh(2)
    tokens, vocab = 6, 64
    logits = distribute_tensor(torch.randn(tokens, vocab), m, [TShard(1)]).requires_grad_()
    target = torch.randint(0, vocab, (tokens,))
    with _Sizes() as forward:
        loss = tpfn.cross_entropy(logits, target, label_smoothing=0.1)
    with _Sizes() as backward:
        loss.backward()
    return forward.seen, backward.seen


def test_no_collective_moves_the_logits(ranks2):
    forward, backward = ranks2.run(_only_per_token_statistics_move)[0]
    # The max per token, then (sum of exp, target logit, sum of logits) per token.
    assert forward == [("all_reduce", 6), ("all_reduce", 3 * 6)]
    assert backward == []


def _other_log_softmax_uses_keep_their_gradients():
    m = mesh(2)
    torch.manual_seed(0)
    logits = torch.randn(5, 8, dtype=torch.float64)
    target = torch.tensor([1, 7, 0, 3, 3])
    scores = torch.randn(5, 8, dtype=torch.float64)

    # A cross-entropy plus a DPO-like term that consumes log_softmax directly.
    full = logits.clone().requires_grad_()
    (F.cross_entropy(full, target) + (full.log_softmax(-1) * scores).sum()).backward()
    sharded = distribute_tensor(logits, m, [TShard(1)]).requires_grad_()
    weights = distribute_tensor(scores, m, [TReplicate()])
    dpo = (sharded.log_softmax(-1) * weights).sum().full_tensor()
    (tpfn.cross_entropy(sharded, target) + dpo).backward()
    return torch.allclose(sharded.grad.full_tensor(), full.grad, rtol=1e-10)


def test_other_log_softmax_uses_keep_their_gradients(ranks2):
    assert all(ranks2.run(_other_log_softmax_uses_keep_their_gradients))


class LM(nn.Module):
    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def _language_model_loss():
    m = mesh(2)
    torch.manual_seed(0)
    ref = LM()
    tp = tpfn.parallelize(clone(ref), m, {"emb": rowwise(), "head": colwise(local=False)})
    ids = torch.randint(0, 16, (3, 5))
    target = torch.randint(0, 16, (3, 5))
    logits = tp(ids)
    assert isinstance(logits, DTensor) and logits.placements == (TShard(2),)
    loss = tpfn.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.1)
    expected = F.cross_entropy(ref(ids).flatten(0, 1), target.flatten(), label_smoothing=0.1)
    loss.backward(), expected.backward()
    assert rel_err(loss, expected) <= 1e-6
    assert max(max_rel_err(tp, ref, grads=True).values()) <= 1e-5
    local = tpfn.cross_entropy(logits.to_local().flatten(0, 1), target.flatten(), mesh=m,
                               label_smoothing=0.1)
    assert torch.allclose(local, loss)
    return True


def test_a_colwise_head_trains_with_vocab_parallel_loss(ranks2):
    assert all(ranks2.run(_language_model_loss))


def _errors():
    m = mesh(2)
    rank = dist.get_rank()
    wrong = distribute_tensor(torch.randn(4, 6), m, [TShard(0)])
    found = []
    for call in (
        lambda: tpfn.cross_entropy(wrong, torch.zeros(4, dtype=torch.long)),
        lambda: tpfn.cross_entropy(torch.randn(4, 3), torch.zeros(4, dtype=torch.long)),
        lambda: tpfn.cross_entropy(wrong, torch.rand(4, 6)),
        lambda: tpfn.cross_entropy(wrong, torch.zeros(4, dtype=torch.long), reduction="avg"),
    ):
        try:
            call()
            found.append(None)
        except (TypeError, ValueError) as e:
            found.append(str(e))
    return rank, found


def test_bad_arguments_are_named(ranks2):
    _, found = ranks2.run(_errors)[0]
    assert found == [
        "cross_entropy: logits must be sharded on their class dim 1, like F.cross_entropy's "
        "input; got (Shard(dim=0),). End the head with colwise(local=False), and move the "
        "classes to dim 1 (logits.flatten(0, -2) for (batch, seq, vocab)).",
        "cross_entropy: give the sharded logits as a DTensor, or a local tensor with mesh=.",
        "cross_entropy: target must hold class indices; class probabilities would have to be "
        "sharded like the logits, which tpfn does not do.",
        "cross_entropy: 'reduction' must be 'mean', 'sum' or 'none' (got 'avg').",
    ]
