"""Unequal packed parts: a GQA ``qkv_proj`` (q wider than k and v) with ``colwise(parts=(q, k, v))``."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import tpfn
from tests.models import clone, one_step, rel_err
from tests.ranks import mesh
from tpfn import PlanError, Replicate, Shard, checkpoint, colwise, prepare_in, prepare_out, rowwise
from tpfn.dryrun import fake_mesh
from tpfn.interpret.layouts import full_value, layouts

# The reference runs in float64, whose rounding (~1e-16 relative) bounds what reordering the
# sums over two ranks can change; 1e-12 leaves four orders of magnitude for the sums' length.
TOL = 1e-12


class FusedGQA(nn.Module):
    """Attention with q, k and v fused in one ``qkv_proj`` of unequal parts (Phi-3's packing):
    4 query heads, 2 KV heads of 8 features. It computes on the heads it is handed: their
    number comes from the local width, and query heads per KV head from the local shapes."""

    def __init__(self, dim=32, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_proj = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x):
        qkv = self.qkv_proj(x)
        unit = qkv.shape[-1] // (self.heads + 2 * self.kv_heads)  # features per KV head here
        q, k, v = qkv.split([self.heads * unit, self.kv_heads * unit, self.kv_heads * unit], -1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).flatten(2))


QKV = (32, 16, 16)
PLAN = {"qkv_proj": colwise(parts=QKV), "o_proj": rowwise()}


def _gqa_at_tp2():
    torch.manual_seed(0)
    ref = FusedGQA().double()
    tp = tpfn.parallelize(clone(ref), mesh(2), PLAN)
    rank = dist.get_rank()
    w = tp.qkv_proj.weight
    q, k, v = ref.qkv_proj.weight.split(QKV)
    assert torch.equal(w.to_local(), torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]]))
    return one_step(tp, ref, torch.randn(2, 6, 32, dtype=torch.float64))


def test_a_gqa_fused_qkv_at_tp2_equals_one_device(ranks2):
    for errors, forward, backward in ranks2.run(_gqa_at_tp2):
        assert max(errors.values()) <= TOL, errors
        assert len(errors) == 10  # output, input grad, 4 parameters and their 4 gradients
        assert forward == {"all_reduce": 1}   # o_proj's partial sums
        assert backward == {"all_reduce": 1}  # qkv_proj's input gradient


# Checkpoints: the DCP path stores q, k and v as their parts; any packing loads into any other.

PACKINGS = {
    "parts": PLAN,                                                        # Shard(0, parts=QKV)
    "plain": {"qkv_proj": colwise() >> prepare_out(Replicate()),               # Shard(0)
              "o_proj": prepare_in(Replicate()) >> rowwise()},
    "unparallelized": None,
}


def _laid_out(packing: str, seed: int):
    """8 query heads and 4 KV heads of 4 features: the same parts, whole heads on 4 ranks too."""
    torch.manual_seed(seed)
    model = FusedGQA(heads=8, kv_heads=4, head_dim=4)
    if PACKINGS[packing] is not None and dist.is_initialized():
        tpfn.parallelize(model, mesh(dist.get_world_size()), PACKINGS[packing])
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _full_state(model, opt) -> dict:
    """Parameters and optimizer state, their true global values, by parameter name."""
    placed = layouts(model)
    out = {}
    for n, p in model.named_parameters():
        out[n] = full_value(p, placed.get(n)).detach().clone()
        for k, v in opt.state[p].items():
            out[f"{n}.{k}"] = full_value(v, placed.get(n)).clone() if v.ndim else v.clone()
    return out


def _step(model, opt):
    torch.manual_seed(1)
    opt.zero_grad()
    model(torch.randn(2, 6, 32)).pow(2).mean().backward()
    opt.step()


def _save_packings(directory):
    saved = {}
    for packing in PACKINGS:
        model, opt = _laid_out(packing, seed=0)
        # The export is the module's own state: the true full tensors, as plain tensors.
        assert _different(_laid_out("unparallelized", seed=0)[0].state_dict(),
                          checkpoint.full_state_dict(model)) == [], packing
        _step(model, opt)
        checkpoint.save(os.path.join(directory, f"{packing}-tp{dist.get_world_size()}"), model, opt)
        saved[packing] = _full_state(model, opt)
        saved[packing]["exported"] = checkpoint.full_state_dict(model)
    return saved


def _load_packings(directory, saved_tp):
    loaded = {}
    for src in PACKINGS:
        for dst in PACKINGS:
            model, opt = _laid_out(dst, seed=2)
            checkpoint.load(os.path.join(directory, f"{src}-tp{saved_tp}"), model, opt)
            loaded[src, dst] = _full_state(model, opt)
    return loaded


def _different(a: dict, b: dict) -> list:
    return [k for k in a if k != "exported" and not torch.equal(a[k], b[k])]


def test_every_packing_of_a_fused_qkv_loads_into_every_other(ranks2, ranks4, tmp_path):
    directory = str(tmp_path)
    saved = {2: ranks2.run(_save_packings, directory)[0], 4: ranks4.run(_save_packings, directory)[0]}
    for tp, states in saved.items():
        keys = dcp.FileSystemReader(os.path.join(directory, f"parts-tp{tp}")).read_metadata() \
            .state_dict_metadata
        assert [tuple(keys[f"model.qkv_proj.weight.part{i}_of_3_dim0"].size) for i in range(3)] \
            == [(32, 32), (16, 32), (16, 32)]
        assert "model.qkv_proj.weight" not in keys
        for packing, state in states.items():
            assert _different(state, {**state, **state["exported"]}) == [], (tp, packing)
    wrong = []
    for saved_tp in (2, 4):
        for tp, ranks in ((2, ranks2), (4, ranks4)):
            loaded = ranks.run(_load_packings, directory, saved_tp)[0]
            wrong += [(saved_tp, tp, src, dst, k) for (src, dst), state in loaded.items()
                      for k in _different(saved[saved_tp][src], state)]
        for src in PACKINGS:  # one process, no process group: a plain module
            model, opt = _laid_out("unparallelized", seed=2)
            checkpoint.load(os.path.join(directory, f"{src}-tp{saved_tp}"), model, opt)
            wrong += [(saved_tp, 1, src, k) for k in _different(saved[saved_tp][src], _full_state(model, opt))]
    assert wrong == []


def _save_parts(path):
    checkpoint.save(path, _laid_out("parts", seed=0)[0])


def test_stored_parts_that_do_not_make_the_model_s_qkv_are_refused_by_name(ranks2, tmp_path):
    path = str(tmp_path / "parts")
    ranks2.run(_save_parts, path)
    narrower = FusedGQA(heads=2, kv_heads=2)  # 16 + 16 + 16 rows
    with pytest.raises(ValueError, match=r"the checkpoint holds 'model.qkv_proj.weight' as 3 parts "
                                         r"of shapes \[\(32, 32\), \(16, 32\), \(16, 32\)\] \(along "
                                         r"dim 0\), which do not make the model's \(48, 32\): load "
                                         r"it into a model of the architecture that saved it"):
        checkpoint.load(path, narrower)


# The safetensors path: each rank reads its slice of q, of k and of v; the file is the module's.

def _pretrained(directory):
    from safetensors.torch import load_file

    source, _ = _laid_out("unparallelized", seed=0)
    with tpfn.empty_weights():
        empty = FusedGQA(heads=8, kv_heads=4, head_dim=4)
    tpfn.parallelize(empty, mesh(dist.get_world_size()), PLAN, src_rank=None)
    tpfn.save_pretrained(source, directory)  # a plain module: rank 0 writes it
    loaded = tpfn.load_pretrained(empty, directory)
    placed = layouts(loaded)
    wrong = [n for n, p in loaded.named_parameters()
             if not torch.equal(full_value(p, placed.get(n)), source.get_parameter(n))]
    model, _ = _laid_out("parts", seed=0)  # parallelized from the same values
    again = os.path.join(directory, "again")
    tpfn.save_pretrained(model, again)
    written = load_file(os.path.join(again, "model.safetensors"))
    wrong += [f"saved {n}" for n, t in written.items() if not torch.equal(t, source.get_parameter(n))]
    return wrong, str(loaded.qkv_proj.weight.placements)


def test_a_pretrained_fused_qkv_loads_each_rank_s_slice_of_every_part(ranks2, ranks4, tmp_path):
    assert ranks2.run(_pretrained, str(tmp_path / "tp2")) == [([], "(Shard(dim=0),)")] * 2
    assert ranks4.run(_pretrained, str(tmp_path / "tp4")) == [([], "(Shard(dim=0),)")] * 4


class TwoPaths(nn.Module):
    """A fused projection of unequal parts (12 and 4 features), each with its own activation,
    read back by one projection: ``rowwise(parts=(12, 4))`` takes the local parts as
    ``colwise(parts=(12, 4))`` hands them on."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        h = self.up(x)
        a, b = h.split([h.shape[-1] * 3 // 4, h.shape[-1] // 4], -1)
        return self.down(torch.cat([F.gelu(a), torch.tanh(b)], -1))


def _two_paths():
    torch.manual_seed(0)
    ref = TwoPaths().double()
    plan = {"up": colwise(parts=(12, 4)), "down": rowwise(parts=(12, 4))}
    tp = tpfn.parallelize(clone(ref), mesh(2), plan)
    x = torch.randn(3, 8, dtype=torch.float64)
    with CommDebugMode() as mode:
        out = tp(x)
        out.pow(2).sum().backward()
    expected = ref(x)
    expected.pow(2).sum().backward()
    placed = layouts(tp)
    errors = {"output": rel_err(out, expected)}
    errors.update({n: rel_err(full_value(p.grad, placed.get(n)), ref.get_parameter(n).grad)
                   for n, p in tp.named_parameters()})
    return errors, tpfn.trace.counts(mode), placed


def test_rowwise_parts_read_the_parts_colwise_parts_hand_on(ranks2):
    for errors, counts, placed in ranks2.run(_two_paths):
        assert max(errors.values()) <= TOL, errors
        assert counts == {"all_reduce": 1}  # down's partial sums; x needs no gradient
        assert placed == {"up.weight": Shard(0, parts=(12, 4)), "up.bias": Shard(0, parts=(12, 4)),
                          "down.weight": Shard(1, parts=(12, 4)), "down.bias": Replicate()}


# Bad input: each a named error naming the module, nothing applied.

def _unchanged(model) -> bool:
    return not any(isinstance(p, DTensor) for p in model.parameters()) and \
        all(tpfn.mounted(m) is None for m in model.modules())


@pytest.mark.parametrize("parts, ranks, message", [
    ((32, 16, 8), 2, "parameter 'qkv_proj.weight' has 64 in dim 0, but parts=(32, 16, 8) add up to "
                     "56; give the sizes of the parts it packs (q, k and v rows of a fused "
                     "projection) (colwise(parts=(32, 16, 8)) at 'qkv_proj' (Linear))."),
    (QKV, 32, "parameter 'qkv_proj.weight' packs parts of 32, 16 and 16 in dim 0: the part of 16 "
              "does not split evenly over 32 ranks; pad each part to a multiple of 32, or choose "
              "a mesh size that divides every part (colwise(parts=(32, 16, 16)) at 'qkv_proj' "
              "(Linear))."),
])
def test_parts_that_do_not_fit_the_weight_or_the_mesh_are_refused_by_name(parts, ranks, message):
    model = FusedGQA()
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(model, fake_mesh(ranks), {**PLAN, "qkv_proj": colwise(parts=parts)},
                         src_rank=None)
    assert message in e.value.problems
    assert _unchanged(model)


def test_unequal_parts_stay_local_shards_that_dtensor_never_sees():
    with pytest.raises(PlanError, match=r"moves output 0 from Shard\(dim=-1, parts=\(32, 16, 16\)\) "
                                        r"to Replicate\(\): tpfn moves no tensor into or out of "
                                        r"Shard\(dim=-1, parts=\(32, 16, 16\)\), which DTensor has "
                                        r"no placement for"):
        tpfn.resolve({"qkv_proj": colwise(parts=QKV) >> prepare_out(Replicate())}, FusedGQA())
    with pytest.raises(PlanError, match=r"at 'qkv_proj' \(Linear\) hands output 0 on as a DTensor "
                                        r"laid out Shard\(dim=-1, parts=\(32, 16, 16\)\)"):
        tpfn.resolve({"qkv_proj": colwise(parts=QKV, local=False)}, FusedGQA())

    class Custom(nn.Linear):  # computes on DTensors: its forward is not nn.Linear's
        def forward(self, x):
            return super().forward(x)

    with pytest.raises(PlanError, match=r"'bias', 'weight' are laid out Shard\(dim=0, parts=\(32, "
                                        r"16, 16\)\), which DTensor has no placement for, but the "
                                        r"module computes on DTensors"):
        tpfn.resolve(colwise(parts=QKV), Custom(32, 64))
    with pytest.raises(TypeError, match=r"'parts' must be a positive int \(equal parts\) or a tuple "
                                        r"of two or more positive part sizes"):
        colwise(parts=(64,))


def test_parts_print_as_the_code_that_builds_them():
    assert repr(colwise(parts=QKV)) == "colwise(parts=(32, 16, 16))"
    assert eval(repr(Shard(0, parts=QKV))) == Shard(0, parts=QKV)
    assert tpfn.resolve(PLAN, FusedGQA())[0].params == (
        ("bias", Shard(0, parts=QKV)), ("weight", Shard(0, parts=QKV)))


def test_explain_shows_the_parts_their_bytes_and_no_fused_lint():
    model = FusedGQA()
    model.num_heads, model.num_key_value_heads, model.head_dim = 4, 2, 8
    report = tpfn.explain(model, PLAN, world_size=2, example_inputs=(2, 6, 32), dtype=torch.float32)
    (weight,) = [p for p in report.rows[1].params if p.name == "weight"]
    assert (weight.placement, weight.text) == (Shard(0, parts=QKV), "(64, 32) -> (32, 32)")
    # q, k, v and o: half of each weight and bias on each rank, in float32
    assert report.param_bytes == 4 * (32 * 32 + 32 + 32 * 16 + 32)
    assert not [lint for lint in report.lints if "fuses" in lint]
    plain = tpfn.explain(model, {**PLAN, "qkv_proj": colwise()}, world_size=2)
    assert ("'qkv_proj' of '<root>' (FusedGQA) fuses q, k and v of unequal sizes (4 heads and 2 + 2 "
            "KV heads of 8 features: 32 + 16 + 16 = 64 features), and colwise() cuts its output "
            "into 2 contiguous shards of 32 features, across q, k and v, so each rank computes "
            "attention on the wrong features, silently; use colwise(parts=(32, 16, 16)), which "
            "gives each rank its slice of q, of k and of v.") in plain.lints
    with pytest.raises(PlanError) as e:  # 2 KV heads of k and of v on 4 ranks: refused by parallelize
        tpfn.explain(model, PLAN, world_size=4)
    assert e.value.problems == [
        "'qkv_proj' of '<root>' (FusedGQA) projects 2 heads of 8 features: fewer heads than the 4 ranks, so "
        "colwise() cannot give each rank a whole head; use at most 2 ranks for tensor parallelism."]


def test_verify_checks_unequal_parts_against_one_device():
    report = tpfn.verify(FusedGQA(), PLAN, (2, 6, 32), world_size=2, dtype=torch.float32)
    assert report.ok, str(report)
    assert [c.fqn for c in report.checks if c.style is not None] == ["qkv_proj", "o_proj"]
