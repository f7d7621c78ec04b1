"""The optimizer step's memory per rank at scale, from shapes alone (``simulate`` + ``step_memory``,
the formulas ``Muon.plan()`` uses and the engine's counts equal on gloo: muonlab.comm.memory).

    .venv/bin/python benchmarks/bench_step_memory.py

Model "glm5-like": an MoE decoder shaped after GLM-5's published size class (about 740B
parameters, 256 routed experts); the shapes are this benchmark's assumption, not GLM-5's
config: 78 layers (3 dense, 75 MoE), hidden 6144, grouped-query attention (64 query heads and 8
KV heads of 128: q 8192 x 6144, k and v 1024 x 6144, o 6144 x 8192), 256 routed experts of
hidden 2048 per MoE layer (banks 256 x 4096 x 6144, gate and up fused, and 256 x 6144 x 2048),
a shared expert (4096 x 6144, 6144 x 2048), a router (256 x 6144), dense layers' MLP 24576 x 6144
and 6144 x 12288. Mesh (fsdp 64, ep 8) = 512 ranks, and (fsdp 256, ep 8) = 2048. fp32 momentum,
bf16 Newton-Schulz and wire, the GPU's default workspace budget (max(256 MiB, 5% of a rank's even
share of the Muon parameters' bytes)), which ``simulate`` plans with as a run does.
Also "dense": bench_planner's 60-layer dense decoder at 512 and 2048 ranks, FSDP2 alone.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from muonlab.kernels.runner import default_budget
from muonlab.simulate import simulate, step_memory
from muonlab.viz.planner import dense_shapes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import md_table, results_path, write_report  # noqa: E402

MIB = 2**20


def glm5_like_shapes(layers: int = 78, dense_layers: int = 3, d: int = 6144, experts: int = 256,
                     expert_hidden: int = 2048, dense_hidden: int = 12288) -> list[tuple[str, tuple]]:
    out = []
    for i in range(layers):
        out += [(f"l{i}.q", (8192, d)), (f"l{i}.k", (1024, d)), (f"l{i}.v", (1024, d)), (f"l{i}.o", (d, 8192))]
        if i < dense_layers:
            out += [(f"l{i}.mlp_in", (2 * dense_hidden, d)), (f"l{i}.mlp_out", (d, dense_hidden))]
        else:
            out += [(f"l{i}.router", (experts, d)), (f"l{i}.w_in", (experts, 2 * expert_hidden, d)),
                    (f"l{i}.w_out", (experts, d, expert_hidden)), (f"l{i}.shared_in", (2 * expert_hidden, d)),
                    (f"l{i}.shared_out", (d, expert_hidden))]
    return out


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def case(model: str, shapes, mesh, world: int) -> dict:
    params = sum(numel(s) for _, s in shapes)
    budget = default_budget(4 * params // world, "cuda")  # fp32 parameters, a rank's even share
    t0 = time.time()
    plan = simulate(shapes, mesh, workspace_bytes=budget)
    mem = step_memory(plan, world, workspace_bytes=budget)
    seconds = time.time() - t0
    peaks = [r.peak for r in mem.ranks]
    worst = mem.worst_rank
    largest, index, rank = mem.largest_buffer()
    batch = next(b for b in plan if b.index == index)
    return dict(model=model, world=world, mesh=str(mesh), params=params, budget=budget, batches=len(plan),
                max_peak=max(peaks), median_peak=statistics.median(peaks), worst=worst,
                in_flight=mem.ranks[worst].peak_batches, largest=largest, largest_batch=mem.describe(index),
                largest_rank=rank, largest_path=batch.path, seconds=seconds,
                paths=sorted({b.path for b in plan}))


def main():
    rows = [case("glm5-like", glm5_like_shapes(), (64, 8), 512),
            case("glm5-like", glm5_like_shapes(), (256, 8), 2048),
            case("dense", dense_shapes(), 512, 512),
            case("dense", dense_shapes(), 2048, 2048)]
    header = ["model", "W", "mesh (fsdp, ep)", "Muon params (B)", "batches", "paths", "buffers peak MiB (max rank)",
              "median rank MiB", "workspace MiB", "step peak MiB", "largest batch buffers MiB", "planned in s"]
    body = [[r["model"], r["world"], r["mesh"], f"{r['params'] / 1e9:.0f}", r["batches"], ",".join(r["paths"]),
             f"{r['max_peak'] / MIB:.0f}", f"{r['median_peak'] / MIB:.0f}", f"{r['budget'] / MIB:.0f}",
             f"{(r['max_peak'] + r['budget']) / MIB:.0f}", f"{r['largest'] / MIB:.0f}", f"{r['seconds']:.1f}"]
            for r in rows]
    lines = [md_table(header, body), "", "Largest buffer per row (the batch holding the most bytes on one rank):", ""]
    for r in rows:
        lines.append(f"- {r['model']} W={r['world']}: {r['largest'] / MIB:.0f} MiB on rank {r['largest_rank']}, "
                     f"{r['largest_batch']}; the worst rank {r['worst']} peaks with batches "
                     f"{list(r['in_flight'])} in flight.")
    lines += ["", "Buffers: send and receive buffers, stacked matrices and Newton-Schulz outputs of the batches in",
              "flight at once (at most three: muonlab.comm.engine), each counted until its batch is applied. The",
              "workspace is its bound (the budget). Momentum (fp32, a rank's shards) is held between steps and",
              "is not in these figures."]
    text = "\n".join(lines)
    print(text)
    write_report(results_path("step_memory"), "Optimizer-step memory per rank at scale", text, script=__file__)


if __name__ == "__main__":
    main()
