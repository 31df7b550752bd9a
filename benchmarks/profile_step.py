"""Where tpfn's step time goes, against the hand-written baseline (not part of ``run.py``).

    python -m benchmarks.profile_step [reference|llama] [--sp] [--steps N] [--cpu]
    python -m benchmarks.profile_step llama --layers    # HF's layer code against the hand-written
    python -m benchmarks.profile_step llama --sp --fake   # each version's own work, deterministic

On 2 gloo ranks, the same model as ``benchmarks.step_time``, tpfn's recommended plan against
``benchmarks.handwritten``:

1. phases, unprofiled: forward, backward, optimizer step of each variant, medians of
   interleaved steps (rank 0's clock; both ranks run the same collectives); ``--cpu`` reads
   the process's CPU time instead of the wall clock, which a loaded machine disturbs less
   (it counts work, gloo's threads included, and leaves out the waits);
2. the optimizer step alone, on one rank's parameters, interleaved: Adam over the DTensor
   parameters against Adam over plain tensors of the same local shapes (gradients set once),
   for-loop, foreach and fused;
3. cProfile of rank 0 over the same steps, tpfn's functions grouped by what they do
   (self time, microseconds per step; cProfile inflates Python-heavy code, so read the
   groups against each other and against the profiled total).

``--fake`` instead times forward and backward in this one process, as rank 0 of 2 on a fake
process group: the same calls, collectives included, with no other rank to wait for, so the
difference is tpfn's own work (steadier than any figure measured across two processes).

``--layers`` (Llama) instead times, in one process with no collectives, what HF's own layer
code costs against the hand-written version's leaner layers: ``LlamaForCausalLM`` built at
one rank's local sizes (half the heads, the MLP and the vocabulary) against
``HandLlama`` with its collectives left out, CPU time of forward and backward, interleaved.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
import time

import torch

from benchmarks import step_time
from benchmarks.common import interleaved

_VIEWS = ("_View", "_grads", "grad_spec", "view", "forward", "backward")  # moves.py from _View on

GROUPS = (  # (label, predicate on (file, line, function)); first match wins; self time
    ("Runtime.__call__, the context of a call (parallelize.py)",
     lambda f, line, n: f.endswith("tpfn/interpret/parallelize.py")),
    ("the reference route: Call, inputs, convert, outputs (reference.py, prepare.py)",
     lambda f, line, n: f.endswith(("tpfn/interpret/reference.py", "tpfn/interpret/prepare.py"))),
    ("param views: _View fwd/bwd, view, grad_spec (moves.py)",
     lambda f, line, n: f.endswith("tpfn/interpret/moves.py") and n in _VIEWS and line >= _view_line()),
    ("moves: move, _Move, Move, program, placements (moves.py, bounded.py)",
     lambda f, line, n: f.endswith(("tpfn/interpret/moves.py", "tpfn/bounded.py"))),
    ("the linear kernel and its column group (kernels/linear.py)",
     lambda f, line, n: "tpfn/kernels/" in f),
    ("shape memory: Shapes, recall (state.py, _torch.py)",
     lambda f, line, n: (f.endswith("tpfn/interpret/state.py") and not n.startswith((
         "_accum", "_hook", "_reached", "_reduce", "_param", "_partial", "params", "arm", "watch",
         "running", "join", "__call__")))
     or (f.endswith("tpfn/_torch.py") and "Weak" in n) or f.endswith("weakref.py")),
    ("partial-grad flush and hooks (state.py PartialGrads)",
     lambda f, line, n: f.endswith("tpfn/interpret/state.py")),
    ("other tpfn", lambda f, line, n: "/tpfn/" in f),
    ("DTensor internals (torch/distributed/tensor)", lambda f, line, n: "torch/distributed/tensor" in f),
    ("torch.distributed collectives (python side)",
     lambda f, line, n: "torch/distributed" in f or "c10d" in n or "all_reduce" in n
     or "all_gather" in n or "reduce_scatter" in n or "wait_tensor" in n),
    ("optimizer python (torch/optim)", lambda f, line, n: "torch/optim" in f),
    ("benchmarks.handwritten", lambda f, line, n: f.endswith("benchmarks/handwritten.py")),
    ("torch autograd / nn python", lambda f, line, n: "/torch/" in f),
    ("builtins and C ops (matmul, sdpa, ...)", lambda f, line, n: True),
)


def _group(file: str, line: int, name: str) -> str:
    return next(label for label, test in GROUPS if test(file, line, name))


@functools.lru_cache(maxsize=None)
def _view_line() -> int:
    """The first line of the parameter views in moves.py (``_View`` and what follows it)."""
    import inspect

    from tpfn.interpret import moves

    return inspect.getsourcelines(moves._View)[1]


def _build(model_name: str, sp: bool):
    import tpfn
    from benchmarks.handwritten import Comm, HandLlama, HandTransformer
    from tests.models import local_heads
    from tests.ranks import mesh

    m = mesh(2)
    build, _, recommended = (step_time._reference if model_name == "reference"
                             else step_time._llama)(sp)
    best = build()
    tp = tpfn.parallelize(best, m, recommended if recommended is not None
                          else tpfn.from_hf(best.tp_plan, best))
    if model_name == "reference":
        local_heads(tp, 2)
    hand = (HandTransformer if model_name == "reference" else HandLlama)(build(), Comm(), sp)
    return {"tpfn": tp, "hand-written": hand}


def _phased_step(model, opt, tokens, target, clock: dict | None, now=time.perf_counter):
    from torch.distributed.tensor.experimental import implicit_replication

    finish = getattr(model, "finish_backward", None)
    t0 = now()
    opt.zero_grad(set_to_none=True)
    loss = step_time._loss(model, tokens, target)
    t1 = now()
    loss.backward()
    if finish is not None:
        finish()
    t2 = now()
    with implicit_replication():
        opt.step()
    t3 = now()
    if clock is not None:
        clock["forward"].append(t1 - t0)
        clock["backward"].append(t2 - t1)
        clock["optimizer"].append(t3 - t2)
        clock["step"].append(t3 - t0)


def _profile(model_name: str, sp: bool, steps: int, cpu: bool = False) -> dict:
    now = time.process_time if cpu else time.perf_counter
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    models = _build(model_name, sp)
    opts = {k: torch.optim.Adam(v.parameters(), lr=1e-4) for k, v in models.items()}
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, step_time.VOCAB, (step_time.BATCH, step_time.SEQ), generator=gen),
                torch.randint(0, step_time.VOCAB, (step_time.BATCH, step_time.SEQ), generator=gen))
               for _ in range(steps + 3)]
    clocks = {k: {p: [] for p in ("forward", "backward", "optimizer", "step")} for k in models}
    for i, (tokens, target) in enumerate(batches):  # 1. phases, interleaved
        for name in (list(models) if i % 2 else list(models)[::-1]):
            dist.barrier()
            _phased_step(models[name], opts[name], tokens, target,
                         clocks[name] if i >= 3 else None, now)
    phases = {k: {p: statistics.median(v) * 1e6 for p, v in c.items()} for k, c in clocks.items()}

    # 2. the optimizer alone on this rank's parameters (no collective: every gradient is
    # laid out as its parameter, so DTensor's Adam ops are local).
    params = [p for p in models["tpfn"].parameters()]
    plain = [torch.nn.Parameter(p.to_local().detach().clone() if isinstance(p, DTensor)
                                else p.detach().clone()) for p in params]
    for p, q in zip(params, plain):
        g = torch.randn(q.shape)
        q.grad = g.clone()
        p.grad = DTensor.from_local(g.clone(), p.device_mesh, p.placements, run_check=False,
                                    shape=p.shape, stride=p.stride()) if isinstance(p, DTensor) else g
    variants = {}
    for how in ("for-loop", "foreach", "fused"):
        kw = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[how]
        split = [{"params": [p for p in params if isinstance(p, DTensor)]},
                 {"params": [p for p in params if not isinstance(p, DTensor)]}]
        for kind, ps in (("DTensor", params), ("DTensor, 2 groups", split), ("plain", plain)):
            try:
                opt = torch.optim.Adam(ps, lr=1e-4, **kw)
                opt.step()
            except Exception as error:  # noqa: BLE001 - reported as the figure
                variants[f"Adam {how}, {kind}"] = f"fails: {type(error).__name__}: {str(error)[:80]}"
                continue
            variants[f"Adam {how}, {kind}"] = opt.step
    runnable = {k: v for k, v in variants.items() if callable(v)}
    timed = interleaved(runnable, repeats=15, calls=3)
    optim = {k: (timed[k] * 1e6 if k in timed else v) for k, v in variants.items()}
    dtensors = sum(isinstance(p, DTensor) for p in params)

    # 3. cProfile of rank 0 (rank 1 runs the same steps unprofiled)
    profiles = {}
    for name in models:
        profiler = cProfile.Profile() if dist.get_rank() == 0 else None
        dist.barrier()
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        for tokens, target in batches[3:]:
            _phased_step(models[name], opts[name], tokens, target, None)
        if profiler:
            profiler.disable()
        total = (time.perf_counter() - start) / steps * 1e6
        if profiler is None:
            continue
        stats = pstats.Stats(profiler)
        groups: dict = {}
        top: list = []
        for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items():
            label = _group(file, line, fn)
            groups[label] = groups.get(label, 0.0) + tt / steps * 1e6
            if "/tpfn/" in file or "torch/distributed/tensor" in file or "torch/optim" in file:
                top.append((tt / steps * 1e6, ct / steps * 1e6, nc / steps,
                            f"{file.split('site-packages/')[-1].split('/main/')[-1]}:{line}:{fn}"))
        top.sort(reverse=True)
        cum = {}
        for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items():
            short = f"{file.split('site-packages/')[-1].split('/main/')[-1]}:{line}:{fn}"
            if "/tpfn/" in file or fn in ("step", "backward", "_call_impl"):
                cum[short] = (ct / steps * 1e6, nc / steps)
        profiles[name] = {"total us": total, "groups": groups, "top": top[:40],
                          "cum": sorted(cum.items(), key=lambda kv: -kv[1][0])[:40]}
    return {"phases": phases, "optimizer": optim, "params": len(params), "dtensors": dtensors,
            "profiles": profiles}


def _layers(steps: int) -> dict:
    """CPU us per step of forward and backward: HF's Llama at local sizes, the hand-written one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.handwritten import Comm, HandLlama

    torch.set_num_threads(1)
    build, _, _ = step_time._llama(False)
    full = build()
    c = full.config
    local = LlamaConfig(vocab_size=c.vocab_size // 2, hidden_size=c.hidden_size,
                        intermediate_size=c.intermediate_size // 2, num_hidden_layers=c.num_hidden_layers,
                        num_attention_heads=c.num_attention_heads // 2,
                        num_key_value_heads=c.num_key_value_heads // 2, head_dim=c.head_dim,
                        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False)
    hf = LlamaForCausalLM(local)
    hf.config._attn_implementation = "sdpa"
    comm = Comm(real=False, n=2, rank=0)  # two ranks' local sizes, no process group: nothing is sent
    models = {"HF layers": hf, "hand-written layers": HandLlama(full, comm, False)}
    tokens = torch.randint(0, local.vocab_size, (step_time.BATCH, step_time.SEQ))
    times: dict = {k: {"forward": [], "backward": []} for k in models}
    for i in range(steps + 3):
        for name in (list(models) if i % 2 else list(models)[::-1]):
            t0 = time.process_time()
            out = models[name](tokens)
            t1 = time.process_time()
            getattr(out, "logits", out).float().sum().backward()
            t2 = time.process_time()
            if i >= 3:
                times[name]["forward"].append(t1 - t0)
                times[name]["backward"].append(t2 - t1)
    return {k: {p: statistics.median(v) * 1e6 for p, v in t.items()} for k, t in times.items()}


def _fake(model_name: str, sp: bool, steps: int) -> dict:
    """CPU us per step of forward and backward, tpfn against the hand-written version, as rank 0
    of 2 on a fake process group in this process: every collective is the same call with no
    other rank to wait for, so the gap is each version's own work, undisturbed by the other."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.set_num_threads(1)
        models = _build(model_name, sp)
        gen = torch.Generator().manual_seed(0)
        tokens, target = (torch.randint(0, step_time.VOCAB, (step_time.BATCH, step_time.SEQ), generator=gen)
                          for _ in range(2))
        times: dict = {k: {"forward": [], "backward": []} for k in models}
        for i in range(steps + 3):
            for name in (list(models) if i % 2 else list(models)[::-1]):
                model, finish = models[name], getattr(models[name], "finish_backward", None)
                model.zero_grad(set_to_none=True)
                t0 = time.process_time()
                loss = step_time._loss(model, tokens, target)
                t1 = time.process_time()
                loss.backward()
                if finish is not None:
                    finish()
                t2 = time.process_time()
                if i >= 3:
                    times[name]["forward"].append(t1 - t0)
                    times[name]["backward"].append(t2 - t1)
    finally:
        dist.destroy_process_group()
    return {k: {p: statistics.median(v) * 1e6 for p, v in t.items()} for k, t in times.items()}


def _print_two(title: str, result: dict) -> None:
    names = list(result)
    print(title)
    print(f"{'phase':<12}" + "".join(f"{n:>22}" for n in names) + f"{'difference':>12}")
    for phase in ("forward", "backward"):
        v = [result[n][phase] for n in names]
        print(f"{phase:<12}" + "".join(f"{x:>22,.0f}" for x in v) + f"{v[0] - v[1]:>12,.0f}")


def main() -> None:
    from tests.ranks import Ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="reference", choices=("reference", "llama"))
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="phases in CPU time, not wall time")
    parser.add_argument("--layers", action="store_true",
                        help="llama: HF's layer code against the hand-written layers, one process")
    parser.add_argument("--fake", action="store_true",
                        help="each version's own work: rank 0 of 2 on a fake process group, one process")
    args = parser.parse_args()
    if args.layers:
        _print_two(f"== HF Llama's layers at one rank's local sizes, no collectives: CPU us, median of "
                   f"{args.steps}", _layers(args.steps))
        return
    if args.fake:
        _print_two(f"== {args.model}, sp {'on' if args.sp else 'off'}, rank 0 of 2 on a fake process group: "
                   f"CPU us, median of {args.steps}", _fake(args.model, args.sp, args.steps))
        return
    with Ranks(2) as ranks:
        result = ranks.run(_profile, args.model, args.sp, args.steps, args.cpu, timeout=900)[0]
    print(f"== {args.model}, sp {'on' if args.sp else 'off'}: phases, "
          f"{'CPU' if args.cpu else 'wall'} us per step (median of "
          f"{args.steps}, rank 0)")
    names = list(result["phases"])
    print(f"{'phase':<12}" + "".join(f"{n:>16}" for n in names) + f"{'tpfn - hand':>16}")
    for phase in ("forward", "backward", "optimizer", "step"):
        v = [result["phases"][n][phase] for n in names]
        print(f"{phase:<12}" + "".join(f"{x:>16,.0f}" for x in v) + f"{v[0] - v[1]:>16,.0f}")
    print(f"\n== optimizer step alone ({result['params']} parameters, {result['dtensors']} DTensors), "
          "us per step, interleaved")
    for k, v in result["optimizer"].items():
        print(f"  {k:<28} {v:>10,.0f}" if not isinstance(v, str) else f"  {k:<28} {v}")
    for name, prof in result["profiles"].items():
        print(f"\n== cProfile, {name}: {prof['total us']:,.0f} us per step profiled; self time by group")
        for label, us in sorted(prof["groups"].items(), key=lambda kv: -kv[1]):
            print(f"  {us:>10,.0f}  {label}")
        if name == "tpfn":
            print("  -- top functions (self us, cumulative us, calls per step)")
            for tt, ct, nc, where in prof["top"][:30]:
                print(f"  {tt:>8,.0f} {ct:>9,.0f} {nc:>6.0f}  {where}")
            print("  -- cumulative (us, calls per step)")
            for where, (ct, nc) in prof["cum"][:30]:
                print(f"  {ct:>9,.0f} {nc:>6.0f}  {where}")


if __name__ == "__main__":
    main()
