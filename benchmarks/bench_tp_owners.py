"""The owner rule of tensor-parallel weights (layout "pieces") against the rule before it, from
shapes alone (``simulate(..., tp=T)``, the planner a run uses).

    .venv/bin/python benchmarks/bench_tp_owners.py [--cases 40] [--seed 0]

Each case is a random set of 3-12 weights whose row counts leave uneven and empty pieces over a
(W // tp, tp) mesh (FSDP2 over TP: rows 4 to 516, split column- or row-wise by name), W in 4, 8,
16 and tp in 2, 4, planned under the cpu_gloo and h100_node profiles. "least loaded" is the rule
before ``cheapest_owner``: each weight, largest first, to the least-loaded rank, ties to the one
holding most of it (``least_loaded``, kept as the planner's helper for other layouts). For each
rule: the plan's bytes against ``lower_bound_bytes`` (owner compute: each weight gathered on its
largest holder) and its modelled step (``step_seconds``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import muonlab.comm.planner.rule as rule
from muonlab.comm.planner.loads import least_loaded
from muonlab.simulate import simulate, summarize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import md_table, results_path, write_report  # noqa: E402

ROWS = (4, 12, 20, 36, 68, 132, 260, 516)
COLS = (8, 12, 64, 128, 256)


def least_loaded_rule(load, top, cost, held, moved_seconds, seconds_per_flop) -> int:
    """The rule before: ``cheapest_owner``'s signature, ``least_loaded``'s pick."""
    return least_loaded(load, range(len(held)), held)


def random_cases(count: int, seed: int):
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        world, tp = rng.choice([4, 8, 16]), rng.choice([2, 4])
        if world % tp:
            continue
        shapes = [(f"l{k}.w", (rng.choice(ROWS), rng.choice(COLS))) for k in range(rng.randint(3, 12))]
        cases.append((world, tp, shapes))
    return cases


def planned(shapes, world: int, tp: int, profile: str, owner_rule) -> dict:
    """``simulate``'s plan with the pieces layout's owner rule swapped for ``owner_rule``."""
    chosen = rule.cheapest_owner
    rule.cheapest_owner = owner_rule
    try:
        plan = simulate(shapes, world, tp=tp, profile=profile, device="cpu")
    finally:
        rule.cheapest_owner = chosen
    return summarize(plan, world, profile=profile)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    header = ["profile", "rule", "cases over the bound", "bytes / bound: mean", "max",
              "modelled step / the other rule's: median", "min", "max"]
    body = []
    for profile in ("cpu_gloo", "h100_node"):
        runs = {name: [] for name in ("least loaded", "cheapest_owner")}
        for world, tp, shapes in random_cases(args.cases, args.seed):
            runs["least loaded"].append(planned(shapes, world, tp, profile, least_loaded_rule))
            runs["cheapest_owner"].append(planned(shapes, world, tp, profile, rule.cheapest_owner))
        for name, other in (("least loaded", "cheapest_owner"), ("cheapest_owner", "least loaded")):
            over = [s["bytes_over_bound"] for s in runs[name]]
            ratio = [s["modelled_s"] / o["modelled_s"] for s, o in zip(runs[name], runs[other])]
            body.append([profile, name, f"{sum(x > 1 for x in over)} of {len(over)}", f"{statistics.mean(over):.5f}",
                         f"{max(over):.5f}", f"{statistics.median(ratio):.5f}", f"{min(ratio):.5f}",
                         f"{max(ratio):.5f}"])
    text = "\n".join([
        md_table(header, body), "",
        "Bytes are the plan's, all ranks, against the owner-compute bound (`muonlab.simulate.lower_bound_bytes`);",
        "the modelled step is `muonlab.comm.cost.step_seconds` of the same plan under the same profile.",
        "cheapest_owner weighs the makespan a pick grows against the bytes it moves, per weight and greedily,",
        "while the step model replays the pipeline over every rank: the two can disagree by a little.",
    ])
    print(text)
    write_report(results_path("tp_owners"), "Tensor-parallel owners: cheapest_owner against least loaded", text,
                 script=__file__, argv=argv)


if __name__ == "__main__":
    main()
