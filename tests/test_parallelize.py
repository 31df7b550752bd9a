"""parallelize on real gloo ranks: numbers equal the single-device model, communication is
never more than PyTorch's native TP for the same plan, and every promise of the interpreter."""

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tpfn
from tests.models import (
    clone, counts, full, local_heads, max_rel_err, native_transformer,
    native_transformer_plan, rel_err, transformer, transformer_plan,
)
from tests.ranks import mesh
from tpfn import (
    Partial, Replicate, Shard, colwise, params, prepare_in, prepare_out, rowwise, sequence_parallel,
)

# Tolerances. Everything is float32; the figures are relative errors (||a - b|| / ||b||),
# measured on 2 and 4 gloo ranks with ATEN_CPU_CAPABILITY=default, =avx2 and unset (avx512
# on the machine measured); each test gives its own.
#
# TOL: one forward and backward against one device, no optimizer step in between. Sharding
# only changes the order of float32 sums (partial matmuls all-reduced, partial gradients
# summed in one bucket), so outputs and gradients stay within a few ulps of one device:
# the worst measured is 5.1e-7 (uneven sequence, default), so 1e-5 leaves 20x of margin and
# still catches a missing, doubled or misplaced reduction (errors of order 1).
TOL = 1e-5
# Adam steps amplify that noise: a weight whose gradient is tiny still moves by ~lr, in a
# direction set by noise-sized differences, so after 3 steps one device and any TP run
# part by up to 1.6e-4 on a parameter (1.9e-4 on a gradient; transformer, 4 ranks, avx2),
# and PyTorch's native TP with the same plan parts from one device just as much. No fixed
# tolerance against one device is both safe and strict there, so tests that take optimizer
# steps train native TP alongside (same initial weights, same inputs) and check every loss,
# parameter, last gradient and output after training (_assert_like_native):
# (a) tpfn equals native TP within NATIVE_TOL. tpfn does native's float operations except
#     where the plan differs (q, k and v's input gradients summed before one all-reduce; the
#     norms' partial gradients all-reduced in one bucket), and Adam amplifies only those
#     few differences: worst measured 6.0e-7 (transformer, 2 ranks, default; 0 where the
#     operations are the same: the MLP, the tied embedding, sequence parallel on 2 ranks).
#     2e-6 leaves 3x over that, and is 6x (default) to 100x (avx2) below the one-device
#     gap on 4 ranks (1.2e-5 to 1.9e-4).
NATIVE_TOL = 2e-6
# (b) tpfn's deviation from one device is at most NATIVE_FACTOR times native's own, plus
#     NATIVE_FLOOR where native happens to land near one device by chance: tpfn is no
#     further from one device than native TP is, whatever order tpfn sums in. By the
#     triangle inequality (b) holds whenever tpfn is within NATIVE_FLOOR + native's own
#     deviation of native; measured, tpfn used at most 54% of its (b) allowance (1.1e-6 of
#     2.0e-6, transformer, 2 ranks, default) and 50% where Adam's gap is large (4 ranks).
NATIVE_FACTOR, NATIVE_FLOOR = 2.0, 1e-6


def _mlp(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32, bias=bias), nn.ReLU(), nn.Linear(32, 12, bias=bias))


def _train(model, inputs, steps=3, lr=0.05):
    """A few Adam steps; the losses."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x in inputs[:steps]:
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train_side_by_side(tp, nat, ref, inputs) -> dict:
    """Train tpfn's model, native TP's and the one-device model alike (same initial weights,
    same inputs, ``_train``); per quantity (each step's loss, each parameter, its last
    gradient, the output after training) the figures
    ``(tpfn vs one device, native vs one device, tpfn vs native)``, relative errors."""
    losses = [_train(model, inputs) for model in (tp, nat, ref)]
    figures = {}
    for step, (mine, theirs, one) in enumerate(zip(*losses)):
        figures[f"loss {step}"] = (abs(mine - one) / abs(one), abs(theirs - one) / abs(one),
                                   abs(mine - theirs) / abs(theirs))
    ref_params, nat_params = dict(ref.named_parameters()), dict(nat.named_parameters())
    for name, p in tp.named_parameters():
        r, n = ref_params[name], nat_params[name]
        figures[name] = (rel_err(p, r), rel_err(n, r), rel_err(p, n))
        figures[name + ".grad"] = (rel_err(p.grad, r.grad), rel_err(n.grad, r.grad),
                                   rel_err(p.grad, n.grad))
    with torch.no_grad():
        mine, theirs, one = (full(model(inputs[0])) for model in (tp, nat, ref))
    figures["output"] = (rel_err(mine, one), rel_err(theirs, one), rel_err(mine, theirs))
    return figures


def _assert_like_native(figures: dict) -> dict:
    """(a) tpfn equals native TP within NATIVE_TOL and (b) deviates from one device no more
    than native does (times NATIVE_FACTOR, plus NATIVE_FLOOR); the figures, for the record."""
    for what, (mine, theirs, between) in figures.items():
        assert between <= NATIVE_TOL, f"{what}: tpfn differs from native TP by {between:.2e}"
        assert mine <= NATIVE_FACTOR * theirs + NATIVE_FLOOR, (
            f"{what}: tpfn deviates from one device by {mine:.2e}, native TP by {theirs:.2e}")
    return figures


def _mlp_matches_single_device():
    m = mesh(dist.get_world_size())
    ref = _mlp()
    tp = tpfn.parallelize(clone(ref), m, {"0": colwise(), "2": rowwise()})
    nat = parallelize_module(clone(ref), m, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    assert tp[0].weight.placements == (TShard(0),) and tp[2].bias.placements == (TReplicate(),)
    torch.manual_seed(1)
    xs = [torch.randn(6, 12) for _ in range(3)]
    x = torch.randn(6, 12, requires_grad=True)
    mine = counts(lambda: tp(x).sum().backward())
    theirs = counts(lambda: nat(x).sum().backward())
    assert mine == theirs == {"all_reduce": 2}
    # Measured (all three ATEN_CPU_CAPABILITY settings): tpfn and native TP agree bitwise
    # (tpfn vs native 0); each is within 2.2e-7 of one device on 2 ranks, 3.1e-7 on 4.
    return _assert_like_native(_train_side_by_side(tp, nat, ref, xs))


def test_mlp_matches_single_device_and_native_comm(ranks2):
    assert all(ranks2.run(_mlp_matches_single_device))


def test_mlp_on_4_ranks(ranks4):
    assert all(ranks4.run(_mlp_matches_single_device))


def _transformer_matches(sp: bool, tied: bool):
    tp_size = dist.get_world_size()
    m = mesh(tp_size)
    ref = transformer(weight_tying=tied, vocab_size=16)
    tp = local_heads(tpfn.parallelize(clone(ref), m, transformer_plan(sp)), tp_size)
    nat = local_heads(native_transformer(clone(ref), m, sp), tp_size)
    if tied:
        assert tp.output.weight is tp.tok_embeddings.weight
        assert len(list(tp.parameters())) == len(list(ref.parameters()))
    torch.manual_seed(2)
    xs = [torch.randint(0, 16, (4, 8)) for _ in range(3)]
    # Communication of one training step (forward, backward, optimizer), against native TP.
    comm = []
    for model in (tp, nat):
        opt = torch.optim.Adam(model.parameters(), lr=0.0)
        model(xs[0]).sum().backward()  # warm up: Adam creates its state on the first step
        opt.step()
        opt.zero_grad()

        def step():
            model(xs[0]).sum().backward()
            with implicit_replication():
                opt.step()
        comm.append(counts(step))
        model.zero_grad()
    mine, theirs = comm
    assert sum(mine.values()) <= sum(theirs.values()), (mine, theirs)
    # Numbers after a few Adam steps, against native TP trained alongside (the lr=0 step
    # above moved no weight). Measured, worst quantity, avx512 / default / avx2:
    #   2 ranks, tied:        tpfn vs one device 5.8e-7 / 1.1e-6 / 4.2e-7,
    #                         native vs one device 7.3e-7 / 5.3e-7 / 4.6e-7,
    #                         tpfn vs native 4.1e-7 / 6.0e-7 / 3.4e-7 (q, k, v share one
    #                         input-gradient all-reduce; native sums after three);
    #   2 ranks, sequence parallel, tied: tpfn = native (0), both 4.7e-7 / 9.2e-7 / 5.0e-7
    #                         from one device;
    #   4 ranks, sequence parallel, untied: tpfn vs one device 2.4e-5 / 1.2e-5 / 1.9e-4 and
    #                         native the same to 2 digits, tpfn vs native 5.3e-7 / 4.8e-7 /
    #                         4.4e-7 (the bucketed norm gradients: 4 ranks sum in another
    #                         order). The old 1e-5 against one device failed here.
    figures = _assert_like_native(_train_side_by_side(tp, nat, ref, xs))
    return mine, theirs, figures


def test_transformer_matches_single_device(ranks2):
    mine, theirs, _ = ranks2.run(_transformer_matches, False, True)[0]
    # The Megatron minimum: q, k and v share one input gradient all-reduce.
    assert theirs == {"all_reduce": 15, "all_gather": 1}
    assert mine == {"all_reduce": 11, "all_gather": 1}


def test_transformer_with_sequence_parallel_matches_single_device(ranks2):
    mine, theirs, _ = ranks2.run(_transformer_matches, True, True)[0]
    # The norms' partial gradients: native all-reduces each in every Adam op (3 x 10);
    # tpfn sums them all in one all-reduce at the end of backward.
    assert theirs == {"reduce_scatter": 11, "all_gather": 12, "all_reduce": 30}
    assert mine == {"reduce_scatter": 11, "all_gather": 12, "all_reduce": 1}


def test_transformer_untied_on_4_ranks(ranks4):
    mine, theirs, _ = ranks4.run(_transformer_matches, True, False)[0]
    assert mine == {"reduce_scatter": 11, "all_gather": 12, "all_reduce": 1}
    assert theirs == {"reduce_scatter": 11, "all_gather": 12, "all_reduce": 30}


def _side_by_side(sp: bool):
    """The same plan in PyTorch's styles and in tpfn's: same placements, outputs, comm."""
    m = mesh(dist.get_world_size())
    ref = transformer(weight_tying=False, vocab_size=16)
    nat = parallelize_module(clone(ref), m, native_transformer_plan(sp))
    tp = tpfn.parallelize(clone(ref), m, transformer_plan(sp, minimal=False))
    for model in (nat, tp):
        local_heads(model, dist.get_world_size())
    mine_params, their_params = dict(tp.named_parameters()), dict(nat.named_parameters())
    for name, p in their_params.items():
        q = mine_params[name]
        assert type(p) is type(q), name
        if isinstance(p, DTensor):
            assert p.placements == q.placements, name
            assert torch.equal(p.to_local(), q.to_local()), name
    x = torch.randint(0, 16, (4, 8))
    outs, grads, comm = {}, {}, {}
    for label, model in (("tpfn", tp), ("native", nat)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def forward_backward():
            outs[label] = model(x)
            outs[label].sum().backward()

        def optimizer_step():
            with implicit_replication():
                opt.step()
        comm[label] = counts(forward_backward)
        grads[label] = {n: full(p.grad) for n, p in model.named_parameters()}
        for kind, n in counts(optimizer_step).items():  # one training step in all
            comm[label][kind] = comm[label].get(kind, 0) + n
    assert torch.equal(outs["tpfn"], outs["native"])
    for name in their_params:
        assert torch.equal(grads["tpfn"][name], grads["native"][name]), name
        assert torch.equal(full(mine_params[name]), full(their_params[name])), name
    # No more collectives of any kind.
    assert all(comm["tpfn"].get(k, 0) <= v for k, v in comm["native"].items())
    assert set(comm["tpfn"]) <= set(comm["native"])
    return comm


def test_same_plan_in_pytorch_and_tpfn_styles_agree(ranks2):
    comm = ranks2.run(_side_by_side, False)[0]
    assert comm["tpfn"] == comm["native"] == {"all_reduce": 15, "all_gather": 1}
    comm = ranks2.run(_side_by_side, True)[0]
    assert comm["native"] == {"reduce_scatter": 11, "all_gather": 12, "all_reduce": 10}
    assert comm["tpfn"] == {"reduce_scatter": 11, "all_gather": 12, "all_reduce": 1}


def _vocab_parallel_tied_head():
    """Embedding rowwise (vocab-parallel) tied to a colwise head: one Parameter, Shard(0)."""
    m = mesh(2)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.emb(ids)))

    torch.manual_seed(0)
    ref = LM()
    tp = tpfn.parallelize(clone(ref), m, {
        "emb": rowwise(), "head": colwise() >> prepare_out(Replicate())})
    assert tp.emb.weight is tp.head.weight and tp.emb.weight.placements == (TShard(0),)
    nat = parallelize_module(clone(ref), m, {
        "emb": RowwiseParallel(input_layouts=TReplicate()),
        "head": ColwiseParallel(output_layouts=TReplicate())})
    nat.head.weight = nat.emb.weight  # native TP unties them; both are Shard(0), so tie again
    ids = torch.tensor([[1, 9, 3, 0], [5, 5, 2, 7]])
    # Measured (all three ATEN_CPU_CAPABILITY settings): tpfn and native TP agree bitwise
    # (0); each is within 5.3e-8 of one device.
    return _assert_like_native(_train_side_by_side(tp, nat, ref, [ids] * 3))


def test_vocab_parallel_embedding_and_tied_head(ranks2):
    assert all(ranks2.run(_vocab_parallel_tied_head))


def _rowwise_embedding_takes_replicated_ids():
    m = mesh(2)
    torch.manual_seed(0)
    ref = nn.Embedding(10, 6)
    ids = torch.tensor([[1, 2, 3, 4], [9, 8, 7, 6]])
    tp = tpfn.parallelize(clone(ref), m, rowwise())
    assert torch.equal(tp(ids), ref(ids))
    # PyTorch's default annotates the ids Shard(-1): each rank's ids are taken as a
    # quarter of a longer sequence, and the output has the wrong length.
    nat = parallelize_module(clone(ref), m, RowwiseParallel())
    return tuple(nat(ids).shape)


def test_rowwise_embedding_takes_replicated_ids(ranks2):
    assert ranks2.run(_rowwise_embedding_takes_replicated_ids)[0] == (2, 8, 6)


def _embedding_options(style, **options):
    """Embedding options the local kernel cannot honour leave the module to DTensor."""
    m = mesh(2)
    torch.manual_seed(0)
    ref = nn.Embedding(10, 6, **options)
    tp = tpfn.parallelize(clone(ref), m, style >> prepare_out(Replicate()))
    ids = torch.tensor([[0, 2, 2, 7], [9, 5, 5, 7]])  # 0 and 5 start the two vocabulary shards
    out, expected = tp(ids), ref(ids)
    (out * torch.arange(6.0)).sum().backward()
    (expected * torch.arange(6.0)).sum().backward()
    grad = tp.weight.grad.full_tensor()
    # One forward and backward (TOL): measured 0, bitwise equal, with all three
    # ATEN_CPU_CAPABILITY settings (a lookup and a scatter-add of whole rows).
    return (rel_err(out, expected) <= TOL,
            rel_err(grad.to_dense() if grad.is_sparse else grad, ref.weight.grad.to_dense()) <= TOL)


def test_embeddings_with_options_match_one_device(ranks2):
    for options in ({"scale_grad_by_freq": True}, {"padding_idx": 5}):
        for style in (rowwise(), colwise()):
            assert ranks2.run(_embedding_options, style, **options) == [(True, True)] * 2, options


def _every_positional_input_reaches_the_module():
    m = mesh(2)

    class Scaled(nn.Linear):
        def forward(self, x, scale, *, shift=0.0):
            return super().forward(x) * scale + shift

    torch.manual_seed(0)
    ref = Scaled(4, 6)
    tp = tpfn.parallelize(clone(ref), m, colwise() >> prepare_out(Replicate()))
    x, scale = torch.randn(3, 4), torch.tensor(2.0)
    assert torch.allclose(tp(x, scale, shift=1.0), ref(x, scale, shift=1.0))
    assert torch.allclose(tp(x=x, scale=scale), ref(x, scale))  # input 0 passed by keyword
    return True


def test_every_positional_input_reaches_the_module(ranks2):
    assert all(ranks2.run(_every_positional_input_reaches_the_module))


def _keyword_inputs_and_structured_outputs():
    m = mesh(2)
    rank = dist.get_rank()

    class Pair(nn.Module):
        def forward(self, x, *, mask=None):
            assert isinstance(x, DTensor) and isinstance(mask, DTensor)
            assert x.placements == (TReplicate(),) and mask.placements == (TReplicate(),)
            return {"sum": (x + mask).to_local(), "x": x.to_local(), "n": 3}

    style = (prepare_in(Shard(0), desired=Replicate(), kwargs={"mask": (Shard(0), Replicate())})
             >> prepare_out(keys={"sum": (Replicate(), Shard(1))}))
    tp = tpfn.parallelize(Pair(), m, style)
    full_x = torch.arange(16.0).reshape(4, 4)
    x = full_x.chunk(2)[rank]
    out = tp(x, mask=x * 0 + 1)
    assert out["n"] == 3 and torch.equal(out["x"], full_x)
    assert torch.equal(out["sum"], (full_x + 1).chunk(2, dim=1)[rank])

    class Two(nn.Module):
        def forward(self, a, b):
            return a * 2, b

    tp = tpfn.parallelize(Two(), m, prepare_out(Replicate(), None, given=(Partial(), None)))
    a, b = tp(torch.ones(2), "untouched")
    assert torch.equal(a, torch.full((2,), 4.0)) and b == "untouched"
    return True


def test_keyword_inputs_and_tuple_and_dict_outputs(ranks2):
    assert all(ranks2.run(_keyword_inputs_and_structured_outputs))


def _dtensor_input_layout_is_checked():
    m = mesh(2)
    tp = tpfn.parallelize(nn.Linear(4, 4), m, prepare_in(Shard(0)) >> colwise())
    wrong = distribute_tensor(torch.randn(4, 4), m, [TReplicate()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tp(wrong)
        except tpfn.LayoutError as e:
            message = str(e)
        else:
            message = "no error"
    # The output hook that runs after a failed input hook is quiet, and the module still works.
    assert not caught, [str(w.message) for w in caught]
    assert tp(torch.randn(2, 4)).shape == (4, 2)  # rows gathered, columns sharded
    return message


def test_a_dtensor_input_must_have_the_declared_layout(ranks2):
    message = ranks2.run(_dtensor_input_layout_is_checked)[0]
    assert message == ("input 0 of '<root>' (Linear) arrives laid out Replicate() but the plan "
                       "declares Shard(dim=0); declare Replicate() there, or redistribute it "
                       "before the call.")


def _uneven_sequence_keeps_its_length():
    """A sequence of 7 on 2 ranks through local Shard(1) outputs (torchtitan#1306)."""
    m = mesh(2)
    ref = transformer(vocab_size=16, max_seq_len=16)
    tp = local_heads(tpfn.parallelize(clone(ref), m, transformer_plan(sp=True)), 2)
    x = torch.randint(0, 16, (2, 7))
    out = tp(x)
    assert out.shape == (2, 7, 16)
    # One forward and backward (TOL): worst measured 5.1e-7 (default; 4.4e-7 avx2, avx512).
    assert rel_err(out, ref(x)) <= TOL
    out.sum().backward()
    ref(x).sum().backward()
    assert max(max_rel_err(tp, ref, grads=True).values()) <= TOL
    return True


def test_uneven_sequence_keeps_its_length_through_local_outputs(ranks2):
    assert all(ranks2.run(_uneven_sequence_keeps_its_length))


def _two_sequences_with_one_local_length():
    """Rank 0 holds 4 positions of a sequence of 7 and of one of 8: each keeps its own length."""
    m = mesh(2)
    norm = tpfn.parallelize(nn.LayerNorm(4), m, sequence_parallel(local=True))
    gather = tpfn.parallelize(nn.Identity(), m, tpfn.prepare_in(Shard(1), desired=Replicate()))
    rank = dist.get_rank()
    def shard(full):  # a DTensor tells its global length
        return DTensor.from_local(full.chunk(2, dim=1)[rank], m, [TShard(1)],
                                  shape=full.shape, stride=full.stride())

    a = norm(shard(torch.randn(2, 7, 4)))
    b = norm(shard(torch.randn(2, 8, 4)))  # on rank 0, the same local shape as a, seen last
    return tuple(gather(t).shape for t in (a, b))


def test_each_local_tensor_keeps_its_own_global_shape(ranks2):
    assert ranks2.run(_two_sequences_with_one_local_length) == [((2, 7, 4), (2, 8, 4))] * 2


def _src_rank():
    m = mesh(2)
    rank = dist.get_rank()
    torch.manual_seed(rank)  # every rank initializes differently
    broadcast = tpfn.parallelize(nn.Linear(4, 4), m, tpfn.replicate())
    torch.manual_seed(rank)
    own = tpfn.parallelize(nn.Linear(4, 4), m, tpfn.replicate(), src_rank=None)
    torch.manual_seed(0)
    rank0 = nn.Linear(4, 4)
    torch.manual_seed(rank)
    mine = nn.Linear(4, 4)
    return (torch.equal(broadcast.weight.to_local(), rank0.weight),
            torch.equal(own.weight.to_local(), mine.weight))


def test_src_rank_broadcasts_or_keeps_local_values(ranks2):
    assert ranks2.run(_src_rank) == [(True, True), (True, True)]


def _meta_device_deferred_init():
    m = mesh(2)
    with torch.device("meta"):
        model = _mlp()
    tpfn.parallelize(model, m, {"0": colwise(), "2": rowwise()}, src_rank=None)
    assert model[0].weight.is_meta and model[0].weight.to_local().shape == (16, 12)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in (model[0], model[2]):
        layer.reset_parameters()
    assert model[0].weight.to_local().shape == (16, 12)
    assert model(torch.randn(3, 12)).shape == (3, 12)
    return True


def test_meta_device_modules_parallelize_then_materialize(ranks2):
    assert all(ranks2.run(_meta_device_deferred_init))


def _meta_against_cpu(m) -> list:
    """The parameters whose DTensor differs between a meta model and its CPU twin, both
    parallelized on ``m``: uneven and empty shards, packed parts, negative dims, frozen, bfloat16."""
    plan = {"0": colwise(), "2": rowwise(), "3": params(weight=Shard(-1)),
            "4": params(weight=Shard(-1, parts=2)), "5": colwise()}

    def build(device):
        with torch.device(device):
            model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 7), nn.LayerNorm(7),
                                  nn.Linear(12, 6), nn.Linear(8, 1))  # 5: one row, none on rank 1 of 2
        model[2].bias.requires_grad_(False)
        return tpfn.parallelize(model.to(torch.bfloat16), m, plan, src_rank=None)

    meta, cpu = build("meta"), build("cpu")
    differ = []
    for (name, p), q in zip(meta.named_parameters(), cpu.parameters()):
        local, want = (p.to_local(), q.to_local()) if isinstance(q, DTensor) else (p, q)
        if not (isinstance(p, nn.Parameter) and p.is_meta and type(p) is type(q)
                and getattr(p, "_spec", None) == getattr(q, "_spec", None) and p.requires_grad == q.requires_grad
                and (local.shape, local.stride(), local.dtype) == (want.shape, want.stride(), want.dtype)):
            differ.append(name)
    return differ


def test_a_meta_model_gets_the_parameters_its_cpu_twin_gets():
    """On the meta device there are no values to send: each parameter's DTensor is built at
    once, and is the one ``distribute_tensor`` gives the same parameter on the CPU."""
    from tpfn.dryrun import fake_mesh
    assert _meta_against_cpu(fake_mesh(3)) == []


def _meta_on_two_ranks():
    return _meta_against_cpu(mesh(2))


def test_a_meta_models_last_rank_gets_its_smaller_and_empty_shards(ranks2):
    assert ranks2.run(_meta_on_two_ranks) == [[], []]


def _errors():
    from torch.distributed.device_mesh import init_device_mesh
    m = mesh(2)
    found = {}
    try:
        tpfn.parallelize(nn.Linear(2, 2), init_device_mesh("cpu", (2, 1), mesh_dim_names=("tp", "dp")),
                         colwise())
    except ValueError as e:
        found["nd"] = str(e)
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        tpfn.parallelize(model, m, {"0": colwise(), "1": colwise(), "2": rowwise(), "3": rowwise()})
    except tpfn.PlanError as e:
        found["plan"] = e.problems
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert not any(sub._forward_pre_hooks or sub._forward_hooks for sub in model.modules())

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

    try:
        tpfn.parallelize(Tied(), m, {"a": colwise(), "b": rowwise()})
    except tpfn.PlanError as e:
        found["tied"] = e.problems
    twice = tpfn.parallelize(_mlp(), m, {"0": colwise()})
    try:
        tpfn.parallelize(twice, m, {"0": colwise()})
    except tpfn.PlanError as e:
        found["twice"] = e.problems
    return found


def test_bad_parallelize_calls_raise_before_changing_anything(ranks2):
    found = ranks2.run(_errors)[0]
    assert found["nd"] == ("parallelize takes the 1-D tensor-parallel mesh, got a 2-D mesh (2, 1) "
                           "with dims ('tp', 'dp'); pass mesh['tp'].")
    assert found["plan"] == [
        "'3' -> rowwise() matches no module; modules here: 0, 1, 2",
        "colwise() at '1' (ReLU): it shards nn.Linear, nn.Embedding, nn.MultiheadAttention, "
        "transformers' Conv1D, nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d, nn.BatchNorm1d/2d/3d and nn.GroupNorm, not ReLU.",
    ]
    assert found["tied"] == [
        "parameter 'b.weight' is tied to 'a.weight': colwise() places it Shard(dim=0) and "
        "rowwise() places it Shard(dim=1); a tied tensor has one layout, so give both modules "
        "styles that agree."]
    assert found["twice"] == [
        "'0' (Linear) is already parallelized (colwise()); parallelize a fresh module, or leave "
        "it out of this plan."]


def _sequence_parallel_norm():
    m = mesh(2)
    torch.manual_seed(0)
    ref = nn.LayerNorm(8)
    nn.init.normal_(ref.weight)  # not ones: the broadcast from src_rank keeps it
    tp = tpfn.parallelize(clone(ref), m, sequence_parallel())
    x = torch.randn(2, 6, 8)
    rank = dist.get_rank()
    out = tp(x.chunk(2, dim=1)[rank])
    assert isinstance(out, DTensor) and out.placements == (TShard(1),)
    assert torch.allclose(out.full_tensor(), ref(x), atol=1e-6)
    out.full_tensor().pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    # Each rank's gradient was a partial sum over its slice; backward summed them in bulk.
    # One backward (TOL): worst measured 9.3e-8 (default; 4.7e-8 avx2, avx512).
    assert tp.weight.grad.placements == (TReplicate(),)
    assert rel_err(tp.weight.grad, ref.weight.grad) <= TOL
    return True


def test_sequence_parallel_runs_each_rank_on_its_slice(ranks2):
    assert all(ranks2.run(_sequence_parallel_norm))


def _accumulated_partial_grads():
    """Two backwards before a step (gradient accumulation) still sum every slice once."""
    m = mesh(2)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8))
    tp = tpfn.parallelize(clone(ref), m, {"0": sequence_parallel(local=True),
                                          "1": sequence_parallel(local=True)})
    xs = [torch.randn(2, 6, 8) for _ in range(2)]
    rank = dist.get_rank()
    comm = [counts(lambda: tp(x.chunk(2, dim=1)[rank]).pow(2).sum().backward()) for x in xs]
    for x in xs:
        ref(x).pow(2).sum().backward()
    # Two backwards, no step (TOL): worst measured 1.3e-7 (avx2, avx512; 7.0e-8 default).
    assert max(max_rel_err(tp, ref, grads=True).values()) <= TOL
    return comm


def test_partial_gradients_are_summed_once_per_backward_in_one_buffer(ranks2):
    first, second = ranks2.run(_accumulated_partial_grads)[0]
    # Four partial gradients, one all-reduce; accumulating a second backward, one more.
    assert first == second == {"all_reduce": 1}


def _attention_block():
    m = mesh(2)
    model = transformer(vocab_size=16, n_layers=1)
    block = model.layers[0].attention
    tp = tpfn.parallelize(clone(block), m, {
        "": prepare_in(Replicate()), "w[qkv]": colwise(), "wo": rowwise()})
    tp.n_heads //= 2
    x = torch.randn(2, 8, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    mine = counts(lambda: tp(x2).sum().backward())
    block(x).sum().backward()
    # One forward and backward (TOL): worst measured 3.2e-7 (avx512; 3.0e-7 default, avx2).
    assert rel_err(x2.grad, x.grad) <= TOL
    assert max(max_rel_err(tp, block, grads=True).values()) <= TOL
    return mine


def test_attention_block_needs_one_all_reduce_each_way(ranks2):
    assert ranks2.run(_attention_block)[0] == {"all_reduce": 2}
