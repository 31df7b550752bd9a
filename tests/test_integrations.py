"""Where users train: transformers' Trainer and accelerate, Lightning, PEFT; each against one process.

Trainer and accelerate keep one state per process and read torchrun's environment, so their
runs start processes of their own (``examples/train_hf.py``, as a user would run it), each
ended by its process group when it outlasts its time.
"""

import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import tpfn
from tests.ranks import mesh
from tests.test_examples import EXAMPLES

ROOT = os.path.dirname(EXAMPLES)


def _script(*args, timeout: float = 240) -> str:
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


def test_trainer_and_accelerate_match_one_process_on_tp_and_dp_x_tp_meshes(tmp_path):
    # The script compares every loss and gradient norm (max_grad_norm clips across meshes)
    # with the same runs in one process, and exits non-zero where they part.
    reference = str(tmp_path / "one-process.json")
    out = _script("train_hf.py", "--nproc", "2", "--reference", reference)
    assert "trainer: losses" in out and "accelerate: losses" in out and "on a 1 x 2 mesh" in out
    assert os.path.exists(reference)
    out = _script("train_hf.py", "--nproc", "4", "--dp", "2", "--reference", reference)
    assert "on a 2 x 2 mesh" in out


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
    tpfn.for_accelerate(tpfn.parallelize(model, mesh(2), plan))
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
    return model.config.distributed_config


def test_labels_compute_the_vocab_parallel_loss_where_the_logits_stay_sharded(ranks2):
    # A DTensor head (colwise(local=False)) and a local slice (colwise()): outputs and gradients.
    assert ranks2.run(_labels_loss, False) == [{"tp_size": 2}] * 2
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


def test_for_accelerate_refuses_a_model_tpfn_did_not_parallelize():
    with pytest.raises(ValueError, match="not parallelized by tpfn"):
        tpfn.for_accelerate(nn.Linear(2, 2))
