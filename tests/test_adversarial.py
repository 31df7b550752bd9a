"""What a demanding user tries, on two gloo ranks: one device's numbers or a named error on
every rank, never a third outcome. Each case came in as a report; the module keeps growing.

Gradient hooks registered before ``parallelize``: kept on the DTensor parameter that replaces
theirs (native TP drops them without a word), or refused by name where the gradient they
would see is one rank's partial sum. A model ``fully_shard`` (FSDP2) already manages: refused
by name (its all-gathers would hand the bound modules whole weights), nothing changed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import tpfn
from tests.models import clone, full, rel_err
from tests.ranks import mesh
from tpfn import PlanError, Replicate, Shard, colwise, prepare_in, prepare_out, rowwise, sequence_parallel

# One forward and backward on 2 ranks against one device, float64: the sums reorder, ~1e-16.
TOL = 1e-12


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).double()


MLP_PLAN = {"": prepare_in(Replicate()), "0": colwise(), "2": rowwise()}


def _hooked(model: nn.Module, calls: list) -> list:
    """A clipping tensor hook on the first weight and a post-accumulate hook on the second,
    each recording its call; the handles."""
    def clip(g):
        calls.append("clip")
        return g.clamp(-0.05, 0.05)

    return [model[0].weight.register_hook(clip),
            model[2].weight.register_post_accumulate_grad_hook(lambda p: calls.append("post"))]


def _hooks_kept():
    ref, calls_ref = _mlp(), []
    tp, calls_tp = clone(ref), []
    _hooked(ref, calls_ref)
    handles = _hooked(tp, calls_tp)
    tpfn.parallelize(tp, mesh(2), MLP_PLAN)
    x = torch.randn(4, 8, dtype=torch.float64)
    ref(x).pow(2).sum().backward()
    tp(x).pow(2).sum().backward()
    errors = {n: rel_err(p.grad, dict(ref.named_parameters())[n].grad) for n, p in tp.named_parameters()}
    clipped = full(tp[0].weight.grad).abs().max().item()
    for handle in handles:  # the handles register_hook returned still remove the hooks
        handle.remove()
    tp.zero_grad()
    tp(x).pow(2).sum().backward()
    return errors, calls_ref, calls_tp, clipped, isinstance(tp[0].weight, DTensor)


def test_gradient_hooks_registered_before_parallelize_are_kept(ranks2):
    for errors, calls_ref, calls_tp, clipped, sharded in ranks2.run(_hooks_kept):
        assert sharded
        assert max(errors.values()) <= TOL, errors
        assert calls_ref == calls_tp == ["post", "clip"]  # once each, the one backward only
        assert clipped == pytest.approx(0.05)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.norm(x))


def _hook_on_a_partial_sum():
    model = _Block()
    model.norm.weight.register_hook(lambda g: g.clamp(-1, 1))
    plan = {"norm": sequence_parallel(), "fc": prepare_in(Shard(1), desired=Replicate()) >> colwise()}
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(model, mesh(2), plan)
    unchanged = not any(isinstance(p, DTensor) for p in model.parameters())
    return str(e.value), unchanged


def test_a_gradient_hook_on_a_parameter_whose_gradient_is_a_partial_sum_is_refused_by_name(ranks2):
    for message, unchanged in ranks2.run(_hook_on_a_partial_sum):
        assert "parameter 'norm.weight' has gradient hooks" in message
        assert "each rank's partial sum until the end of the backward" in message
        assert unchanged


def _fully_sharded_first():
    from torch.distributed.fsdp import fully_shard

    model = _mlp().float()
    fully_shard(model, mesh=mesh(2))
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(model, mesh(2), {"0": colwise()})
    return str(e.value), [tpfn.mounted(m) for m in model.modules()]


def test_a_model_fully_shard_already_manages_is_refused_by_name(ranks2):
    for message, mounted in ranks2.run(_fully_sharded_first):
        assert "'<root>' (FSDPSequential) is already sharded by fully_shard (FSDP2)" in message, message
        assert "parallelize the fresh model first, then fully_shard" in message
        assert mounted == [None] * 4


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.lm_head = nn.Linear(8, 8), nn.Linear(8, 32)

    def forward(self, x):
        return self.lm_head(torch.tanh(self.body(x)))


def test_verify_says_that_the_models_output_stays_a_local_shard():
    sharded = tpfn.verify(_Head(), {"lm_head": colwise()}, (2, 6, 8),
                          dtype=torch.float32)
    assert sharded.ok, str(sharded)  # the numbers agree: each rank's shard is one device's part
    assert sharded.notes == (
        "output 0 of the model is each rank's local shard (rank 0: (2, 6, 16) of (2, 6, 32)): a loss "
        "that takes it as it is (labels=...) sees a part of it; end the plan with "
        "prepare_out(Replicate()) on the module that makes it, or take the loss with "
        "tpfn.cross_entropy(..., mesh=mesh) on the shards.",)
    assert "note: output 0 of the model is each rank's local shard" in str(sharded)
    whole = tpfn.verify(_Head(), {"lm_head": colwise() >> prepare_out(Replicate())},
                        (2, 6, 8), dtype=torch.float32)
    assert whole.ok and whole.notes == (), str(whole)


def _odd_vocabulary():
    import torch.nn.functional as F

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 11)).double()  # 11 classes: 6 and 5
    tp = tpfn.parallelize(clone(ref), mesh(2), {"2": colwise()})
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    target = torch.tensor([[10, 0, 5, 6, 3], [1, 10, 2, 9, 4]])  # 10: the last class, on rank 1
    expected = F.cross_entropy(ref(x).flatten(0, 1), target.flatten())
    expected.backward()
    logits = tp(x)
    loss = tpfn.cross_entropy(logits.flatten(0, 1), target.flatten(), mesh=mesh(2))
    loss.backward()
    theirs = dict(ref.named_parameters())
    errors = {n: rel_err(p.grad, theirs[n].grad) for n, p in tp.named_parameters()}
    return rel_err(loss, expected), errors, tuple(logits.shape)


def test_cross_entropy_on_local_logits_of_an_odd_vocabulary_is_one_devices(ranks2):
    shapes = []
    for loss, errors, shape in ranks2.run(_odd_vocabulary):
        assert loss <= TOL and max(errors.values()) <= TOL, (loss, errors)
        shapes.append(shape)
    assert shapes == [(2, 5, 6), (2, 5, 5)]


def _interrupted_load(path: str):
    from tpfn.training import pretrained

    torch.manual_seed(0)
    source = _mlp().float()
    plan = {"0": colwise(), "2": rowwise()}
    tpfn.save_pretrained(source, path)  # every rank calls it, rank 0 writes
    with tpfn.empty_weights():
        empty = tpfn.parallelize(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)), mesh(2),
                                 plan, src_rank=None)
    fill, calls = pretrained._fill, []

    def interrupted(target, value):  # Ctrl-C after two of the four tensors are in
        calls.append(target)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return fill(target, value)

    pretrained._fill = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            tpfn.load_pretrained(empty, path)
    finally:
        pretrained._fill = fill
    still_empty = [p.to_local().is_meta for p in empty.parameters()]
    tpfn.load_pretrained(empty, path)  # and a second try loads it all
    errors = {n: rel_err(p, dict(source.named_parameters())[n]) for n, p in empty.named_parameters()}
    return still_empty, errors


def test_an_interrupted_load_leaves_nothing_half_loaded(ranks2, tmp_path):
    for still_empty, errors in ranks2.run(_interrupted_load, str(tmp_path)):
        assert still_empty == [True] * 4
        assert max(errors.values()) == 0, errors


def test_a_plan_that_shards_nothing_is_never_silent():
    from transformers import GPT2Config, GPT2LMHeadModel
    from tpfn.dryrun import fake_mesh

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    with pytest.raises(PlanError) as e:
        tpfn.from_hf(gpt2.tp_plan or {}, gpt2)
    assert "GPT2LMHeadModel: the empty tp_plan shards nothing (the model declares none)" in str(e.value)
    with pytest.warns(UserWarning, match="the plan binds no module of Sequential: parallelize shards nothing"):
        tpfn.parallelize(_mlp(), fake_mesh(2), {})  # as parallelize_module with no plan, with a word


class _RankBranch(nn.Module):
    """A forward that branches on the rank, as a user's debugging code or a rank-0-only path does."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        y = self.down(torch.tanh(self.up(x)))
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            y = y * 2  # rank 1 alone: a real 2-rank run is off, so verify must be too
        return y


def test_verify_sees_a_forward_that_branches_on_the_rank():
    report = tpfn.verify(_RankBranch(), {"up": colwise(), "down": rowwise()}, (4, 8), dtype=torch.float32)
    assert not report.ok, str(report)
    assert report.culprit == "", str(report)  # the root's own code: its children agree


def test_a_shard_dim_a_parameter_lacks_is_refused_by_name_before_anything_changes():
    from tpfn import on_shards, params
    from tpfn.dryrun import fake_mesh

    model = _mlp()
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(model, fake_mesh(2), {"0": params(weight=Shard(0), bias=Shard(1)) >> on_shards(Replicate())})
    assert "parameter '0.bias' has 1 dim (shape (16,)), so it cannot be Shard(dim=1)" in str(e.value)
    assert "shard a dim in [-1, 0], or Replicate() it" in str(e.value)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_a_shard_dim_an_input_lacks_is_named_by_its_slot():
    from tpfn.dryrun import fake_mesh
    from tpfn.errors import LayoutError

    model = tpfn.parallelize(nn.Sequential(nn.LayerNorm(4)), fake_mesh(2), {"0": sequence_parallel(dim=5)},
                             src_rank=None)
    with pytest.raises(LayoutError, match=r"^input 0 of '0' \(LayerNorm\) has 3 dims \(shape \(2, 3, 4\)\), "
                                          r"so it cannot be Shard\(dim=5\); lay it out on a dim in \[-3, 2\]"):
        model(torch.randn(2, 3, 4))


def _fake_mlp():
    from tpfn.dryrun import fake_mesh

    return tpfn.parallelize(_mlp().float(), fake_mesh(2), MLP_PLAN, src_rank=None)


@pytest.mark.filterwarnings("ignore:Anomaly Detection")
def test_modes_that_cannot_run_on_dtensor_parameters_are_refused_by_name():
    model, x = _fake_mlp(), torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"^'<root>' \(Sequential\): torch\.autograd\.detect_anomaly\(\) "
                                           r"checks every gradient with aten\._is_any_true"):
        with torch.autograd.detect_anomaly():
            model(x)
    params = dict(model.named_parameters())
    with pytest.raises(RuntimeError, match=r"torch\.func transforms \(grad, vmap, jacrev, \.\.\.\) do not run "
                                           r"through DTensor parameters; take gradients with torch\.autograd"):
        torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(params)


def test_bare_torch_errors_inside_a_bound_module_name_it_and_the_likely_cause():
    from tpfn import params
    from tpfn.dryrun import fake_mesh

    with pytest.raises(TypeError, match=r"^input 0 of '0' \(Linear\) is None, but colwise\(\) computes on it "
                                        r"\(Replicate\(\)\); pass it a tensor\.$"):
        _fake_mlp()[0](None)
    alone = tpfn.parallelize(nn.Sequential(nn.Linear(4, 8)), fake_mesh(2), {"0": params(weight=Shard(0))},
                             src_rank=None)
    with pytest.raises(RuntimeError, match=r"^'0' \(Linear\): aten\.addmm\.default got mixed torch\.Tensor "
                                           r"and DTensor.* params\(weight=Shard\(dim=0\)\) makes its parameters "
                                           r"DTensors, and its forward met plain tensors"):
        alone(torch.randn(2, 4))
    whole = tpfn.parallelize(nn.Sequential(nn.Linear(8, 4)), fake_mesh(2), {"0": rowwise()}, src_rank=None)
    with pytest.raises(RuntimeError, match=r"^'0' \(Linear\): mat1 and mat2 shapes cannot be multiplied "
                                           r"\(2x8 and 4x4\)\. Its input 0, of shape \(2, 8\) on this rank, is "
                                           r"taken to be laid out Shard\(dim=-1\) \(rowwise\(\)\); one that "
                                           r"arrives whole says so: prepare_in\(Replicate\(\), "
                                           r"desired=Shard\(-1\)\) >> rowwise\(\)\.$"):
        whole(torch.randn(2, 8))


def test_modules_whose_style_could_never_run_are_refused_by_name():
    from tpfn.dryrun import fake_mesh

    lazy = nn.Sequential(nn.LazyLinear(8))
    with pytest.raises(PlanError, match=r"'0' \(LazyLinear\) has uninitialized parameters \(weight, bias: a "
                                        r"lazy module\); run one forward with a real batch first"):
        tpfn.parallelize(lazy, fake_mesh(2), {"0": colwise()}, src_rank=None)
    attention = nn.Sequential(nn.MultiheadAttention(8, 2))
    with pytest.raises(PlanError, match=r"'0\.out_proj' \(NonDynamicallyQuantizableLinear\) is "
                                        r"nn\.MultiheadAttention's out_proj, .* so rowwise\(\) would never run; "
                                        r"bind the MultiheadAttention '0' itself"):
        tpfn.parallelize(attention, fake_mesh(2), {"0.out_proj": rowwise()}, src_rank=None)
    assert not any(isinstance(p, DTensor) for p in attention.parameters())

    class LoRALinear(nn.Linear):
        def __init__(self):
            super().__init__(4, 8)
            self.a, self.b = nn.Linear(4, 2, bias=False), nn.Linear(2, 8, bias=False)

        def forward(self, x):
            return super().forward(x) + self.b(self.a(x))

    with pytest.raises(PlanError, match=r"'0' \(LoRALinear\) is an nn\.Linear with a forward of its own and "
                                        r"submodules that compute \(a, b\): colwise\(\) shards nn\.Linear's "
                                        r"own weight, which they would meet in shards; bind the submodules"):
        tpfn.parallelize(nn.Sequential(LoRALinear()), fake_mesh(2), {"0": colwise()}, src_rank=None)


def test_clip_grad_norm_refuses_a_norm_type_that_is_no_norm():
    model = _mlp()
    model(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match=r"^clip_grad_norm_: 'norm_type' must be a positive number or inf "
                                         r"\(got 0\)"):
        tpfn.clip_grad_norm_(model.parameters(), 1.0, norm_type=0)


def _cross_entropy_targets():
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor import Replicate as R, Shard as S

    logits = distribute_tensor(torch.randn(6, 10), mesh(2), [S(1)])
    found = []
    for target in (distribute_tensor(torch.randint(0, 10, (6,)), mesh(2), [R()]), torch.randint(0, 10, (4,))):
        try:
            tpfn.cross_entropy(logits, target)
        except (TypeError, ValueError) as e:
            found.append(f"{type(e).__name__}: {e}")
    return found


def test_cross_entropy_names_a_dtensor_target_and_a_count_that_differs(ranks2):
    for found in ranks2.run(_cross_entropy_targets):
        assert found == [
            "TypeError: cross_entropy: 'target' must be a plain tensor of class indices, the same on every "
            "rank (got a DTensor laid out (Replicate(),)); pass target.full_tensor().",
            "ValueError: cross_entropy: 'target' must hold one class index per row of the logits, shape (6,) "
            "(got (4,)); flatten both alike: logits.flatten(0, -2) and target.flatten()."]


# --- errors that named nothing: now the module, the rule and the fix, or one device's numbers ---

def test_a_transformers_string_in_a_plan_hides_none_of_its_other_problems():
    from tpfn.dryrun import fake_mesh

    model = _mlp()
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(model, fake_mesh(2), {"0": "colwise", "2": rowwise(), "3": colwise()}, src_rank=None)
    assert e.value.problems == [
        "plan['0'] is the string 'colwise', not a tpfn style; a Hugging Face tp_plan (strings such as "
        "'colwise') converts whole with tpfn.from_hf(tp_plan, model).",
        "'3' -> colwise() matches no module; modules here: 0, 1, 2"]
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_heads_the_ranks_cannot_split_are_refused_by_parallelize():
    from tests.models import transformer, transformer_plan
    from tpfn.dryrun import fake_mesh

    model = transformer(vocab_size=16, n_heads=3, dim=12, n_layers=2)
    with pytest.raises(PlanError) as e:
        tpfn.parallelize(model, fake_mesh(2), transformer_plan(False), src_rank=None)
    assert e.value.problems == [
        "'wq', 'wk', 'wv' of 'layers.0.attention' (Attention) project 3 heads of 4 features: the 2 ranks do not "
        "divide them, so ranks would hold parts of heads; choose a mesh size that divides 3 (and 1 more like it)."]
    assert not any(isinstance(p, DTensor) for p in model.parameters())


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def _tied_head():
    from tpfn.dryrun import fake_mesh

    left_out = tpfn.parallelize(_TiedLM(), fake_mesh(2), {"emb": rowwise()}, src_rank=None)
    with pytest.raises(PlanError) as e:  # the head runs: refused by name before it computes
        left_out(torch.zeros(2, 5, dtype=torch.long))
    torch.manual_seed(0)
    ref = _TiedLM().double()
    tp = tpfn.parallelize(clone(ref), mesh(2), {"emb": rowwise(), "head": colwise() >> prepare_out(Replicate())})
    ids = torch.randint(0, 16, (2, 5))
    ref(ids).pow(2).sum().backward()
    out = tp(ids)
    out.pow(2).sum().backward()
    with pytest.raises(PlanError) as dry:  # explain's dry run names it alike
        tpfn.explain(_TiedLM(), {"emb": rowwise()}, world_size=2, example_inputs=torch.zeros(2, 5, dtype=torch.long))
    assert dry.value.problems == e.value.problems
    return e.value.problems, rel_err(out, ref(ids)), rel_err(tp.emb.weight.grad, ref.emb.weight.grad)


def test_a_tied_head_left_out_of_the_plan_is_refused_and_bound_gives_one_devices_numbers(ranks2):
    for problems, out, grad in ranks2.run(_tied_head):
        assert problems == [
            "parameter 'head.weight' is tied to 'emb.weight', which rowwise() at 'emb' (Embedding) places "
            "Shard(dim=0), but 'head' (Linear) is outside the plan and computes with that shard; bind it "
            "with a style that places the parameter alike (colwise() for a head tied to a rowwise() embedding), "
            "or untie them."]
        assert out <= TOL and grad <= TOL, (out, grad)


def _mesh_without_this_rank():
    from torch.distributed.device_mesh import DeviceMesh

    alone = DeviceMesh("cpu", [0])  # every rank builds it; rank 1 is not in it
    try:
        tpfn.parallelize(nn.Linear(4, 8), alone, colwise())
    except ValueError as error:
        return str(error)
    return "parallelized"


def test_a_mesh_without_this_rank_is_refused_by_name(ranks2):
    assert ranks2.run(_mesh_without_this_rank) == [
        "parallelized",
        "this rank (1) is not in the mesh of ranks [0]; call parallelize on the mesh's ranks only, or pass "
        "each rank the mesh it belongs to (mesh['tp'] of init_device_mesh over every rank)."]


class _Shifted(nn.Module):
    def forward(self, x, bias=None):
        return torch.tanh(x) + bias


def _keyword_slot_by_position():
    """Each rank hands its rows of x and of bias; the module computes on whole ones."""
    plan = prepare_in(Shard(0), desired=Replicate(), kwargs={"bias": (Shard(0), Replicate())}, local=True)
    model = tpfn.parallelize(_Shifted(), mesh(2), plan)
    torch.manual_seed(0)
    x, bias = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    rank = torch.distributed.get_rank()
    mine = x.chunk(2)[rank], bias.chunk(2)[rank]
    expected = _Shifted()(x, bias)
    return rel_err(model(mine[0], bias=mine[1]), expected), rel_err(model(*mine), expected)


def test_a_keyword_slot_passed_by_position_is_laid_out_as_declared(ranks2):
    for by_keyword, by_position in ranks2.run(_keyword_slot_by_position):
        assert by_keyword <= TOL and by_position <= TOL, (by_keyword, by_position)


def test_keys_on_the_tensor_a_kernel_returns_are_refused_by_name():
    from tpfn.dryrun import fake_mesh
    from tpfn.errors import LayoutError

    model = tpfn.parallelize(nn.Sequential(nn.Linear(4, 4)), fake_mesh(2),
                             {"0": colwise() >> prepare_out(keys={"a": Replicate()})}, src_rank=None)
    with pytest.raises(LayoutError, match=r"^'0' \(Linear\) returned a Tensor, but the plan lays out outputs by key "
                                          r"\('a'\), which only a dict has; give prepare_out one layout per position"):
        model(torch.randn(2, 4))


def _whole_state_dict():
    from tests.test_parts import PLAN, FusedGQA
    from tpfn.interpret.layouts import full_value, layouts

    torch.manual_seed(0)
    ref = nn.Sequential(FusedGQA(), nn.Linear(32, 8)).double()
    tp = tpfn.parallelize(nn.Sequential(FusedGQA(), nn.Linear(32, 8)).double(), mesh(2),
                          {**{f"0.{k}": v for k, v in PLAN.items()}, "1": colwise() >> prepare_out(Replicate())})
    tp.load_state_dict(ref.state_dict())  # the whole tensors one device saves
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    placed = layouts(tp)  # (a packed weight's full value puts its parts back in their places)
    errors = {n: rel_err(full_value(p, placed.get(n)), dict(ref.named_parameters())[n])
              for n, p in tp.named_parameters()}
    return max(errors.values()), rel_err(tp(x), ref(x))


def test_a_whole_state_dict_loads_into_a_parallelized_model(ranks2):
    """load_state_dict of one device's state: each rank takes its part (packed parts too)."""
    for params, out in ranks2.run(_whole_state_dict):
        assert params == 0 and out <= TOL, (params, out)


def _encoder_layer_in_eval():
    torch.manual_seed(0)
    plan = {"layers.*.self_attn": colwise(), "layers.*.linear1": colwise(), "layers.*.linear2": rowwise()}
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    ref = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    tp = tpfn.parallelize(clone(ref), mesh(2), plan).eval()
    x = torch.randn(2, 5, 8)
    padded = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():  # PyTorch's fused path: it reads the layers' weights directly
        whole = rel_err(tp(x), ref(x))
        kept = rel_err(tp(x, src_key_padding_mask=padded)[~padded], ref(x, src_key_padding_mask=padded)[~padded])
    return whole, kept


def test_transformer_encoder_layers_in_eval_under_no_grad_give_one_devices_numbers(ranks2):
    """float32, one forward: the reorderings of 2 ranks' sums, ~1e-7 (TOL32 of test_mha)."""
    for whole, kept in ranks2.run(_encoder_layer_in_eval):
        assert whole <= 1e-5 and kept <= 1e-5, (whole, kept)


def _load_with_a_graph_alive(path: str):
    from tpfn.errors import CheckpointError

    torch.manual_seed(0)
    tpfn.save_pretrained(_mlp().float(), path)
    model = tpfn.parallelize(_mlp().float(), mesh(2), MLP_PLAN)
    before = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    loss = model(torch.randn(2, 8)).sum()
    with pytest.raises(CheckpointError) as e:
        tpfn.load_pretrained(model, path)
    unchanged = all(torch.equal(full(p), before[n]) for n, p in model.named_parameters())
    loss.backward()  # the graph runs as it was
    del loss
    tpfn.load_pretrained(model, path)  # and then the load
    return e.value.problems[0], unchanged


def test_load_pretrained_into_a_model_whose_graph_is_alive_is_refused_by_name(ranks2, tmp_path):
    for problem, unchanged in ranks2.run(_load_with_a_graph_alive, str(tmp_path)):
        assert problem.startswith("parameter '0.weight' ('0.weight' in "), problem
        assert problem.endswith("is referenced by an autograd graph (a forward's outputs are alive), so it cannot "
                                "be filled in place; run its backward if it is to run, drop its outputs (del loss), "
                                "then load."), problem
        assert unchanged


def _data_parallel_around():
    from torch.nn.parallel import DistributedDataParallel as DDP

    found = []
    for sync in (True, False):
        model = tpfn.parallelize(_mlp().float(), mesh(2), MLP_PLAN)
        try:
            DDP(model, init_sync=sync)(torch.randn(2, 8)).sum().backward()
        except RuntimeError as error:
            found.append(str(error))
    return found


def test_distributed_data_parallel_around_a_parallelized_model_is_refused_by_name(ranks2):
    why = ("DistributedDataParallel syncs and all-reduces each parameter and gradient as a whole tensor, and a "
           "parallelized model's are DTensors, each rank's shard; for data parallelism with tpfn, fully_shard the "
           "parallelized model on the data-parallel mesh (docs/training.md).")
    for found in ranks2.run(_data_parallel_around):
        assert found == [
            "c10d.broadcast_.default got DTensors, which a torch.distributed collective cannot move (one of your "
            f"own takes dtensor.to_local()). {why}",
            f"'<root>' (Sequential): {why}"]
