"""Where users train: transformers' Trainer and accelerate, Lightning, PEFT; each against one process.

Trainer and accelerate keep one state per process and read torchrun's environment, so their
runs start processes of their own (``examples/train_hf.py``, as a user would run it), each
ended by its process group when it outlasts its time.
"""

import os
import re
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import tpfn
from tests.models import max_rel_err
from tests.ranks import mesh
from tests.test_examples import EXAMPLES

ROOT = os.path.dirname(EXAMPLES)


def _script(*args, timeout: float = 480) -> str:
    """Run ``examples/<args>`` as a user would; its output, or the failure with it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.Popen([sys.executable, os.path.join(EXAMPLES, args[0]), *args[1:]], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the ranks it started: one group
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(args)} did not finish within {timeout}s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{out[-4000:]}"
    return out


def test_trainer_and_accelerate_match_one_process_and_the_trainer_saves_the_trained_weights(tmp_path):
    # The script compares every loss and gradient norm (max_grad_norm clips across meshes) of the
    # Trainer, the Trainer with PEFT's LoRA (tensor-parallel mesh) and accelerate with the same runs
    # in one process; the Trainer's last checkpoint and save_model() must load bit for bit as
    # trained: in plain transformers (PEFT for the adapter) on one device and in
    # tpfn.from_pretrained. It exits non-zero where any of that fails.
    reference = str(tmp_path / "one-process.json")
    saved = "the Trainer's checkpoints: transformers and tpfn.from_pretrained load the trained weights"
    out = _script("train_hf.py", "--nproc", "2", "--reference", reference)
    for run in ("trainer", "trainer with LoRA", "accelerate"):
        assert f"{run}: losses" in out
    assert "on a 1 x 2 mesh" in out and saved in out
    assert os.path.exists(reference)
    out = _script("train_hf.py", "--nproc", "4", "--dp", "2", "--reference", reference)
    assert "on a 2 x 2 mesh" in out and saved in out


def _under_torchrun(name: str, *args):
    """The example ``name``'s ``main(*args)`` on this rank, with the environment torchrun sets
    (Lightning reads it to find the process group already made), restored afterwards."""
    import torch.distributed as dist

    from tests.test_examples import _example

    env = {"RANK": str(dist.get_rank()), "LOCAL_RANK": str(dist.get_rank()),
           "WORLD_SIZE": str(dist.get_world_size()), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return _example(name, *args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_lightning_fabric_and_trainer_with_tpfn_parallelizing_match_one_process(ranks2):
    # ModelParallelStrategy on CPU, Fabric's (parallelize_fn=...) and the Trainer's
    # (configure_model): main() raises SystemExit where a loss curve leaves the one-process one.
    ranks2.run(_under_torchrun, "train_lightning", 1)


def test_the_recipes_on_the_docs_page_are_lines_of_the_examples_these_tests_run():
    # docs/integrations.md and README.md quote the examples in ```py blocks (they need
    # torchrun's processes, not the docs' shared ranks): every line quoted is one they run.
    page = ""
    for name in (os.path.join("docs", "integrations.md"), "README.md"):
        with open(os.path.join(ROOT, name)) as f:
            page += f.read()
    lines = set()
    for name in ("train_hf.py", "train_lightning.py"):
        with open(os.path.join(EXAMPLES, name)) as f:
            lines |= {line.strip() for line in f}
    quoted = [line.strip() for block in re.findall(r"^```py\n(.*?)^```", page, re.S | re.M)
              for line in block.splitlines()]
    assert len(quoted) > 25 and [line for line in quoted if line not in lines] == []


# -- the causal-LM loss and what for_accelerate checks, on the shared ranks ---------------------

def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=62, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=32))


def _labels_loss(local: bool):
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = _llama()
    ids = torch.randint(0, 62, (2, 9))
    ids[0, 3] = -100
    expected = model(ids.clamp(min=0), labels=ids).loss
    expected.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plan = tpfn.from_hf(model.tp_plan, model).override({"lm_head": tpfn.colwise(local=local)})
    shared = model.config
    tpfn.for_accelerate(tpfn.parallelize(model, mesh(2), plan))
    assert model.config is not shared and getattr(shared, "distributed_config", None) is None  # as it was
    assert all(m.config is model.config for m in model.modules() if "config" in m.__dict__)
    loss = model(ids.clamp(min=0), labels=ids).loss
    loss.backward()
    assert torch.allclose(loss, expected, atol=1e-6), (loss, expected)
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert torch.allclose(g, grads[name], atol=1e-6), name
    # the Trainer's count of the batch's tokens: a sum over it
    logits = model(ids.clamp(min=0)).logits
    n = (ids[:, 1:] != -100).sum()
    whole = logits.full_tensor() if hasattr(logits, "full_tensor") else None
    if whole is not None:
        assert torch.allclose(tpfn.causal_lm_loss(logits, ids, 62, num_items_in_batch=n),
                              ForCausalLMLoss(whole, ids, 62, num_items_in_batch=n), atol=1e-6)
    held = model.config.distributed_config
    return type(held).__name__, held.tp_size, held.dp_size, model.tp_size


def test_labels_compute_the_vocab_parallel_loss_where_the_logits_stay_sharded(ranks2):
    # A DTensor head (colwise(local=False)) and a local slice (colwise()): outputs and gradients;
    # the degree recorded as transformers records it, on a config of the model's own.
    assert ranks2.run(_labels_loss, False) == [("DistributedConfig", 2, 1, 2)] * 2
    ranks2.run(_labels_loss, True)


def _refused_labels():
    model = _llama()
    model.loss_type = "ForMaskedLM"  # a loss tpfn does not compute on shards
    plan = tpfn.from_hf(model.tp_plan, model).override({"lm_head": tpfn.colwise(local=False)})
    tpfn.for_accelerate(tpfn.parallelize(model, mesh(2), plan))
    ids = torch.randint(0, 62, (2, 9))
    with pytest.raises(ValueError, match=r"its loss \(ForMaskedLM\) is transformers' own.*tpfn.cross_entropy"):
        model(ids, labels=ids)
    assert model(ids).logits.placements[0].dim == 2  # without labels=, the sharded logits


def test_a_loss_tpfn_cannot_compute_on_sharded_logits_is_refused_naming_cross_entropy(ranks2):
    ranks2.run(_refused_labels)


def _data_ranks_apart():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    grid = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_shard", "tp"))
    model = tpfn.parallelize(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)), grid["tp"], {"0": tpfn.colwise()})
    with pytest.raises(ValueError, match=r"2 ranks and a tensor-parallel degree of 1, so 2 data-parallel "
                                         r"ranks, but '0.weight', '0.bias', '1.weight' and 1 more are not "
                                         r"sharded over them: .*fully_shard\(model, mesh=mesh\['dp_shard'\]\)"):
        tpfn.for_accelerate(model)
    assert not hasattr(model, "tp_size")  # nothing half-done
    fully_shard(model, mesh=grid["dp_shard"])
    return tpfn.for_accelerate(model).tp_size


def test_for_accelerate_refuses_data_ranks_nothing_keeps_in_step(ranks2):
    # accelerate's tensor-parallel path sums no gradients over data ranks: FSDP2 must.
    assert ranks2.run(_data_ranks_apart) == [1, 1]


def _unequal_parts():
    model = _llama()
    shared = model.config
    plan = tpfn.from_hf(model.tp_plan, model).override(  # gate_proj as if it packed three unequal parts
        {"model.layers.*.mlp.gate_proj": tpfn.colwise(parts=(32, 16, 16))})
    tpfn.parallelize(model, mesh(2), plan)
    with pytest.raises(ValueError, match=r"for_accelerate: 'model.layers.0.mlp.gate_proj.weight' is packed of "
                                         r"unequal parts .*full_tensor\(\) and write the parts out of order.*"
                                         r"tpfn.save_pretrained"):
        tpfn.for_accelerate(model)
    assert model.config is shared and model.tp_size is None  # nothing half-done


def test_for_accelerate_refuses_unequal_parts_transformers_would_save_out_of_order(ranks2):
    ranks2.run(_unequal_parts)


def test_for_accelerate_refuses_a_model_tpfn_did_not_parallelize():
    with pytest.raises(ValueError, match="not parallelized by tpfn"):
        tpfn.for_accelerate(nn.Linear(2, 2))


# -- PEFT: LoRA adapters sharded by their base layer's style ----------------------------------

LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # column- and row-wise bases


def _lora_llama():
    from peft import LoraConfig, get_peft_model

    model = _llama()
    torch.manual_seed(1)  # B random too (init_lora_weights=False), so that every adapter weight counts
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    return model, get_peft_model(model, config)


def _lora_steps(peft_model, steps: int = 3) -> list:
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    losses, ids = [], torch.randint(0, 62, (2, 12), generator=torch.Generator().manual_seed(2))
    for _ in range(steps):  # one batch: its loss falls
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _lora_training(directory: str):
    import torch.distributed as dist
    from peft import PeftModel

    _, single = _lora_llama()
    expected = _lora_steps(single)
    inner, peft_model = _lora_llama()
    plan = tpfn.from_hf(inner.tp_plan, inner)  # LoRA first, then the plan: with_lora inside
    assert plan.rules[dict(plan.rules).__len__() - 1][0] == "model.layers.*.self_attn.v_proj.lora_B.*"
    tpfn.parallelize(inner, mesh(2), plan)
    q = inner.model.layers[0].self_attn.q_proj
    o = inner.model.layers[0].self_attn.o_proj
    assert q.lora_B["default"].weight.placements[0].dim == 0 and not hasattr(q.lora_A["default"].weight, "placements")
    assert o.lora_A["default"].weight.placements[0].dim == 1 and not hasattr(o.lora_B["default"].weight, "placements")
    assert not q.base_layer.weight.requires_grad  # frozen as PEFT left it
    losses = _lora_steps(peft_model)
    assert max(abs(a - b) / b for a, b in zip(losses, expected)) <= 1e-5, (losses, expected)
    err = max(max_rel_err(peft_model, single).values())
    assert err <= 1e-5, err  # test_dp_tp's bar for three AdamW steps
    full = tpfn.checkpoint.full_state_dict(peft_model)
    peft_model.save_pretrained(directory, state_dict=full, is_main_process=dist.get_rank() == 0)
    dist.barrier()
    plain = _llama()
    reloaded = PeftModel.from_pretrained(plain, directory)  # PEFT alone, one device
    adapters = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert len(adapters) == 2 * len(LORA_TARGETS) and all(torch.equal(p, full[n]) for n, p in adapters.items())
    return losses


def test_lora_adapters_shard_by_their_base_and_train_as_one_device(ranks2, tmp_path):
    # A replicated and B column-wise on q, v and up; A row-wise and B replicated on o and down:
    # three AdamW steps, every adapter weight, and an adapter PEFT reads back on one device.
    a, b = ranks2.run(_lora_training, str(tmp_path / "adapter"))
    assert a == b and a[-1] < a[0]
    assert sorted(os.listdir(tmp_path / "adapter")) == ["README.md", "adapter_config.json",
                                                        "adapter_model.safetensors"]


def _lora_at_more_ranks_than_kv_heads():
    _, single = _lora_llama()
    expected = _lora_steps(single)
    inner, peft_model = _lora_llama()
    plan = tpfn.from_hf(inner.tp_plan, inner)
    tpfn.parallelize(inner, mesh(4), plan)
    v = inner.model.layers[0].self_attn.v_proj
    held = [v.base_layer.weight.to_local().shape, v.lora_B["default"].weight.to_local().shape]
    losses = _lora_steps(peft_model)
    return held, max(abs(a - b) / b for a, b in zip(losses, expected)), max(max_rel_err(peft_model, single).values())


def test_lora_on_kv_projections_at_more_ranks_than_kv_heads_trains_as_one_device(ranks4):
    # 2 KV heads of 8 features on 4 ranks: v_proj's base and lora_B hold one head per rank pair,
    # as k_proj (no adapter) does; 1e-5 is test_dp_tp's bar for three AdamW steps.
    for held, loss_err, err in ranks4.run(_lora_at_more_ranks_than_kv_heads):
        assert held == [(8, 32), (8, 4)] and loss_err <= 1e-5 and err <= 1e-5, (held, loss_err, err)


class _Lora(nn.Module):
    """PEFT's shape of a LoRA layer, for the refusals."""

    def __init__(self, base, dropout=0.0, dora=False):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(8, 2, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(2, 8, bias=False)})
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(dropout) if dropout else nn.Identity()})
        self.lora_magnitude_vector = nn.ModuleDict({"default": nn.Linear(1, 1)} if dora else {})


def test_with_lora_refuses_what_would_compute_wrongly_all_at_once():
    from tpfn import PlanError, Shard, colwise, prepare_in, prepare_out, rowwise

    model = nn.ModuleDict({"emb": _Lora(nn.Embedding(8, 8)), "dora": _Lora(nn.Linear(8, 8), dora=True),
                           "drop": _Lora(nn.Linear(8, 8), dropout=0.1), "sp": _Lora(nn.Linear(8, 8)),
                           "rs": _Lora(nn.Linear(8, 8)), "rep": _Lora(nn.Linear(8, 8))})
    plan = {"emb": rowwise(), "dora": colwise(), "drop": rowwise(), "sp": prepare_in(Shard(1)) >> colwise(),
            "rs": rowwise() >> prepare_out(Shard(1)), "rep": tpfn.replicate()}
    with pytest.raises(PlanError) as e:
        tpfn.with_lora(plan, model)
    text = str(e.value)
    assert "(6 problems)" in text
    assert "'emb' (_Lora) is a LoRA layer on Embedding; tpfn shards LoRA layers on nn.Linear" in text
    assert "'dora' (_Lora) holds a LoRA variant (DoRA)" in text
    assert "'drop' (_Lora): LoRA dropout on a row-wise base would draw on each rank's slice" in text
    assert "takes its input as Shard(dim=1), so lora_A, replicated, would see one rank's slice" in text
    assert "hands on its output as Shard(dim=1), so lora_B, replicated, would see one rank's part" in text
    assert "'rep' (_Lora) is a LoRA layer bound to replicate()" in text
    assert tpfn.with_lora({"drop": colwise()}, model) == tpfn.plan(  # replicated input: one mask
        {"drop.base_layer": colwise(), "drop.lora_B.*": colwise()})


def test_a_lora_layer_bound_as_it_is_points_to_with_lora():
    from tpfn import PlanError, colwise

    with pytest.raises(PlanError, match=r"not _Lora \(tests.test_integrations._Lora, which wraps its "
                                        r"'base_layer'\): pass the plan through tpfn.with_lora\(plan, model\)"):
        tpfn.resolve({"0": colwise()}, nn.Sequential(_Lora(nn.Linear(8, 8))))


def test_with_lora_keeps_the_notes_of_the_rules_it_keeps():
    from tpfn import colwise

    model = nn.ModuleDict({"drop": _Lora(nn.Linear(8, 8)), "plain": nn.Linear(8, 8)})
    plan = tpfn.plan({"drop": colwise(), "plain": colwise()}).noted(
        {None: "the whole plan", "drop": "split into its base and adapters", "plain": "as it was"})
    assert dict(tpfn.with_lora(plan, model).notes) == {None: "the whole plan", "plain": "as it was"}
