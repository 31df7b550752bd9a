"""tpfn.suggest on models outside transformers' text models, built from constructors and
configs (nothing downloaded), on 2 and 4 gloo ranks against one device: the output and every
gradient, the share of parameter bytes sharded and the collectives of one step (the plan's
header, which is what ``tpfn.explain`` counts).

    python tools/shaped_sweep.py             # every model below
    python tools/shaped_sweep.py resnet vit  # some of them
    python tools/shaped_sweep.py --docs      # and rewrite the table in docs/suggest.md

The models: ``tests/shaped.py``'s (spelled as timm, torchvision, nanoGPT, Mamba and torch's
``nn.Transformer`` write them) and transformers' vision and audio models (ViT, Swin,
ConvNeXt, ResNet, CLIP with images, Whisper), state-space and recurrent models (Mamba,
FalconMamba, RWKV), tiny.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT] if ROOT not in sys.path else []
DOC = os.path.join(ROOT, "docs", "suggest.md")


def _hf(name: str):
    """``(model, inputs)`` of a transformers vision, audio or state-space model, tiny."""
    import torch
    import transformers as hf

    image = {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))}
    vit = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
               patch_size=8)
    mamba = dict(hidden_size=32, state_size=4, num_hidden_layers=2, vocab_size=64, intermediate_size=64,
                 time_step_rank=4, conv_kernel=4)
    ids = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))}
    builds = {
        "hf_vit": lambda: (hf.ViTForImageClassification(hf.ViTConfig(**vit, num_labels=10)), image),
        "hf_swin": lambda: (hf.SwinForImageClassification(hf.SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
            num_labels=10)), image),
        "hf_convnext": lambda: (hf.ConvNextForImageClassification(hf.ConvNextConfig(
            num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], num_labels=10)), image),
        "hf_resnet": lambda: (hf.ResNetForImageClassification(hf.ResNetConfig(
            embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2], num_labels=10)), image),
        "hf_clip": lambda: (hf.CLIPModel(hf.CLIPConfig(
            text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             vocab_size=64, max_position_embeddings=32),
            vision_config=dict(vit, image_size=32, patch_size=8), projection_dim=16)),
            {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)), **image}),
        "hf_whisper": lambda: (hf.WhisperModel(hf.WhisperConfig(
            d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
            max_target_positions=32, vocab_size=64, pad_token_id=0, decoder_start_token_id=0)),
            {"input_features": torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)),
             "decoder_input_ids": torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1))}),
        "hf_mamba": lambda: (hf.MambaForCausalLM(hf.MambaConfig(**mamba)), ids),
        "hf_falcon_mamba": lambda: (hf.FalconMambaForCausalLM(hf.FalconMambaConfig(**mamba)), ids),
        "hf_rwkv": lambda: (hf.RwkvForCausalLM(hf.RwkvConfig(
            hidden_size=32, num_hidden_layers=2, vocab_size=64, attention_hidden_size=32, intermediate_size=64,
            context_length=16, use_cache=False)), ids),
    }
    torch.manual_seed(0)
    model, inputs = builds[name]()
    return model.eval(), inputs


def names() -> list:
    from tests import shaped

    return [*shaped.MODELS, "hf_vit", "hf_swin", "hf_convnext", "hf_resnet", "hf_clip", "hf_whisper", "hf_mamba",
            "hf_falcon_mamba", "hf_rwkv"]


def build(name: str):
    """``(model, inputs as a dict by name)``."""
    import inspect

    from tests import shaped

    if name.startswith("hf_"):
        return _hf(name)
    model = shaped.MODELS[name][0]()
    first = next(iter(inspect.signature(model.forward).parameters))
    return model, {first: shaped.example(name)}


def _step(model, inputs: dict, cotangent):
    """One forward and backward (the output's product with a random cotangent): the output, the
    first floating-point tensor the model returns (CLIP's ``logits_per_image``)."""
    import torch

    from tests import hf_zoo

    torch.manual_seed(0)
    out = model(**inputs)
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else [out]
    y = hf_zoo._full(next(v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()))
    (y * cotangent(y)).sum().backward()
    return y.detach()


def outcome(name: str, n: int) -> dict:
    """On each rank of ``n``: suggest's plan against one device (errors, share, header)."""
    import torch

    import tpfn
    from tests import hf_zoo
    from tests.ranks import mesh
    from tpfn.suggest.suggest import sharded_share

    hf_zoo.quiet()
    found = {"name": name}
    try:
        model, inputs = build(name)
        start = time.perf_counter()
        plan = tpfn.suggest(model, n, example_inputs=inputs)
        found["seconds"] = time.perf_counter() - start
        sharded, total = sharded_share(model, plan)
        found["share"] = sharded / total
        found["header"] = " ".join(line.strip("# ") for line in repr(plan).splitlines()[1:3])
        gen, made = torch.Generator().manual_seed(2), {}

        def cotangent(y):
            return made.setdefault(tuple(y.shape), torch.randn(y.shape, generator=gen, dtype=y.dtype))

        ref = copy.deepcopy(model)
        expected = _step(ref, inputs, cotangent)
        tp = tpfn.parallelize(copy.deepcopy(model), mesh(n), plan, src_rank=None)
        found["run"] = hf_zoo.errors(tp, ref, _step(tp, inputs, cotangent), expected)
    except Exception as e:  # noqa: BLE001 - reported in the table
        found["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return found


def _row(two: dict, four: dict) -> str:
    from tests import hf_zoo

    def parity(f):
        return f"error: {f['error']}" if "error" in f else "yes" if hf_zoo.at_parity(f.get("run")) else (
            f"no ({hf_zoo.worst(f['run'])})")
    header = two.get("header", "")
    counts = re.search(r"per step (.*?), [\d.]+ \w+ per rank", header)
    share = f"{round(100 * two['share'])}%" if "share" in two else "-"
    return (f"| `{two['name']}` | {parity(two)} | {parity(four)} | {share} | "
            f"{counts.group(1) if counts else '-'} | {two.get('seconds', 0):.1f} s |")


def table(rows: list) -> str:
    head = ("| model | 2 ranks at parity | 4 ranks at parity | parameter bytes sharded (2 ranks) | "
            "collectives per step (2 ranks) | suggest's time |\n|---|---|---|---|---|---|")
    return "\n".join([head, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="models (default: every one)")
    parser.add_argument("--docs", action="store_true", help="rewrite the table of docs/suggest.md")
    args = parser.parse_args()
    from tests.ranks import Ranks

    chosen = args.names or names()
    results = {}
    for n in (2, 4):
        with Ranks(n) as ranks:
            for name in chosen:
                results[name, n] = ranks.run(functools.partial(outcome, name, n), timeout=600)[0]
                print(f"{name} on {n} ranks: done", file=sys.stderr, flush=True)
    text = table([_row(results[name, 2], results[name, 4]) for name in chosen])
    print(text)
    if args.docs:
        page = open(DOC).read()
        page = re.sub(r"(<!-- table:shaped -->\n).*?(<!-- /table -->)",
                      lambda m: m.group(1) + text + "\n" + m.group(2), page, count=1, flags=re.S)
        with open(DOC, "w") as f:
            f.write(page)


if __name__ == "__main__":
    main()
