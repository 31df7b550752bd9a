"""How long ``tpfn.suggest`` takes on Llama-3 shapes built on meta (nothing downloaded).

``python tools/suggest_speed.py`` runs suggest once on a 2-layer model (Python's imports and
torch's first calls), then times Llama-3-8B (32 layers) and Llama-3-70B (80 layers) on 8
ranks, each the best of ``--repeats`` runs, and prints the seconds and the plan's header.
A stack of equal blocks is traced and checked as two blocks (``tpfn.analysis.repeats``), so
the time hardly grows with the layers.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers as hf

import tpfn

SHAPES = {
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256),
    "Llama-3-70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256),
}


def build(**config) -> torch.nn.Module:
    with torch.device("meta"):
        return hf.LlamaForCausalLM(hf.LlamaConfig(**config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    hf.logging.set_verbosity_error()
    tpfn.suggest(build(**{**SHAPES["Llama-3-8B"], "num_hidden_layers": 2}), args.ranks)  # warm
    for name, config in SHAPES.items():
        model, best = build(**config), float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = tpfn.suggest(model, args.ranks)
            best = min(best, time.perf_counter() - start)
        header = " ".join(line.strip("# ") for line in repr(plan).splitlines()[1:3])
        print(f"{name} ({config['num_hidden_layers']} layers, {args.ranks} ranks): {best:.2f} s; {header}")


if __name__ == "__main__":
    main()
