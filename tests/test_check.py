"""``tpfn.check``: every wrong plan of the collection wrong on real ranks and flagged by name,
the right plans (the collection's, the project's, transformers' and suggest's) proven."""

import json
import os
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, strategies as st

import tpfn
from tests import check_zoo as zoo
from tests import hf_plans
from tests.models import transformer, transformer_plan
from tpfn import Check, Partial, PlanError, Replicate, colwise, per_rank, prepare_in, prepare_out, rowwise
from tpfn.analysis.findings import Finding
from tpfn.cli import main

TOLERANCE = 1e-3  # right plans: float32 rounding (a gradient zero up to rounding against 1e-3 of the RMS)


def _checked(case: zoo.Case):
    torch.manual_seed(0)
    model, plan, inputs = case.build()
    model.train(case.train)
    return tpfn.check(model, plan, 2, inputs)


def test_every_wrong_plan_computes_other_numbers_on_real_ranks_and_every_right_one_the_same(ranks2):
    names = [*zoo.WRONG, *zoo.RIGHT]
    found = ranks2.run(zoo.errors, names)
    errors = {name: max(r[name] for r in found) for name in names}
    assert len(zoo.WRONG) >= 30
    assert {n: e for n, e in errors.items() if n in zoo.WRONG and not e > 1e-2} == {}
    assert {n: e for n, e in errors.items() if n in zoo.RIGHT and not e < TOLERANCE} == {}


@pytest.mark.parametrize("name", list(zoo.WRONG))
def test_check_flags_each_wrong_plan_naming_its_module(name):
    case = zoo.WRONG[name]
    report = _checked(case)
    assert not report.ok and report.wrong
    named = [f for f in report.wrong if f.fqn == case.module]
    assert named, [str(f) for f in report.findings]
    assert any(case.says in f.why for f in report.wrong), [str(f) for f in report.findings]


@pytest.mark.parametrize("name", list(zoo.RIGHT))
def test_check_proves_each_right_plan(name):
    report = _checked(zoo.RIGHT[name])
    assert report.ok and report.findings == (), [str(f) for f in report.findings]


@pytest.mark.parametrize("sp", [False, True])
def test_the_reference_transformer_plans_are_proven(sp):
    plan = transformer_plan(sp)
    plan["layers.*.attention"] = plan["layers.*.attention"] >> per_rank("n_heads")
    report = tpfn.check(transformer(), plan, 2, (2, 8))
    assert report.ok and report.ops > 50


@pytest.mark.parametrize("name", hf_plans.NAMES)
def test_the_hand_written_transformers_plans_are_proven(name):
    model, inputs = hf_plans.build(name)
    assert tpfn.check(model, hf_plans.PLANS[name], 4 if name == "llama" else 2, inputs).ok


def test_from_hf_and_suggest_plans_are_proven():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    assert tpfn.check(model, tpfn.from_hf(model.tp_plan, model), 2).ok
    assert tpfn.check(model, tpfn.suggest(model, 2), 2).ok


def test_a_finding_names_the_module_the_op_and_the_line():
    report = _checked(zoo.WRONG["heads_by_attribute"])
    line = f"tests/check_zoo.py:{zoo.Attention.heads.__code__.co_firstlineno + 3}"
    assert report.findings[0] == Finding(
        "", "aten.view.default", line,
        "views its shard as (2, 6, 4, 2) by self.n_head = 4 that is the global one, where its share of "
        "one device's (2, 6, 4, 4) is (2, 6, 2, 4): the rank's features are cut into the wrong pieces "
        "(heads of the wrong size), silently; hold the count per rank with per_rank('n_head') in the "
        "module's style, view with -1 for the count and the head size given, or hand the module "
        "DTensors (colwise(local=False))")
    assert len(report.findings) == 3   # q, k and v, at one line
    text = str(report)
    assert text.startswith(
        "tpfn.check on 2 ranks: one forward and backward of input 0 (2, 6, 16) float32;")
    assert (f"WRONG: 1 finding (the numbers would differ from one device's)\n  - '<root>' aten.view.default "
            f"({line}): views its shard as (2,\n    6, 4, 2) by self.n_head = 4") in text
    assert text.rstrip().endswith("(x3)") and max(map(len, text.splitlines())) <= 80
    assert max(map(len, report.text(60).splitlines())) <= 60 and "\n" not in report.text(None).split("\n  - ")[1]


def test_the_sentences_of_partial_sums_say_what_is_wrong():
    relu, bias = (_checked(zoo.WRONG[n]).wrong[0] for n in ("relu_of_partial_sum", "bias_added_to_partial_sum"))
    assert relu.op == "aten.relu.default" and relu.why == (
        "relu of a partial sum (output 0 of 'down'): each rank applies it to its own term, and the "
        "terms' relu is not the relu of their sum; reduce the sum first (prepare_out(Replicate()) on "
        "the module that hands it on, or let its style all-reduce it)")
    assert bias.op == "aten.add.Tensor" and bias.why == (
        "add of a partial sum (output 0 of 'down') and a replicated value: each of the 2 ranks adds it "
        "to its own term, so the sum counts it 2 times (a bias added to partial sums is added on one "
        "rank, as rowwise() does, or after the reduction)")


def test_a_check_is_a_value_that_prints_and_serializes():
    report = _checked(zoo.WRONG["dropout_on_shards"])
    assert isinstance(report, Check) and report == _checked(zoo.WRONG["dropout_on_shards"])
    found = json.loads(report.to_json())
    assert found["ok"] is False and found["findings"][0]["module"] == "" and found["world_size"] == 2
    assert found["findings"][0]["op"] == "aten.bernoulli_.float"   # F.dropout's mask
    assert found == report.to_dict()


class Spectrum(nn.Module):
    """An op no rule of the check knows, on sharded features (along a dim each rank holds whole)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.fft.fft(self.up(x), dim=0).abs())


def test_an_op_without_a_rule_is_named_never_proven():
    report = tpfn.check(Spectrum(), {"up": colwise(), "down": rowwise()}, 2, torch.randn(2, 16))
    assert not report.ok and report.wrong == ()
    (f,) = report.unproven
    assert f.kind == "unproven" and f.op == "aten._fft_r2c.default"
    assert "no rule of the check says how it treats one" in f.why
    assert "UNPROVEN: 1 op no rule proves" in str(report)


def test_what_cannot_run_on_one_device_is_an_error_that_says_why():
    model = transformer()
    for layer in model.layers:
        layer.attention.n_heads //= 2   # a model that runs on shards only
    with pytest.raises(RuntimeError, match="has no one device's numbers; give it its global sizes"):
        tpfn.check(model, transformer_plan(False), 2, (2, 8))
    with pytest.raises(TypeError, match="check runs one forward of Sequential to see where its features go"):
        tpfn.check(nn.Sequential(nn.Linear(2, 2)), {"0": colwise()}, 2)
    with pytest.raises(PlanError, match="'nowhere'"):
        tpfn.check(nn.Sequential(nn.Linear(2, 2)), {"nowhere": colwise()}, 2, torch.ones(1, 2))
    with pytest.raises(TypeError, match="'world_size' must be an int of at least 2"):
        tpfn.check(nn.Linear(2, 2), colwise(), 1, torch.ones(1, 2))


@given(heads=st.sampled_from([2, 4, 8]), size=st.sampled_from([2, 4]), n=st.sampled_from([2, 4]),
       how=st.sampled_from(["attribute", "size"]))
def test_a_view_is_proven_where_it_splits_whole_heads_and_flagged_by_the_global_count(heads, size, n, how):
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_head, self.head_dim = heads, size
            self.q, self.o = nn.Linear(8, heads * size), nn.Linear(heads * size, 8)

        def forward(self, x):
            q = self.q(x)
            q = q.view(2, 3, self.n_head, -1) if how == "attribute" else q.view(2, 3, -1, self.head_dim)
            return self.o(torch.softmax(q, -1).flatten(2))

    plan = {"": prepare_in(Replicate(), local=True), "q": colwise(), "o": rowwise()}
    if heads % n:
        with pytest.raises(PlanError):
            tpfn.check(Heads(), plan, n, torch.randn(2, 3, 8))
        return
    report = tpfn.check(Heads(), plan, n, torch.randn(2, 3, 8))
    assert report.ok == (how == "size")
    if how == "attribute":
        assert f"by self.n_head = {heads} that is the global one" in report.findings[0].why


@given(op=st.sampled_from([torch.relu, torch.sigmoid, torch.exp, torch.square, lambda y: y.softmax(-1),
                           lambda y: y.abs(), lambda y: F.silu(y), lambda y: y.clamp(min=0)]))
def test_a_nonlinear_op_of_a_partial_sum_is_flagged_and_linear_ones_are_proven(op):
    class Then(nn.Module):
        def __init__(self, then):
            super().__init__()
            self.up, self.down, self.then = nn.Linear(4, 8), nn.Linear(8, 4, bias=False), then

        def forward(self, x):
            return self.then(self.down(self.up(x)))

    plan = {"": prepare_out(Replicate(), given=Partial()), "up": colwise(),
            "down": rowwise() >> prepare_out(Partial())}
    assert not tpfn.check(Then(op), plan, 2, torch.randn(2, 4)).ok
    for linear in (lambda y: -y * 2, lambda y: y.transpose(0, 1).t() / 3, lambda y: y + y):
        assert tpfn.check(Then(linear), plan, 2, torch.randn(2, 4)).ok


def test_a_32_layer_llama_3_8b_on_meta_checks_in_seconds():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    start = time.perf_counter()
    report = tpfn.check(model, tpfn.from_hf(model.tp_plan, model), 8, {"input_ids": (1, 128)})
    assert report.ok and report.ops > 32 * 60
    assert time.perf_counter() - start < 30   # (10 s on 2 idle cores; the suite shares them)


def test_the_command_line_checks_a_model_and_a_checkpoint(tmp_path, capsys, monkeypatch):
    (tmp_path / "mlp.py").write_text(
        "import torch.nn as nn\n"
        "from tpfn import Partial, colwise, prepare_out, rowwise\n"
        "def MLP():\n"
        "    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU())\n"
        "WRONG = {'0': colwise(), '2': rowwise() >> prepare_out(Partial())}\n"
        "RIGHT = {'0': colwise(), '2': rowwise()}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["check", "mlp.py:MLP", "mlp.py:WRONG", "--input", "2,16:float32", "--width", "80"]) == 1
    out = capsys.readouterr().out
    assert "WRONG: 1 finding" in out and "'3' aten.relu.default" in out
    assert main(["check", "mlp.py:MLP", "mlp.py:RIGHT", "--input", "2,16:float32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    with pytest.raises(SystemExit) as e:   # a plan that cannot be loaded: a usage error
        main(["check", "mlp.py:MLP", "mlp.py:nowhere", "--input", "2,16:float32"])
    assert e.value.code == 2 and "cannot load the plan 'mlp.py:nowhere'" in capsys.readouterr().err
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "ckpt")
    capsys.readouterr()
    assert main(["check", str(tmp_path / "ckpt"), "--world-size", "2", "--input", "input_ids=1,8"]) == 0
    assert "ok: every op computes one device's numbers on the ranks" in capsys.readouterr().out
    assert os.path.isdir(tmp_path / "ckpt")


def test_parallelize_with_check_proves_the_plan_first():
    from torch.distributed.tensor import DTensor

    from tpfn.analysis.fake import fake_mesh

    mlp = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4), nn.ReLU())
    wrong = {"0": colwise(), "2": rowwise() >> prepare_out(Partial())}
    with pytest.raises(PlanError, match=r"'3' aten\.relu\.default .*relu of a partial sum"):
        tpfn.parallelize(mlp, fake_mesh(2), wrong, src_rank=None, check=torch.ones(2, 4))
    assert not isinstance(mlp[0].weight, DTensor)  # nothing changed
    right = {"0": colwise(), "2": rowwise()}
    tpfn.parallelize(mlp, fake_mesh(2), right, src_rank=None, check=torch.ones(2, 4))
    assert isinstance(mlp[0].weight, DTensor)
