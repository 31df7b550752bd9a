"""Data x tensor parallelism: tpfn on mesh["tp"], FSDP2 on mesh["dp"], 4 ranks (2 x 2)."""

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import tpfn
from tests.models import clone, local_heads, max_rel_err, transformer, transformer_plan
from tests.ranks import mesh


def _dp_tp(sp: bool, clip, units=()):
    m = mesh(2, 2, names=("dp", "tp"))
    dp_rank = m["dp"].get_local_rank()
    ref = transformer(vocab_size=16, n_layers=2)
    model = local_heads(tpfn.parallelize(clone(ref), m["tp"], transformer_plan(sp)), 2)
    for layer in model.layers:
        for name in units:  # linears of their own FSDP units, inside the layer's
            fully_shard(layer.get_submodule(name), mesh=m["dp"])
        fully_shard(layer, mesh=m["dp"])
    fully_shard(model, mesh=m["dp"])
    optimizers = [torch.optim.AdamW(ref.parameters(), lr=0.01),
                  torch.optim.AdamW(model.parameters(), lr=0.01)]
    clips = [torch.nn.utils.clip_grad_norm_, clip]
    torch.manual_seed(3)
    norms = []
    for _ in range(3):
        tokens, target = torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8))
        # The single device sees the whole batch; each data-parallel rank its half.
        halves = (tokens, target), (tokens.chunk(2)[dp_rank], target.chunk(2)[dp_rank])
        for net, opt, clip_, (x, y) in zip((ref, model), optimizers, clips, halves):
            opt.zero_grad()
            F.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
            norm = clip_(net.parameters(), 1.0)
            norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
            opt.step()
    return norms, max(max_rel_err(model, ref).values())


def _check(results):
    for norms, err in results:
        single, parallel = norms[0::2], norms[1::2]
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(parallel, single)), norms
        assert single[0] > 1.0  # the clipping did clip
        assert err <= 1e-5


def test_dp_x_tp_with_sequence_parallel_matches_one_device(ranks4):
    # Every parameter is a DTensor on the 2-D mesh: torch's own clipping works.
    _check(ranks4.run(_dp_tp, True, torch.nn.utils.clip_grad_norm_))


def test_dp_x_tp_with_unbound_norms_clips_across_meshes(ranks4):
    # The norms no plan binds live on mesh["dp"] alone; tpfn.clip_grad_norm_ combines meshes.
    _check(ranks4.run(_dp_tp, False, tpfn.clip_grad_norm_))


def test_dp_x_tp_with_linears_in_units_of_their_own_matches_one_device(ranks4):
    # FSDP reduces a unit's gradients once its input gradient is in: a linear that is a unit
    # of its own keeps its weight gradient in its own node (not its window's, q's or w1's)
    _check(ranks4.run(_dp_tp, False, tpfn.clip_grad_norm_,
                      ("attention.wo", "attention.wk", "feed_forward.w2")))
