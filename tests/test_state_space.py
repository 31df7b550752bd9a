"""State-space blocks as channel-parallel blocks (Megatron's and vLLM's Mamba): the input
projection column-wise in its two parts (x and the gate z), the depthwise convolution and the
per-channel scan on each rank's channels (the mixer's ``A_log`` and ``D`` sharded on dim 0),
the output projection row-wise. ``x_proj`` contracts the channels into the scan's ``dt``, ``B``
and ``C``, which every channel reads: it computes whole on the gathered channels, and the
gradients the ranks' channels give its output are partial sums (its weight's summed at the end
of the backward, its input's reduce-scattered back to the channels). On 2 gloo ranks against
one device: the output and every gradient, and the collectives of one step counted exactly.
suggest finds the same plans (``tpfn.suggest.channels``), its header what explain counts; the
check proves them but for the depthwise convolution, which no rule of its types yet.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tpfn
from tests import shaped
from tests.test_suggest import comments, explained, header, notes
from tpfn import Partial, Replicate, Shard, colwise, on_shards, params, per_rank, plan, prepare_in, rowwise

TOL = 1e-5  # float32, one forward and backward against one device, as the neighbouring tests

# x_proj: whole on the gathered channels; the gradients the channels give its output are partial sums
X_PROJ = (prepare_in(Shard(-1), desired=Replicate(), local=True) >> params(weight=Replicate())
          >> on_shards(Replicate(), grads=Partial(), output=Replicate(), param_grads={"weight": Partial()}))


def shaped_plan():
    """tests/shaped.py's Mamba: its mixer reads ``self.d_inner`` for the scan's state, and calls
    ``conv1d`` and ``dt_proj`` as modules."""
    return plan({
        "layers.*.mixer": params(A_log=Shard(0), D=Shard(0)) >> on_shards(Replicate())
        >> per_rank("d_inner"),
        "layers.*.mixer.in_proj": colwise(parts=2),
        "layers.*.mixer.conv1d": params(weight=Shard(0), bias=Shard(0)) >> on_shards(Shard(1), output=Shard(1))
        >> per_rank("groups"),
        "layers.*.mixer.x_proj": X_PROJ,
        "layers.*.mixer.dt_proj": prepare_in(Replicate(), grads=Partial(), local=True) >> colwise(),
        "layers.*.mixer.out_proj": rowwise(),
    })


def hf_plan():
    """transformers' MambaMixer (the torch path): its forward reads ``conv1d``'s and ``dt_proj``'s
    parameters itself, so the mixer holds them, and its widths come from its inputs' shapes."""
    channels = ("A_log", "D", "conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias")
    return plan({
        "backbone.layers.*.mixer": params(**dict.fromkeys(channels, Shard(0)))
        >> on_shards(Replicate()),
        "backbone.layers.*.mixer.in_proj": colwise(parts=2),
        "backbone.layers.*.mixer.x_proj": X_PROJ,
        "backbone.layers.*.mixer.out_proj": rowwise(),
    })


def hf_mamba():
    import transformers as hf

    hf.logging.set_verbosity_error()
    torch.manual_seed(0)
    return hf.MambaForCausalLM(hf.MambaConfig(hidden_size=32, state_size=4, num_hidden_layers=2, vocab_size=64,
                                              intermediate_size=64, time_step_rank=4, conv_kernel=4))


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, embeds):
        return self.model(inputs_embeds=embeds).logits


def rwkv():
    import transformers as hf

    hf.logging.set_verbosity_error()
    torch.manual_seed(0)
    return hf.RwkvForCausalLM(hf.RwkvConfig(hidden_size=32, num_hidden_layers=2, vocab_size=64, attention_hidden_size=32,
                                            intermediate_size=64, context_length=16))


def _steps(n: int) -> dict:
    from tests.models import one_step
    from tests.ranks import mesh

    found = {}
    ref = shaped.MODELS["mamba"][0]()
    found["mamba"] = one_step(tpfn.parallelize(copy.deepcopy(ref), mesh(n), shaped_plan()), ref,
                              shaped.example("mamba"))
    ref = _Logits(hf_mamba())
    hf = plan({f"model.{k}": v for k, v in hf_plan().rules})
    embeds = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    found["hf_mamba"] = one_step(tpfn.parallelize(copy.deepcopy(ref), mesh(n), hf), ref, embeds)
    ref = rwkv()
    ref.rwkv.embeddings = torch.nn.Identity()  # (its input: the embeddings, whose gradient is compared)
    ref = _Logits(ref)
    found["rwkv"] = one_step(tpfn.parallelize(copy.deepcopy(ref), mesh(n), tpfn.suggest(ref, n, example_inputs=embeds)),
                             ref, embeds)
    return found


def test_a_mamba_mixer_is_one_channel_parallel_block_at_one_devices_numbers(ranks2):
    found = ranks2.run(_steps, 2)[0]
    for name, (errors, forward, backward) in found.items():
        worst = max(errors.items(), key=lambda kv: kv[1])
        assert worst[1] < TOL, (name, worst)
        # per mixer: forward x_proj's input gathered (and its global shape agreed: one more
        # all-gather, of sizes), out_proj's partial sums all-reduced; backward x_proj's input
        # gradient reduce-scattered, in_proj's input gradient all-reduced, and the partial
        # gradients of both x_proj weights summed in one all-reduce at the end
        if name == "rwkv":  # per block: the time mixing's output all-reduced forward, its key's, value's and
            # receptance's input gradients backward; the channel mixing's pair: value's forward, key's backward;
            # the head sharded alone: its output gathered, its input's gradient all-reduced
            assert (forward, backward) == ({"all_reduce": 4, "all_gather": 1}, {"all_reduce": 9}), name
            continue
        assert (forward, backward) == ({"all_gather": 4, "all_reduce": 2},
                                       {"reduce_scatter": 2, "all_reduce": 3}), name


@pytest.mark.parametrize("name", ["mamba", "hf_mamba"])
def test_suggest_shards_a_mamba_mixer_as_one_channel_parallel_block(name):
    model, inputs, hand = ((shaped.MODELS["mamba"][0](), shaped.example("mamba"), shaped_plan()) if name == "mamba"
                           else (hf_mamba(), {"input_ids": (2, 6)}, hf_plan()))
    p = tpfn.suggest(model, 2, example_inputs=inputs)
    assert p.rules == hand.rules
    assert "a channel-parallel block: in_proj (2 parts of 64) column-wise; conv1d, A_log, D and the scan on " \
           "each rank's channels; x_proj whole on the gathered channels; out_proj row-wise" in " ".join(
               comments(p).replace("#", " ").split())
    assert header(p) == explained(model, p, inputs) == ({"all_gather": 2, "all_reduce": 5, "reduce_scatter": 2},
                                                        "18.0 KiB")
    assert not any("conv1d" in k or "dt_proj" in k for k in notes(p) if k)  # (held by the block, never "left whole")


def test_a_block_whose_channels_the_ranks_do_not_split_stays_whole_with_the_reason():
    p = tpfn.suggest(shaped.MODELS["mamba"][0](), 3, example_inputs=shaped.example("mamba"))
    assert notes(p)["layers.*.mixer"].startswith(
        "left whole: 'layers.*.mixer' (MambaMixer): its 64 channels do not split evenly over 3 ranks; ")
    assert "layers.*.mixer.A_log" not in str(p.rules)


def test_the_check_proves_the_blocks_but_their_convolution_and_names_an_unsummed_gradient():
    found = tpfn.check(shaped.MODELS["mamba"][0](), shaped_plan(), 2, shaped.example("mamba"))
    assert {(f.kind, f.op) for f in found.findings} == {("unproven", "aten.convolution.default")}
    # x_proj whole but handing back whole gradients: the partial ones its output gets are summed nowhere
    wrong = plan({**dict(shaped_plan().rules), "layers.*.mixer.x_proj": prepare_in(
        Shard(-1), desired=Replicate(), local=True) >> params(weight=Replicate()) >> on_shards(Replicate(),
                                                                                              output=Replicate())})
    found = tpfn.check(shaped.MODELS["mamba"][0](), wrong, 2, shaped.example("mamba"))
    assert any(f.kind == "wrong" and "computed from the output of 'layers.0.mixer.x_proj'" in f.why
               for f in found.findings)


def test_suggest_shards_rwkvs_time_mixing_on_its_channels_and_finds_no_block_in_a_convnext_or_vit_block():
    p = tpfn.suggest(rwkv(), 2, example_inputs={"input_ids": (2, 6)})
    assert {k: v for k, v in p.rules if "attention" in k} == {
        "rwkv.blocks.*.attention": params(time_decay=Shard(0), time_first=Shard(0), **dict.fromkeys(
            ("time_mix_key", "time_mix_receptance", "time_mix_value"), Replicate())) >> on_shards(Replicate()),
        "rwkv.blocks.*.attention.key": colwise(), "rwkv.blocks.*.attention.value": colwise(),
        "rwkv.blocks.*.attention.receptance": colwise(), "rwkv.blocks.*.attention.output": rowwise()}
    assert "a channel-parallel block: key (32 channels), value (32 channels), receptance (32 channels) " \
           "column-wise; time_decay, time_first and the scan on each rank's channels; output row-wise" in " ".join(
               comments(p).replace("#", " ").split())
    from tpfn.suggest.channels import blocks
    assert blocks(shaped.CNBlock(8), 2) == [] and blocks(shaped.TimmBlock(8, 2), 2) == []
