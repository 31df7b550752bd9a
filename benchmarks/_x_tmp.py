import torch, torch.nn as nn, time
from tests.ranks import Ranks

def _m():
    import cProfile, pstats, io
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import tpfn
    from benchmarks.hook_overhead import _HandMLP
    from benchmarks.handwritten import Comm
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    def mlp():
        torch.manual_seed(0); return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    t = tpfn.parallelize(mlp(), mesh, {"0": tpfn.colwise(), "2": tpfn.rowwise()})
    h = _HandMLP(mlp(), Comm())
    x = torch.randn(4, 64)
    res = {}
    with torch.no_grad():
        for name, m in (("tpfn", t), ("hand", h), ("tpfn2", t), ("hand2", h)):
            for _ in range(200): m(x).sum()
            s = time.perf_counter()
            for _ in range(2000): m(x).sum()
            res[name] = (time.perf_counter() - s) / 2000 * 1e6
        pr = cProfile.Profile(); pr.enable()
        for _ in range(1000): t(x).sum()
        pr.disable()
    out = io.StringIO(); pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(15)
    return res, out.getvalue()

if __name__ == "__main__":
    with Ranks(2) as r:
        res, prof = r.run(_m)[0]
    print(res); print(prof)
