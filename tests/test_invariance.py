"""Invariant mode: ``parallelize(..., invariant=True)`` gives the same bits at every degree.

Each case trains a tiny model 3 AdamW steps at TP=1, 2 and 4 on the same 4 gloo ranks (a 1-rank,
a 2-rank and the 4-rank mesh) and compares with ``torch.equal``: the output and every gradient of
the first step, each step's loss and gradient norm (``clip_grad_norm_(..., invariant=True)``),
every parameter after the third. Without ``invariant`` the same runs differ (the test has teeth).
What invariant mode cannot order is refused by name, before anything changes.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

import tpfn
from tests.models import local_heads, rel_err, transformer, transformer_plan
from tests.ranks import mesh
from tpfn import (Partial, PlanError, Replicate, Shard, colwise, on_shards, params, prepare_in,
                  prepare_out, rowwise, sequence_parallel)
from tpfn.dryrun import fake_mesh
from tpfn.errors import ModuleError
from tpfn.tree import CHUNKS, chunks_of, fits, leaves, total


def test_the_canonical_tree_adds_alike_on_one_rank_and_on_eight():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(64, generator=gen) * 10 ** i for i in range(8)]  # the order matters for these
    whole = total(parts)
    for n in (2, 4, 8):
        roots = [total(parts[i] for i in leaves(8, n, r)) for r in range(n)]
        assert torch.equal(total(roots), whole)
    assert not torch.equal(sum(parts), whole)                       # another order, other bits
    assert [list(leaves(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert (chunks_of(True), chunks_of(False), chunks_of(16)) == (CHUNKS, None, 16)
    assert fits(3, 8) == "invariant mode needs a power of two of ranks, at most its 8 chunks, not 3"
    with pytest.raises(ValueError, match="'invariant' must be True, False or a number of chunks, a power of two"):
        chunks_of(12)


@given(st.integers(0, 4), st.integers(0, 4), st.integers(1, 5), st.integers(0, 2 ** 16), st.data())
def test_every_split_into_whole_subtrees_adds_the_same_bits(log_chunks, log_n, width, seed, data):
    """The tree's law: any power of two of ranks, each adding its own leaves first, then the ranks'
    roots by the tree, gives the bits of one rank adding every leaf; and the parts are left as
    they were."""
    chunks, n = 2 ** log_chunks, 2 ** min(log_n, log_chunks)
    gen = torch.Generator().manual_seed(seed)
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    parts = [(torch.randn(width, generator=gen) * 10.0 ** torch.randint(-6, 7, (), generator=gen)).to(dtype)
             for _ in range(chunks)]
    kept = [p.clone() for p in parts]
    whole = total(parts)
    assert torch.equal(total([total(parts[i] for i in leaves(chunks, n, r)) for r in range(n)]), whole)
    assert all(torch.equal(a, b) for a, b in zip(parts, kept))
    assert sorted(i for r in range(n) for i in leaves(chunks, n, r)) == list(range(chunks))


# -- the models ----------------------------------------------------------------------------

def _reference(sp: bool, loss_parallel: bool = True, observed: bool = False):
    """PyTorch's reference Transformer (2 layers, dim 32, 4 heads, vocab 32), its logits kept
    sharded for tpfn.cross_entropy (loss parallel, label smoothing) or gathered."""
    def make(tp):
        model = local_heads(transformer(vocab_size=32, dim=32, n_heads=4, n_layers=2, max_seq_len=16), tp)
        plan = tpfn.plan(transformer_plan(sp))
        if loss_parallel:
            head = colwise(local=False)
            plan = plan.override({"output": prepare_in(Shard(1)) >> head if sp else head})
        gen = torch.Generator().manual_seed(1)
        ids, target = torch.randint(0, 32, (2, 16), generator=gen), torch.randint(0, 32, (32,), generator=gen)

        def loss(logits):
            if loss_parallel:
                return tpfn.cross_entropy(logits.flatten(0, 1), target, label_smoothing=0.1, invariant=True)
            return F.cross_entropy(logits.flatten(0, 1), target)
        if observed:  # a user's hook on q's input, a frozen linear, activation checkpointing
            model.layers[0].attention.wq.register_forward_pre_hook(lambda m, args: args[0].retain_grad())
            model.layers[1].feed_forward.w1.requires_grad_(False)
            for layer in model.layers:
                layer.forward = functools.partial(_checkpointed, layer)
        return model, plan, (ids,), loss
    return make


def _checkpointed(layer, *args):
    return torch.utils.checkpoint.checkpoint(type(layer).forward, layer, *args, use_reentrant=False)


def _llama_sp_plan() -> dict:
    """Llama with sequence parallelism: the residual stream and the norms on slices of the
    sequence (docs/recipes.md)."""
    layer = "model.layers.*."
    return {
        "model.embed_tokens": rowwise() >> prepare_out(Partial()),
        "model.layers.0": prepare_in(Partial(), desired=Shard(1), local=True),
        layer + "input_layernorm": sequence_parallel(local=True),
        layer + "post_attention_layernorm": sequence_parallel(local=True),
        layer + "self_attn": prepare_in(kwargs={"hidden_states": (Shard(1), Replicate())}, local=True),
        layer + "self_attn.[qkv]_proj": colwise(),
        layer + "self_attn.o_proj": rowwise() >> prepare_out(Shard(1)),
        layer + "mlp": prepare_in(Shard(1), desired=Replicate(), local=True),
        layer + "mlp.[gu]*_proj": colwise(),
        layer + "mlp.down_proj": rowwise() >> prepare_out(Shard(1)),
        "model.norm": sequence_parallel(local=True),
        "lm_head": prepare_in(Shard(1)) >> colwise() >> prepare_out(Replicate()),
    }


def _llama(sp: bool):
    """transformers' Llama (sdpa; 8 query heads, 4 KV heads: one a rank at TP=4; a padded
    batch), with its own plan (tpfn.from_hf) or the sequence-parallel one."""
    def make(tp):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=4, initializer_range=0.1,
                             use_cache=False, attn_implementation="sdpa")
        model = LlamaForCausalLM(config)
        plan = _llama_sp_plan() if sp else tpfn.from_hf(model.tp_plan, model)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, :3] = 0
        return model, plan, (ids, mask), lambda out: F.cross_entropy(out.logits.flatten(0, 1), ids.flatten())
    return make


def _gqa(tp):
    """2 KV heads replicated over 2 ranks each at TP=4 (tests/test_kv_heads.py's GQA, which repeats
    them right after projecting them)."""
    from tests.test_kv_heads import GQA, PLAN

    torch.manual_seed(0)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    return GQA(), {**PLAN, "": prepare_in(Replicate(), local=True)}, (x,), lambda y: y.pow(2).mean()


CASES = {"reference": _reference(False), "reference, sp": _reference(True), "llama": _llama(False),
         "llama, sp": _llama(True), "kv heads replicated": _gqa,
         "observed": _reference(False, loss_parallel=False, observed=True),
         "reference, sp, two backwards a step": _reference(True)}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(name: str, invariant: bool = True) -> dict:
    """``{degree: [what differs from TP=1]}`` after 3 AdamW steps of case ``name`` at TP=1, 2, 4."""
    meshes = {1: mesh(4, 1, names=("dp", "tp"))["tp"], 2: mesh(2, 2, names=("dp", "tp"))["tp"], 4: mesh(4)}
    found = {}
    for tp, m in meshes.items():
        model, plan, inputs, loss_of = CASES[name](tp)
        one = copy.deepcopy(model) if tp == 1 else None
        tpfn.parallelize(model, m, plan, invariant=invariant)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        seen = {}
        for step in range(3):
            opt.zero_grad()
            for _ in range(2 if "two backwards" in name else 1):  # gradients accumulated onto summed ones
                out = model(*inputs)
                loss = loss_of(out)
                loss.backward()
            if step == 0:
                seen["output"] = _full(getattr(out, "logits", out)).detach().clone()
                seen.update({f"{n}.grad": _full(p.grad).clone() for n, p in model.named_parameters() if p.requires_grad})
            seen[f"loss {step}"] = loss.detach().clone()
            seen[f"norm {step}"] = tpfn.clip_grad_norm_(model.parameters(), 0.5, invariant=invariant)
            opt.step()
        seen.update({n: _full(p).detach().clone() for n, p in model.named_parameters()})
        if one is not None:  # the canonical order is one device's numbers up to rounding
            expected = one(*inputs)
            seen["against one device"] = rel_err(seen["output"], getattr(expected, "logits", expected)) < 1e-5
        found[tp] = seen
    assert found[1].pop("against one device")
    return {tp: [k for k in found[1] if not torch.equal(found[1][k], found[tp][k])] for tp in (2, 4)}


@pytest.mark.parametrize("name", list(CASES))
def test_the_same_bits_at_tp_1_2_and_4(ranks4, name):
    results = ranks4.run(_train, name)
    assert results == [{2: [], 4: []}] * 4


def test_without_invariant_the_degrees_differ(ranks4):
    differ = ranks4.run(_train, "reference, sp", False)[0]
    assert "output" in differ[2] and "output" in differ[4] and "layers.0.ffn_norm.weight.grad" in differ[4]


# -- what it refuses ------------------------------------------------------------------------

class _Own(nn.Linear):
    def forward(self, x):  # its own forward: computed on DTensors
        return super().forward(x)


def _refused(model, plan, n: int = 2, **kw) -> list:
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(model, fake_mesh(n), plan, src_rank=None, **kw)
    return e.value.problems


def test_what_invariant_mode_cannot_order_is_refused_by_name():
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    assert _refused(nn.Sequential(mha), {"0": colwise()}, invariant=True) == [
        "colwise() at '0' (MultiheadAttention): invariant mode cannot order the sums of its own forward (its "
        "input's gradient is a partial sum); it orders those of nn.Linear (colwise(), rowwise()), nn.Embedding "
        "and sequence-parallel modules: leave this one out of the plan (whole on every rank), or run without "
        "invariant=."]
    mine = params(weight=Shard(1)) >> on_shards(Shard(-1), output=Partial()) >> prepare_out(Replicate())
    assert "its output is a partial sum" in _refused(nn.Linear(8, 8), mine, invariant=True)[0]
    assert _refused(nn.Sequential(_Own(8, 16)), {"0": colwise()}, invariant=True) == [
        "colwise() at '0' (_Own): invariant mode orders the sums of modules that compute on local shards, and "
        "this one computes on DTensors (its forward is not its kind's own), whose sums DTensor orders; leave it "
        "out of the plan, or give it its kind's forward."]
    assert _refused(nn.Linear(8, 12), colwise(), invariant=True) == [
        "colwise() at '<root>' (Linear): invariant mode cuts the output features of a linear into 8 equal chunks, "
        "one product each, and 12 do not split so; choose invariant= a power of two that divides 12, or leave "
        "it out of the plan."]
    assert "a packed one (parts=2) is not cut so" in _refused(nn.Linear(8, 16), colwise(parts=2), invariant=True)[0]
    assert _refused(nn.Linear(8, 16), colwise(), n=3, invariant=True) == [
        "invariant mode needs a power of two of ranks, at most its 8 chunks, not 3: parallelize over 1, 2, 4, "
        "... 8 ranks, or give invariant= a power of two at least 3 (the number of chunks)."]
    assert "over the 4 ranks that replicate it" in _refused(nn.Linear(8, 16), colwise(heads=2), n=8,
                                                             invariant=True)[0]
    with pytest.raises(ValueError, match="kernels=False runs none; leave kernels at True"):
        tpfn.parallelize(nn.Linear(8, 16), fake_mesh(2), colwise(), invariant=True, kernels=False)
    tpfn.parallelize(nn.Linear(8, 16), fake_mesh(2), colwise(), src_rank=None)  # all fine without it


def _runtime_errors():
    m = mesh(2)
    torch.manual_seed(0)
    out = []
    norm = tpfn.parallelize(nn.LayerNorm(8), m, sequence_parallel(local=True), invariant=True)
    try:
        norm(torch.randn(2, 6, 8))  # 12 positions: not 8 equal chunks
    except Exception as e:  # noqa: BLE001
        out.append(f"{type(e).__name__}: {e}")
    lin = tpfn.parallelize(nn.Sequential(nn.Linear(8, 16)), m, {"": prepare_in(Replicate()), "0": colwise()},
                           invariant=True)
    try:
        lin(torch.randn(2, 8))  # a DTensor reaches the linear
    except ModuleError as e:
        out.append(str(e))
    return out


def test_what_it_cannot_order_at_run_time_raises_on_every_rank(ranks2):
    for found in ranks2.run(_runtime_errors):
        assert found == [
            "LayoutError: input 0 of '<root>' (LayerNorm): invariant mode cuts the sequence into 8 equal chunks and "
            "adds its parameters' gradients over them in one tree, and its 12 positions in dim 1 do not split "
            "so; pad the sequence to a multiple of 8.",
            "'0' (Linear): invariant mode computes this linear by its kernel, in the canonical order, which takes "
            "a local tensor, and got a DTensor, whose gradient DTensor would sum; hand it a local tensor "
            "(local=True on the style that makes it: prepare_in(..., local=True))."]


def test_replicated_kv_heads_are_named_for_what_the_model_must_do():
    from tests.test_kv_heads import GQA, PLAN

    with pytest.warns(UserWarning) as seen:
        tpfn.parallelize(GQA(), fake_mesh(4), PLAN, src_rank=None, invariant=True)
    assert [str(w.message) for w in seen] == [
        "invariant mode: 'k_proj', 'v_proj' replicate key and value heads over 2 ranks each, and tpfn sums a "
        "head's gradient over them at the projection's output, which gives one rank's bits only where the model "
        "repeats the heads right after projecting them (values; keys with no rotary embedding between); use at "
        "most 2 ranks for one rank's bits in every model (docs/invariance.md)."]


# -- verify(..., exact=True): bits against one rank ------------------------------------------

class _Broadcast(nn.Module):
    """Grouped-query attention that repeats its KV heads as transformers' eager attention does:
    on a rank that holds one KV head, a broadcast view, which matmul multiplies by another route."""

    def __init__(self, dim=32, heads=4, kv=2, d=8):
        super().__init__()
        self.d = d
        self.q, self.k, self.v = nn.Linear(dim, heads * d), nn.Linear(dim, kv * d), nn.Linear(dim, kv * d)
        self.o = nn.Linear(heads * d, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).unflatten(-1, (-1, self.d)).transpose(1, 2) for p in (self.q, self.k, self.v))
        rep = q.shape[1] // k.shape[1]
        k, v = (t[:, :, None].expand(b, t.shape[1], rep, s, self.d).reshape(b, -1, s, self.d) for t in (k, v))
        att = torch.softmax(q @ k.transpose(2, 3) / self.d ** 0.5, -1)
        return self.o((att @ v).transpose(1, 2).flatten(2))


def test_verify_exact_compares_bits_with_one_rank_and_names_the_first_module_that_differs():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    plan = {"0": sequence_parallel(local=True), "1": prepare_in(Shard(1)) >> colwise(),
            "3": rowwise() >> prepare_out(Shard(1)), "": prepare_in(Shard(1), local=True)}
    report = tpfn.verify(mlp, plan, (2, 16, 32), dtype=torch.float32, world_size=2, exact=True, progress=False)
    assert report.ok and report.exact and report.tolerance == 0
    assert all(c.output in (None, 0) and all(e == 0 for _, e in c.grads) for c in report.checks)
    assert report.text().startswith("tpfn.verify on 2 ranks against one rank in invariant mode, bit for bit")

    attention = {"": prepare_in(Replicate(), local=True), "[qkv]": colwise(), "o": rowwise()}
    assert tpfn.verify(_Broadcast(), attention, (2, 16, 32), dtype=torch.float32, progress=False).ok  # rounding
    found = tpfn.verify(_Broadcast(), attention, (2, 16, 32), dtype=torch.float32, exact=True, progress=False)
    assert not found.ok and found.culprit == "q"
    assert found.hint.startswith(
        "'q' (Linear) (colwise()) is the last module, in execution order, whose parameter gradients' bits "
        "differ from one rank's")


# -- explain: invariant mode's collectives and bytes, and whether a plan has it ---------------

def test_explain_counts_invariant_mode_and_says_what_keeps_a_plan_from_it():
    def report(n, sp, **kw):
        model = local_heads(transformer(vocab_size=32, dim=32, n_heads=4, n_layers=2, max_seq_len=16), n)
        return tpfn.explain(model, transformer_plan(sp), world_size=n, example_inputs=(2, 16), **kw)

    for sp, summed in ((False, {"all_reduce"}), (True, {"reduce_scatter", "all_reduce"})):
        default, invariant = report(2, sp), report(2, sp, invariant=True)
        assert default.invariance == () and default.chunks is None and invariant.chunks == 8
        assert summed <= set(default.collectives) and not summed & set(invariant.collectives)
        assert invariant.bytes == default.bytes                        # on 2 ranks: the same bytes
        assert report(4, sp, invariant=True).bytes > report(4, sp).bytes  # on 4: all-gathers of partial sums
    assert invariant.collectives == {"all_gather": 13, "all_to_all": 11}
    assert "invariant mode: 8 chunks: the same bits on 1, 2, 4, 8 ranks" in invariant.text()
    assert "invariant mode" not in default.text()
    mha = tpfn.explain(nn.Sequential(nn.MultiheadAttention(16, 4)), {"0": colwise()}, world_size=2)
    assert mha.invariance[0].startswith("colwise() at '0' (MultiheadAttention): invariant mode cannot order")
    assert mha.to_dict()["invariance"] == list(mha.invariance)
