"""What the wire dtype costs in parity and bytes: FSDP2 against one process, and a plan's bytes.

1. The MLP 40 -> 40 -> 40 -> 10 (weights (40, 40), (40, 40), (10, 40); 2 rows per rank, so their
   gradients are low-rank) on FSDP2 over W gloo ranks, 3 Muon steps, against one process: the
   largest relative displacement of a weight matrix, with Muon's defaults (comm_dtype="auto"),
   with comm_dtype=bf16 (the default until 2026-11-29) and fp32. "rows": FSDP2's own backward,
   each rank on its rows; "global": every rank given one process's gradient (the optimizer alone).
2. The GPT matrix set of bench_peers.py (d_model 256, 8 layers, 4 odd shapes) on W ranks: the
   total bytes of ``Muon.plan()`` under the defaults and under comm_dtype=bf16.

Run it as on the other kind of CPU with PYTHONPATH=tools/cpu_kind/native_bf16 (Newton-Schulz
"auto" there iterates large matrices in bf16, and their batches then travel in bf16).

    python benchmarks/bench_wire_parity.py [--worlds 2 3 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _peers_workers import matrix_shapes  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402
from _wire_workers import plan_bytes  # noqa: E402

from muonlab.launcher import launch  # noqa: E402
from muonlab.kernels.newton_schulz import cpu_has_native_bf16  # noqa: E402
from tests.distributed import _workers_wire as W  # noqa: E402
from tests.distributed._common import cloned, rel_displacement  # noqa: E402

WIDTHS, STEPS = (40, 40, 40, 10), 3
CASES = (("rows", "defaults"), ("rows", "bf16_wire"), ("rows", "fp32_wire"),
         ("global", "defaults"), ("global", "bf16_wire"))
REFERENCE = {"defaults": "defaults", "bf16_wire": "defaults", "fp32_wire": "defaults"}


def parity(world: int) -> list[list]:
    results = launch(W.runs, world, 1, CASES, WIDTHS, STEPS, timeout_s=600)
    start = cloned(W.build_mlp(WIDTHS).named_parameters())
    rows = []
    for grads, options in CASES:
        worst = {}
        for res in results.values():
            got, ref = res[(grads, options)]["params"], res[REFERENCE[options]]
            for n in ref:
                if ref[n].dim() == 2:
                    e = rel_displacement({n: got[n]}, {n: ref[n]}, {n: start[n]})
                    worst[tuple(ref[n].shape)] = max(worst.get(tuple(ref[n].shape), 0.0), e)
        rows.append([world, grads, options, f"{worst[(10, 40)]:.3g}", f"{max(worst.values()):.3g}"])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    args = parser.parse_args(argv)
    kind = "native bf16" if cpu_has_native_bf16() else "no native bf16"

    head1 = ["W", "gradients", "options", "(10, 40) rel. displacement vs one process", "worst matrix"]
    rows1 = [row for world in args.worlds for row in parity(world)]
    print(text_table(head1, rows1))

    shapes = matrix_shapes("gpt")
    head2 = ["W", "comm_dtype", "plan() bytes (all ranks)", "batches by wire dtype"]
    rows2 = []
    for world in [w for w in args.worlds if w in (2, 4)] or args.worlds[:1]:
        got = launch(plan_bytes, world, shapes, {"auto (default)": None, "bf16 (old default)": torch.bfloat16},
                     timeout_s=600)[0]
        rows2 += [[world, label, total, kinds] for label, (total, kinds) in got.items()]
    print(text_table(head2, rows2))

    name = "wire_parity" + ("_native_bf16" if cpu_has_native_bf16() else "")
    write_report(results_path(name), f"Wire dtype: parity with one process and plan bytes ({kind} CPU)",
                 md_table(head1, rows1) + "\n\n" + md_table(head2, rows2), script=__file__, argv=argv,
                 machine_note=f"CPU kind as Muon sees it: {kind}; workers use 1 thread.")


if __name__ == "__main__":
    main()
