"""tpfn.suggest: a plan for any module from one traced forward, printed as the code that builds it."""

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from hypothesis import given
from hypothesis import strategies as st

import tpfn
from tests import shaped
from tests.models import one_step
from tests.test_style import NAMESPACE
from tpfn import colwise, plan, rowwise
from tpfn.dryrun.cost import Link, Machine
from tpfn.dryrun.units import fmt_seconds
from tpfn.analysis.factors import local_shape, plain, tag, view

TOL = 1e-5  # float32 sums in another order (tests/test_parallelize.py's bar for a block)


class Attention(nn.Module):
    """Multi-head attention viewing its heads by ``-1`` (or, ``by_count``, by its global head
    count, as OPT does; ``"literal"``: by a number written in the code)."""

    def __init__(self, dim=32, heads=4, kv_heads=None, by_count=False):
        super().__init__()
        self.heads, self.kv, self.d, self.by_count = heads, kv_heads or heads, dim // heads, by_count
        self.q = nn.Linear(dim, heads * self.d)
        self.k = nn.Linear(dim, self.kv * self.d, bias=False)  # a key's bias: zero gradient under softmax
        self.v = nn.Linear(dim, self.kv * self.d)
        self.o = nn.Linear(heads * self.d, dim)

    def forward(self, x):
        b, s, _ = x.shape
        if self.by_count:
            h = 4 if self.by_count == "literal" else self.heads
            q, k, v = (p(x).view(b, -1, h, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        else:
            q, k, v = (p(x).view(b, s, -1, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Act(nn.Module):
    """An activation with a parameter of its own (a learned slope, through softplus)."""

    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return F.gelu(x) * F.softplus(self.alpha)


class Block(nn.Module):
    def __init__(self, dim=32, norm_inside=False, **kw):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, **kw)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.act = Act()
        self.inner = nn.LayerNorm(4 * dim) if norm_inside else nn.Identity()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(self.inner(self.act(self.up(self.norm2(x)))))


class Toy(nn.Module):
    """A small language model: an embedding, blocks, a norm and a head (tied with ``tie``)."""

    def __init__(self, vocab=64, dim=32, layers=2, tie=False, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, **kw) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def rules(p) -> dict:
    return {k: repr(v) for k, v in p.rules}


def notes(p) -> dict:
    return dict(p.notes)


def comments(p) -> str:
    """The comments of the printed plan, as one line."""
    return " ".join(line.strip()[2:] for line in repr(p).splitlines() if line.strip().startswith("# "))


def test_an_mlp_is_one_megatron_pair_and_its_plan_prints_as_the_code_that_builds_it():
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    p = tpfn.suggest(mlp, 2, example_inputs=torch.randn(8, 16))
    assert p == plan({"0": colwise(), "2": rowwise()})
    assert eval(repr(p), NAMESPACE) == p
    assert "    # over 2 ranks: 0 (64 features) column-wise; 2 row-wise, one all-reduce\n    '0': colwise()," \
        in repr(p)
    assert repr(p).startswith("plan({\n    # tpfn.suggest over 2 ranks: 1 group sharded, 99% of the parameter")


def test_attention_is_sharded_on_the_heads_its_views_make_with_one_replica_for_q_k_v():
    p = tpfn.suggest(Toy(kv_heads=2), 2, example_inputs=(2, 16))
    assert rules(p) == {
        "embed": "colwise() >> prepare_out(Replicate())",
        "layers.*.attn": "prepare_in(Replicate(), local=True)",
        "layers.*.attn.k": "colwise()", "layers.*.attn.q": "colwise()", "layers.*.attn.v": "colwise()",
        "layers.*.attn.o": "rowwise()", "layers.*.up": "colwise()", "layers.*.down": "rowwise()",
        # its parameter meets the sharded features: each rank's gradient is a partial sum
        "layers.*.act": "replicate() >> on_shards(param_grads={'alpha': Partial()})"}
    assert notes(p)["layers.*.attn"] == ("over 2 ranks: k (2 heads), q (4 heads), v (2 heads) column-wise; "
                                         "o row-wise, one all-reduce")
    assert notes(p)["head"] == "left whole: sharding it would move 8.0 KiB per step to save 4.0 KiB per rank"
    assert eval(repr(p), NAMESPACE) == p


def test_a_view_by_the_global_head_count_is_caught_op_by_op_and_held_per_rank():
    """OPT's attention views ``(b, -1, self.num_heads, d)``: on a rank's half of the features that
    halves the positions instead of the heads, and no shape error follows. The ranks' check
    sees it, and the head count held per rank (``per_rank``) fixes it."""
    p = tpfn.suggest(Toy(by_count=True), 2, example_inputs=(2, 16))
    assert rules(p)["layers.*.attn"] == "prepare_in(Replicate(), local=True) >> per_rank('heads')"
    literal = tpfn.suggest(Toy(by_count="literal"), 2, example_inputs=(2, 16))
    assert not any(k.startswith("layers.*.attn") for k in rules(literal))
    assert notes(literal)["layers.*.attn"] == (
        "left whole, k, q, v, o: on a rank's shard 'layers.*.attn' computes aten.view.default of shape "
        "(2, 8, 4, 8) where its share of (2, 16, 4, 8) is (2, 16, 2, 8)")


def test_a_norm_over_the_features_between_a_pair_leaves_it_whole_with_the_reason():
    p = tpfn.suggest(Toy(norm_inside=True), 2, example_inputs=(2, 16))
    assert "layers.*.up" not in rules(p) and "layers.*.attn.q" in rules(p)
    assert notes(p)["layers.*.up"] == "left whole: a norm over the sharded features in 'layers.*.inner'"


def test_heads_the_ranks_do_not_split_leave_the_attention_whole():
    p = tpfn.suggest(Toy(), 3, example_inputs=(2, 16))
    assert rules(p)["layers.*.up"] == "colwise()" and "layers.*.attn.q" not in rules(p)
    assert notes(p)["layers.*.attn"] == ("left whole, k, q, v, o: 3 ranks do not split 'layers.*.attn.q''s "
                                         "4 heads into whole heads")


class LowRankGate(nn.Module):
    """An attention's gate through a rank of one head (Kimi's ``g_a_proj``, ``g_b_proj``):
    ``parallelize`` counts the heads of its column-wise projections by ``head_dim``."""

    head_dim = 8

    def __init__(self):
        super().__init__()
        self.g_a, self.g_b = nn.Linear(32, 8), nn.Linear(8, 32)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.g_b(F.silu(self.g_a(x))) * self.down(F.relu(self.up(x)))


def test_heads_parallelize_would_refuse_leave_their_pair_whole_with_its_reason():
    x = torch.randn(2, 4, 32)
    with pytest.raises(tpfn.PlanError, match=r"'g_a' of '<root>' \(LowRankGate\) projects 1 heads"):
        tpfn.explain(LowRankGate(), {"g_a": colwise(), "g_b": rowwise()}, world_size=2, example_inputs=x)
    p = tpfn.suggest(LowRankGate(), 2, example_inputs=x)
    assert rules(p) == {"up": "colwise()", "down": "rowwise()"}
    assert notes(p)[""] == ("left whole, g_a, g_b: 'g_a' of '<root>' (LowRankGate) projects 1 heads of 8 "
                            "features: fewer heads than the 2 ranks, so colwise() cannot give each rank a whole head")
    tpfn.explain(LowRankGate(), p, world_size=2, example_inputs=x)  # parallelize takes it


class Pooled(nn.Module):
    """A wide linear whose features a sum over them leaves no pair (a pooler's)."""

    def __init__(self):
        super().__init__()
        self.pool = nn.Linear(64, 4096)

    def forward(self, x):
        return torch.tanh(self.pool(x[:, 0])).sum(-1)


def test_a_module_left_out_of_a_pair_but_sharded_alone_says_its_choice():
    p = tpfn.suggest(Pooled(), 2, example_inputs=torch.randn(1, 4, 64))
    assert rules(p) == {"pool": "colwise() >> prepare_out(Replicate())"}
    assert notes(p)["pool"].startswith("column-wise, its output gathered: moves"), notes(p)


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.r, self.o = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x, g):
        return self.o(torch.sigmoid(self.r(x)) * g)


class Outside(nn.Module):
    """A pair whose sharded features meet a tensor that a norm outside it computes, and that
    the output reads besides (RWKV's time mixing, in small)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.gate = nn.LayerNorm(64), Gate()

    def forward(self, x, h):
        g = self.norm(h).mean(-1, keepdim=True)
        return self.gate(x, g) + g


def test_a_pair_meeting_a_tensor_computed_outside_it_is_no_pair_and_one_devices_numbers(ranks2):
    """Marked partial, the norm's gradients would be one rank's share on the gate's path and
    whole on the other: summed over the ranks, the whole one counted twice."""
    p = tpfn.suggest(Outside(), 2, example_inputs=(torch.randn(2, 4, 32), torch.randn(2, 4, 64)))
    assert "norm" not in rules(p)
    assert notes(p)["gate"] == ("no pair, r, o: a tensor 'norm' computes outside the pair meets its sharded "
                                "features: the gradients of 'norm''s parameters would be one rank's share on "
                                "that path and whole on the others")
    for errors in ranks2.run(_outside_errors, p):
        assert max(errors.values()) < TOL, errors


def _outside_errors(p) -> dict:
    from tests.ranks import mesh

    ref = Outside()
    tp = tpfn.parallelize(copy.deepcopy(ref), mesh(2), p)
    gen = torch.Generator().manual_seed(1)
    x, h, c = (torch.randn(2, 4, k, generator=gen) for k in (32, 64, 32))
    (ref(x, h) * c).sum().backward()
    (tp(x, h) * c).sum().backward()
    theirs = dict(ref.named_parameters())
    return {n: ((q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad) - theirs[n].grad).abs().max().item()
            for n, q in tp.named_parameters()}


def test_a_tied_embedding_and_head_choose_one_layout_by_their_cost():
    few = tpfn.suggest(Toy(tie=True, vocab=4096), 2, example_inputs=(1, 8))
    assert rules(few)["embed"] == "rowwise()"
    assert rules(few)["head"] == "colwise() >> prepare_out(Replicate())"
    assert notes(few)["head"].startswith("column-wise, its output gathered (its weight tied to 'embed'): moves")
    many = tpfn.suggest(Toy(tie=True), 2, example_inputs=(2, 16))
    assert "embed" not in rules(many) and "head" not in rules(many)
    assert notes(many)["embed"] == ("left whole: sharding it with 'head', which shares its weight, would move "
                                    "12.0 KiB per step to save 4.0 KiB per rank")


def _machine(latency: float, bandwidth: float, **links) -> Machine:
    """A machine whose collectives take ``latency`` per ring step at ``bandwidth`` (``links``: other
    figures for some kinds)."""
    return Machine(flops=1e11, bandwidth=2e10, op=5e-6, links=tuple(
        (kind, links.get(kind, Link(latency, bandwidth))) for kind in ("all_reduce", "all_gather", "reduce_scatter")))


def test_given_a_machine_lone_modules_are_weighed_in_seconds_per_step_on_it():
    """In bytes, the small head is left whole (8 KiB moved per step to save 4 KiB per rank) and the
    wide one sharded; in seconds, links that cost nothing shard both, links whose every ring step
    costs a second leave both whole: the optimizer's step on a few KiB takes microseconds."""
    fast, slow = _machine(0.0, 1e15), _machine(1.0, 1e9)
    small, wide = Toy(), Toy(vocab=4096)
    assert "head" not in rules(tpfn.suggest(small, 2, example_inputs=(2, 16)))
    assert rules(tpfn.suggest(wide, 2, example_inputs=(1, 8)))["head"] == "colwise() >> prepare_out(Replicate())"
    on_fast = tpfn.suggest(small, 2, example_inputs=(2, 16), machine=fast)
    assert rules(on_fast)["head"] == "colwise() >> prepare_out(Replicate())"
    note = notes(on_fast)["head"]
    assert re.fullmatch(r"column-wise, its output gathered: takes [\d.]+ µs per step \(collectives [\d.e-]+ µs, "
                        r"optimizer [\d.]+ µs\) against [\d.]+ µs whole", note), note
    on_slow = tpfn.suggest(wide, 2, example_inputs=(1, 8), machine=slow)
    assert "head" not in rules(on_slow) and "embed" not in rules(on_slow)
    whole, half = (fmt_seconds(slow.optimizer(4096 * 32 * 4 // k)) for k in (1, 2))  # Adam on its weight
    # its logits gathered (one ring step), its input's gradient all-reduced (two)
    assert notes(on_slow)["head"] == (f"left whole: its optimizer step takes {whole}, sharding it takes "
                                      f"3 s per step (collectives 3 s, optimizer {half})")
    # the pairs are not weighed: sharded on any links; and the header says which model decided
    assert rules(on_slow)["layers.*.up"] == "colwise()"
    assert "lone modules weighed in seconds per step on the given Machine" in comments(on_slow)
    assert "weighed in seconds" not in comments(tpfn.suggest(wide, 2, example_inputs=(1, 8)))
    assert eval(repr(on_slow), NAMESPACE) == on_slow


def test_sequence_parallelism_is_weighed_on_the_machines_links_of_each_kind():
    cheap = Link(0.0, 1e15)  # reduce-scatters and all-gathers that cost nothing: it would save time
    found = comments(tpfn.suggest(Toy(), 2, example_inputs=(2, 16), machine=_machine(
        1e-3, 1e9, all_gather=cheap, reduce_scatter=cheap)))
    # 4 exits of (2, 16, 32) floats: each all-reduce 2 ring steps and 4 KiB, each of its halves 2 KiB
    split, plain = fmt_seconds(8 * 2048 / 1e15), fmt_seconds(4 * (2 * 1e-3 + 4096 / 1e9))
    assert (f"sequence parallelism not used: on the given Machine its 8 collectives would take {split} per "
            f"step where the row-wise exits' 4 all-reduces take {plain} (would save time; suggest writes no "
            "sequence-parallel plan)") in found, found


def test_a_machine_without_the_links_suggest_weighs_is_named_before_anything_runs():
    partial = Machine(flops=1e11, bandwidth=2e10, op=5e-6, links=(("all_reduce", Link(1e-4, 1e9)),))
    with pytest.raises(ValueError, match=r"suggest weighs all_reduce, all_gather, reduce_scatter on 'machine', "
                                         r"which has no link figures for all_gather, reduce_scatter"):
        tpfn.suggest(Toy(), 2, example_inputs=(2, 16), machine=partial)
    with pytest.raises(TypeError, match=r"'machine' must be a tpfn.dryrun.cost.Machine"):
        tpfn.suggest(Toy(), 2, example_inputs=(2, 16), machine={"latency": 1.0})


def test_loss_parallel_leaves_the_logits_sharded_only_where_asked():
    p = tpfn.suggest(Toy(vocab=4096), 2, example_inputs=(1, 8), loss_parallel=True)
    assert rules(p)["head"] == "colwise(local=False)"
    assert rules(tpfn.suggest(Toy(vocab=4096), 2, example_inputs=(1, 8)))["head"] == (
        "colwise() >> prepare_out(Replicate())")


def test_a_module_without_example_inputs_names_them():
    with pytest.raises(TypeError, match=r"give example_inputs= as tpfn.explain takes them"):
        tpfn.suggest(Toy(), 2)
    with pytest.raises(TypeError, match=r"'world_size' must be a positive int"):
        tpfn.suggest(Toy(), 0, example_inputs=(2, 16))


class Masked(nn.Module):
    """Reads a value its inputs give (whether the mask is all ones), as transformers' masks do."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x, mask):
        if not bool(mask.all()):
            x = x * mask[..., None]
        return self.down(F.relu(self.up(x)))


def test_values_from_the_inputs_are_real_in_the_dry_runs_and_the_model_is_left_as_it_is():
    model = Masked()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = tpfn.suggest(model, 2, example_inputs={"x": torch.randn(2, 4, 8), "mask": torch.ones(2, 4)})
    assert rules(p) == {"up": "colwise()", "down": "rowwise()"}
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # noqa: SLF001


def test_the_plan_of_a_model_is_at_one_devices_numbers_on_two_ranks(ranks2):
    found = ranks2.run(_one_step)
    for errors, forward, backward in found:
        assert max(errors.values()) < TOL, {k: v for k, v in errors.items() if v >= TOL}
    # forward: the 4 pairs' exits, the embedding's gather; backward: the 4 shared replicas, and
    # the activations' partial slope gradients, summed at the end in one all-reduce
    assert found[0][1] == {"all_reduce": 4, "all_gather": 1} and found[0][2] == {"all_reduce": 5}
    # and the plan's header says so
    assert header(tpfn.suggest(Toy(kv_heads=2), 2, example_inputs=(2, 16)))[0] == {"all_gather": 1, "all_reduce": 9}


def _one_step():
    from tests.ranks import mesh

    ref = Toy(kv_heads=2)
    tp = tpfn.parallelize(copy.deepcopy(ref), mesh(2), tpfn.suggest(ref, 2, example_inputs=(2, 16)))
    x = torch.randint(0, 64, (2, 16))
    return one_step(_Floats(tp), _Floats(ref), x.float())


class _Floats(nn.Module):
    """A model taking its ids as floats (``one_step`` asks for an input gradient)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x.long()) + 0 * x.sum()


@given(st.integers(1, 3), st.integers(1, 5), st.sampled_from([1, 2, 4, 8]), st.integers(1, 4),
       st.sampled_from([2, 4]))
def test_heads_split_from_features_and_merged_back_hold_each_ranks_share(b, s, heads, d, n):
    dims = tag(plain((b, s, heads * d)), 2, 0)
    units: dict = {}
    split = view(dims, (b, s, heads * d), (b, s, heads, d), units)
    merged = view(split, (b, s, heads, d), (b, s, heads * d), units)
    if heads % n == 0:  # a rank holds its heads whole, split or merged back
        assert local_shape(split, n, units) == (b, s, heads // n, d)
        assert local_shape(merged, n, units) == (b, s, heads * d // n)


def test_dry_runs_keep_the_values_of_inputs_and_a_meta_value_written_into_one_is_unknown():
    from tpfn.analysis.hybrid import Hybrid

    weight = torch.empty(4, device="meta")
    with Hybrid():
        mask = torch.ones(2, 4, device=weight.device)           # made real: its values are known
        assert not mask.is_meta and bool(mask.all())
        filled = torch.zeros(2, 4)
        filled[0].copy_(weight)                                  # a weight's value written in
        assert (filled + 1).is_meta and not (mask + 1).is_meta   # ... is unknown from then on
        assert (mask * weight).is_meta


class _Experts(nn.Module):
    """Experts laid out as transformers' ``use_experts_implementation`` holds them."""

    def __init__(self, experts=4, hidden=16, features=32, gate=True, bias=False, transposed=False, norm=False):
        super().__init__()
        self.norm = nn.LayerNorm(hidden) if norm else None
        self.has_gate, self.has_bias, self.is_transposed = gate, bias, transposed
        up = (experts, hidden, (1 + gate) * features) if transposed else (experts, (1 + gate) * features, hidden)
        down = (experts, features, hidden) if transposed else (experts, hidden, features)
        setattr(self, "gate_up_proj" if gate else "up_proj", nn.Parameter(torch.randn(up)))
        self.down_proj = nn.Parameter(torch.randn(down))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        up = self.gate_up_proj if self.has_gate else self.up_proj
        for k in range(top_k_index.shape[-1]):
            w_up, w_down = up[top_k_index[:, k]], self.down_proj[top_k_index[:, k]]
            if not self.is_transposed:
                w_up, w_down = w_up.transpose(1, 2), w_down.transpose(1, 2)
            h = torch.bmm(hidden_states[:, None], w_up)[:, 0]
            if self.has_gate:
                gate, h = h.chunk(2, dim=-1)
                h = F.silu(gate) * h
            h = torch.bmm(h[:, None], w_down)[:, 0]
            out = out + top_k_weights[:, k, None] * (h if self.norm is None else self.norm(h))
        return out


class _MoE(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.experts = _Experts(**kwargs)

    def forward(self, x):
        weights, index = self.router(x).softmax(-1).topk(2, dim=-1)
        return self.experts(x, index, weights)


_LAYOUTS = [({}, "gate_up_proj=Shard(dim=1, parts=2)", "down_proj=Shard(dim=2)"),
            ({"transposed": True}, "gate_up_proj=Shard(dim=2, parts=2)", "down_proj=Shard(dim=1)"),
            ({"gate": False}, "up_proj=Shard(dim=1)", "down_proj=Shard(dim=2)")]


@pytest.mark.parametrize("kwargs, up, down", _LAYOUTS)
def test_fused_experts_hold_a_share_of_every_experts_features_at_one_devices_numbers(ranks2, kwargs, up, down):
    p = tpfn.suggest(_MoE(**kwargs), 2, example_inputs=torch.randn(6, 16))
    assert f"'experts': params({', '.join(sorted([up, down]))}) >> on_shards(Replicate(), None, Replicate(), " \
           "grads=Partial(), output=Partial()) >> prepare_out(Replicate())" in repr(p), repr(p)
    assert notes(p)["experts"] == "sharded on each expert's 32 features, its output all-reduced (transformers' " \
                                  "'moe_tp_experts')"
    found = ranks2.run(_moe_step, kwargs, p)
    for errors, forward, backward in found:
        assert max(errors.values()) < TOL, {k: v for k, v in errors.items() if v >= TOL}
    # forward: the experts' output; backward: the gradients of the tokens and of the routing weights
    assert found[0][1] == {"all_reduce": 1} and found[0][2] == {"all_reduce": 2}


def _moe_step(kwargs, p):
    from tests.ranks import mesh

    torch.manual_seed(0)
    ref = _MoE(**kwargs)
    tp = tpfn.parallelize(copy.deepcopy(ref), mesh(2), p)
    return one_step(tp, ref, torch.randn(6, 16))


@pytest.mark.parametrize("kwargs, why", [
    ({"bias": True}, "its experts have biases, which a sum over the ranks would count once per rank"),
    ({"features": 3}, "its 3 features per expert do not split over 2 ranks"),
    ({"norm": True}, "its forward runs 'norm' (LayerNorm), which may compute on each expert's output, a partial "
                     "sum while the features are sharded"),
    ({"tied": True}, "its down_proj is tied to 'shared.down_proj', which stays whole")])
def test_experts_that_cannot_be_sharded_stay_whole_with_the_reason(kwargs, why):
    model = _MoE(**{k: v for k, v in kwargs.items() if k != "tied"})
    if kwargs.get("tied"):  # tied to experts that stay whole (their biases)
        model.shared = _Experts(bias=True)
        model.shared.down_proj = model.experts.down_proj
    with warnings.catch_warnings():   # (its dry runs of the empty plan say nothing of parallelize's)
        warnings.simplefilter("error")
        p = tpfn.suggest(model, 2, example_inputs=torch.randn(6, 16))
    assert not dict(p.rules) and notes(p)["experts"] == f"left whole: {why}"
    assert "0 groups sharded, 0% of the parameter bytes" in comments(p)


def test_experts_whose_weights_are_held_as_other_weights_stay_whole():
    crossed = _MoE(gate=False, features=16)  # one's up projection is the other's down projection
    crossed.other = _Experts(gate=False, features=16)
    crossed.other.down_proj = crossed.experts.up_proj
    aliased = _MoE()  # one weight under two names of the module
    aliased.experts.register_parameter("alias", aliased.experts.down_proj)
    for model, why in ((crossed, "its up_proj is tied to 'other.down_proj', which is sharded otherwise"),
                       (aliased, "its down_proj is tied to 'experts.alias', another of its weights")):
        p = tpfn.suggest(model, 2, example_inputs=torch.randn(6, 16))
        assert not dict(p.rules) and notes(p)["experts"] == f"left whole: {why}"


class _TiedMoE(nn.Module):
    """Two mixture layers whose experts share their weights (an encoder's and a decoder's)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = _MoE(), _MoE()
        self.second.experts.gate_up_proj = self.first.experts.gate_up_proj
        self.second.experts.down_proj = self.first.experts.down_proj

    def forward(self, x):
        x = x + self.first(x)
        return x + self.second(x)


def _tied_moe_step(p):
    from tests.ranks import mesh

    torch.manual_seed(0)
    ref = _TiedMoE()
    tp = tpfn.parallelize(copy.deepcopy(ref), mesh(2), p)
    return one_step(tp, ref, torch.randn(6, 16))


def test_experts_tied_to_experts_sharded_alike_are_sharded_at_one_devices_numbers(ranks2):
    torch.manual_seed(0)
    p = tpfn.suggest(_TiedMoE(), 2, example_inputs=torch.randn(6, 16))
    rules = dict(p.rules)
    assert rules["first.experts"] == rules["second.experts"] and "gate_up_proj=Shard(dim=1, parts=2)" in repr(
        rules["first.experts"]), repr(p)
    for errors, forward, backward in ranks2.run(_tied_moe_step, p):
        assert max(errors.values()) < TOL, {k: v for k, v in errors.items() if v >= TOL}


class ScaledByLocalWidth(nn.Module):
    """Reads a scale from its hidden features' width: on a rank's shard, the local one."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.down(h * h.shape[-1] ** -0.5)


def test_a_scale_read_from_a_local_width_leaves_its_pair_whole():
    found = tpfn.suggest(ScaledByLocalWidth(), 2, example_inputs=torch.randn(4, 16))
    rules = dict(found.rules)
    assert rules.get("up") != colwise() and rules.get("down") != rowwise()   # not the pair
    assert "takes other=0.1767766952966369 on a rank where one device takes 0.125" in \
        dict(found.notes)[""]


def test_a_lone_projection_of_heads_the_ranks_do_not_split_is_not_sharded_on_them():
    # timm's vit_tiny: 3 heads of 64 features on 2 ranks; its qkv and proj are no pair (unbind)
    p = tpfn.suggest(shaped.TimmViT(), 2, example_inputs=shaped.example("timm_vit_tiny"))
    assert rules(p)["blocks.*.mlp.fc1"] == "colwise()"
    assert not any(v.startswith("colwise") for k, v in rules(p).items() if ".attn." in k), rules(p)


def test_a_refused_plan_names_the_modules_it_refuses_in_the_ranks_check():
    from tpfn.analysis.hybrid import hybrid_copy
    from tpfn.analysis.replay import replay
    from tpfn.analysis.trace import follow

    model, x = hybrid_copy(shaped.TimmViT(depth=1)), shaped.example("timm_vit_tiny")
    gathered = plan({"blocks.0.attn.qkv": colwise() >> tpfn.prepare_out(tpfn.Replicate())})
    failed = replay(model, gathered, 2, (x,), {}, follow(model, (x,), {}))[0]
    assert list(failed) == ["blocks.0.attn.qkv"]
    assert "'qkv' of 'blocks.0.attn' (TimmAttention) projects 9 heads of 64 features: the 2 ranks do not " \
        "divide them" in failed["blocks.0.attn.qkv"].why


def test_sparse_routing_on_meta_scores_sends_every_expert_each_token_it_may_reach():
    p = tpfn.suggest(shaped.MoEBlock(), 2, example_inputs=shaped.example("sparse_moe"))
    assert rules(p)["moe.experts.*.fc1"] == "colwise()" and rules(p)["moe.experts.*.fc2"] == "rowwise()"


class TwoTowers(nn.Module):
    """CLIP's shape: a text tower and a vision tower whose input has a default of None."""

    def __init__(self):
        super().__init__()
        self.text, self.vision = nn.Embedding(16, 8), nn.Linear(12, 8)

    def forward(self, ids, pixels=None):
        return self.text(ids).mean(1) @ self.vision(pixels.flatten(1)).T


def test_an_input_the_forward_needs_that_was_not_given_is_named_as_missing():
    with pytest.raises(RuntimeError, match=r"fails in '<root>': AttributeError: 'NoneType' object has no "
                                           r"attribute 'flatten' \(the model was given None for 'pixels': an "
                                           r"input the forward needs is missing"):
        tpfn.suggest(TwoTowers(), 2, example_inputs=(2, 4))


def test_models_spelled_as_their_libraries_are_at_one_devices_numbers(ranks2):
    for name, errors in ranks2.run(_shaped_steps)[0].items():
        assert max(errors.values()) < TOL, (name, {k: v for k, v in errors.items() if v >= TOL})


def _shaped_steps():
    from tests.models import rel_err
    from tests.ranks import mesh
    from tpfn.interpret.layouts import full_value, layouts

    found = {}
    for name, (build, _) in shaped.MODELS.items():
        ref, x = build(), shaped.example(name)
        tp = tpfn.parallelize(copy.deepcopy(ref), mesh(2), tpfn.suggest(ref, 2, example_inputs=x))
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, out = ref(x1), tp(x2)   # (no CommDebugMode: its module hooks refuse ResNet's in-place ReLU)
        expected.sum().backward()
        out.sum().backward()
        placed, theirs = layouts(tp), dict(ref.named_parameters())
        found[name] = {"output": rel_err(out, expected), "input.grad": rel_err(x2.grad, x1.grad)}
        for k, p in tp.named_parameters():
            found[name][k + ".grad"] = rel_err(full_value(p.grad, placed.get(k)), theirs[k].grad)
    return found


def header(p) -> tuple:
    """The header's collectives per step by kind, and its bytes per rank."""
    found = re.search(r"per step (.*?), ([\d.]+ \w+) per rank", comments(p))
    return {kind: int(k) for k, kind in (x.split(" ") for x in found.group(1).split(", "))}, found.group(2)


def explained(model, p, inputs) -> tuple:
    from tpfn.dryrun.units import fmt_bytes

    report = tpfn.explain(model, p, world_size=2, example_inputs=inputs)
    return report.collectives, fmt_bytes(report.bytes)


def test_a_stack_of_equal_blocks_is_checked_as_two_and_its_plan_said_of_every_block():
    from tpfn.analysis.hybrid import hybrid_copy
    from tpfn.analysis.repeats import distinct

    deep = Toy(kv_heads=2, layers=6)
    small, repeats = distinct(hybrid_copy(deep))
    assert len(small.layers) == 2 and repeats.expand("layers.1.up") == [f"layers.{i}.up" for i in range(1, 6)]
    p = tpfn.suggest(deep, 2, example_inputs=(2, 16))
    assert p.rules == tpfn.suggest(Toy(kv_heads=2), 2, example_inputs=(2, 16)).rules
    assert "12 groups sharded" in comments(p)
    # every block's collectives, and the slopes' partial gradients summed at the end, as explain counts them
    assert header(p) == explained(deep, p, (2, 16))


def test_blocks_whose_pair_spans_two_of_them_are_each_analysed():
    stack = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)])
    p = tpfn.suggest(stack, 2, example_inputs=torch.randn(4, 8))
    assert rules(p) == {"0.0": "colwise()", "1.0": "rowwise()", "2.0": "colwise()", "3.0": "rowwise()"}


def _t5():
    import transformers as hf

    torch.manual_seed(0)
    config = hf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4, vocab_size=64,
                         decoder_start_token_id=0, pad_token_id=0)
    return hf.T5ForConditionalGeneration(config).eval(), {"input_ids": (1, 16), "decoder_input_ids": (1, 16)}


@pytest.mark.parametrize("build", [
    lambda: (Toy(kv_heads=2, layers=3, tie=True), (2, 16)),
    lambda: (shaped.MODELS["timm_vit_tiny"][0](), shaped.example("timm_vit_tiny")),
    lambda: (shaped.MODELS["sparse_moe"][0](), shaped.example("sparse_moe")),
    _t5,
], ids=["toy", "timm_vit_tiny", "sparse_moe", "t5"])
def test_the_header_counts_what_explain_counts_for_the_plan(build):
    model, inputs = build()
    p = tpfn.suggest(model, 2, example_inputs=inputs)
    assert header(p) == explained(model, p, inputs)


def test_an_nn_sequential_of_blocks_is_planned_with_one_pattern_per_module_of_a_block():
    blocks = nn.Sequential(*[shaped.TimmBlock(32, 4) for _ in range(4)])
    p = tpfn.suggest(blocks, 2, example_inputs=torch.randn(2, 5, 32))
    assert rules(p)["*.mlp.fc1"] == "colwise()" and rules(p)["*.mlp.fc2"] == "rowwise()"
    assert not any(k[0].isdigit() for k in rules(p)), rules(p)


def test_notes_name_the_children_of_an_nn_sequential_by_their_names_not_a_bare_index():
    inner = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    p = tpfn.suggest(nn.Sequential(nn.Linear(16, 16), inner), 2, example_inputs=torch.randn(4, 16))
    assert "over 2 ranks: *.1 (64 features) column-wise; *.3 row-wise, one all-reduce" in comments(p)


def test_an_nn_multihead_attention_is_sharded_on_its_heads_whole():
    p = tpfn.suggest(shaped.TorchTransformer(), 2, example_inputs=shaped.example("nn_transformer"))
    assert {k: v for k, v in rules(p).items() if "attn" in k} == {
        "transformer.decoder.layers.*.multihead_attn": "colwise()", "transformer.decoder.layers.*.self_attn": "colwise()",
        "transformer.encoder.layers.*.self_attn": "colwise()"}
    assert rules(p)["transformer.encoder.layers.*.linear1"] == "colwise()"
    assert "its 4 heads column-wise, out_proj row-wise, one all-reduce" in comments(p)
    three = nn.TransformerEncoder(nn.TransformerEncoderLayer(24, 3, 48, batch_first=True), 2)
    found = comments(tpfn.suggest(three, 2, example_inputs=torch.randn(2, 4, 24)))   # in training
    assert "'layers.*.self_attn': left whole: its 3 heads do not split evenly over 2 ranks" in found
    # a dropout between linear1 and linear2 draws on a shard: no pair, and the rest is returned
    assert "'layers.*': no pair, linear1, linear2: bernoulli draws random numbers on a shard" in found


def test_an_attention_reading_its_width_from_its_input_is_left_whole_naming_the_line():
    p = tpfn.suggest(shaped.NanoGPT(), 2, example_inputs=shaped.example("nanogpt"))   # B, T, C = x.size()
    assert re.search(r"'transformer.h.\*.attn': no pair, c_attn, c_proj: on a rank's shard the forward of "
                     r"'transformer.h.\*.attn' fails at tests/shaped.py:\d+, `k = k.view\(B, T, self.n_head, "
                     r"C // self.n_head\).transpose\(1, 2\)`", comments(p)), comments(p)
    assert rules(p)["transformer.h.*.mlp.c_fc"] == "colwise()"


@pytest.mark.parametrize("name, fqn, why", [
    ("convnext", "stages.*.dwconv", "left whole (7% of the parameter bytes): a grouped convolution (Conv2d, "
                                    "groups=32) computes on its channels as they come"),
    ("lstm", "lstm", "left whole (94% of the parameter bytes): a recurrent layer (LSTM): each step needs the whole "
                     "hidden state of the step before"),
    ("swin", "layers.*.attn.qkv", "left whole (12% of the parameter bytes): its parameters (weight, bias) are read "
                                  "by ops directly, not through a linear"),
])
def test_a_module_suggest_does_not_shard_says_why(name, fqn, why):
    build, _ = shaped.MODELS[name]
    p = tpfn.suggest(build(), 2, example_inputs=shaped.example(name))
    assert notes(p)[fqn].startswith(why), notes(p)


# Convolutions: a convolution from a replicated input makes its output channels a space, one handed
# them contracts it; norms and depthwise convolutions between carry them.

def _conv_blocks():
    """Suggest's plans for a ResNet BasicBlock and a MobileNetV2 block in training (BatchNorms on
    batch statistics, running statistics updated) against one device in float64."""
    from tests.models import full, rel_err
    from tests.ranks import mesh

    found = {}
    for name, build, shape in (("basic", lambda: shaped.BasicBlock(8), (2, 8, 6, 6)),
                               ("inverted", lambda: shaped.InvertedResidual(4), (2, 4, 6, 6))):
        torch.manual_seed(0)
        ref = build().double().train()
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        p = tpfn.suggest(ref, 2, example_inputs=x)
        tp, again = tpfn.parallelize(copy.deepcopy(ref), mesh(2), p), copy.deepcopy(ref)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        cot = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        expected, out = ref(x1), tp(x2)
        (expected * cot).sum().backward()
        (out * cot).sum().backward()
        (again(x.flip(0)) * cot.flip(0)).sum().backward()  # one device again, its sums in another order
        errors = {"output": rel_err(out, expected), "input.grad": rel_err(x2.grad, x1.grad)}
        own = dict.fromkeys(errors, 0.0)
        theirs, others = ({**dict(m.named_parameters()), **dict(m.named_buffers())} for m in (ref, again))
        for k, t in tp.named_parameters():
            errors[k + ".grad"] = rel_err(t.grad, theirs[k].grad)
            own[k + ".grad"] = rel_err(others[k].grad, theirs[k].grad)
        for k, t in tp.named_buffers():
            errors[k] = rel_err(full(t).double(), theirs[k].double())
        found[name] = (rules(p), errors, own)
    return found


def test_suggest_shards_convolutions_as_pairs_with_their_norms_between_at_one_devices_numbers(ranks2):
    basic, inverted = ranks2.run(_conv_blocks)[0].values()
    assert max(inverted[2].values()) > 1e-12  # (the deviation the bound below allows for is real)
    # ResNet's BasicBlock: conv1 column-wise, bn1 on its channels, conv2 row-wise; bn2 runs whole
    # after the all-reduce, before the residual sum
    assert basic[0] == {"conv1": "colwise()", "bn1": "colwise()", "conv2": "rowwise()"}
    # MobileNetV2's: the expansion column-wise, the depthwise convolution and the norms on each
    # rank's channels, the projection row-wise
    assert inverted[0] == {"conv.0": "colwise()", "conv.1": "colwise()", "conv.3": "colwise()",
                           "conv.4": "colwise()", "conv.6": "rowwise()"}
    # float64: rounding ~1e-16, sums in another order; a BatchNorm weight's gradient sums terms that
    # cancel (its normalized input has mean 0), and one device's own gradient moves ~1e-11 when the
    # batch comes in reverse order: each error within ten times that deviation
    for _, errors, own in (basic, inverted):
        bad = {k: (v, own.get(k)) for k, v in errors.items() if v > max(1e-12, 10 * own.get(k, 0.0))}
        assert not bad, bad


def test_a_convolution_pair_s_header_and_notes():
    block, x = shaped.BasicBlock(16).eval(), torch.randn(2, 16, 8, 8)
    p = tpfn.suggest(block, 2, example_inputs=x)
    assert "over 2 ranks: conv1 (16 channels) column-wise; bn1 on each rank's channels; conv2 row-wise, " \
           "one all-reduce" in comments(p)
    assert header(p) == explained(block, p, x)
    # a depthwise convolution whose groups the ranks do not split: the pair stays whole, and says why
    odd = tpfn.suggest(shaped.InvertedResidual(3, expand=2).eval(), 4, example_inputs=torch.randn(2, 3, 6, 6))
    assert "'conv': left whole, conv.0, conv.6: 4 ranks do not split 'conv.*''s 6 groups of channels into " \
           "whole groups" in comments(odd), comments(odd)


def test_pooling_resampling_and_padding_carry_the_channels():
    class Pools(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
            self.c, self.d = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 4, 3)

        def forward(self, x):
            h = self.b(F.max_pool2d(F.relu(self.a(x)), 2))
            h = F.interpolate(h, scale_factor=2)
            return self.d(F.avg_pool2d(F.pad(F.relu(self.c(h)), (1, 1, 1, 1), mode="reflect"), 2))

    p = tpfn.suggest(Pools(), 2, example_inputs=torch.randn(2, 3, 8, 8))
    assert rules(p) == {"a": "colwise()", "b": "rowwise()", "c": "colwise()", "d": "rowwise()"}
    # unbatched, a convolution's channels are dim 0, where a plan on channels refuses them: whole
    convs = nn.Sequential(nn.Conv1d(4, 8, 3), nn.ReLU(), nn.Conv1d(8, 4, 3))
    assert rules(tpfn.suggest(convs, 2, example_inputs=torch.randn(1, 4, 10))) == {"0": "colwise()", "2": "rowwise()"}
    assert rules(tpfn.suggest(convs, 2, example_inputs=torch.randn(4, 10))) == {}
