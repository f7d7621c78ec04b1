"""Per-head Newton-Schulz on FSDP2: the bytes and modelled time of one fused QKV, planned (no run).

A GPT-2-small-sized QKV (2304, 768), 12 heads of 64, in bf16 on the wire, row-sharded over W ranks:
orthogonalized whole (one matrix, the all_to_all path), per head (36 blocks of (64, 768); the
``blocks`` path where the shards cut heads), and what the padded ``gather_all`` fallback, which
per-head blocks cut by the shards took before the blocks path, would move. Writes
benchmarks/results/split_heads.md.

    python benchmarks/bench_split_heads.py
"""

from __future__ import annotations

from pathlib import Path

from muonlab.comm.cost import get_profile
from muonlab.comm.paths import gather_all
from muonlab.comm.specs import fused_row_layout
from muonlab.simulate import simulate, summarize

SHAPE, HEADS, PROFILE = (2304, 768), 36, "h100_node"
OUT = Path(__file__).parent / "results" / "split_heads.md"


def rows() -> list[str]:
    out = []
    for world in (2, 8, 64, 256):
        whole = summarize(simulate([("qkv", SHAPE)], world, profile=PROFILE), world, PROFILE)
        split = summarize(simulate([("qkv", SHAPE)], world, profile=PROFILE, fused_banks={"qkv": HEADS}),
                          world, PROFILE)
        cut = fused_row_layout(SHAPE[0], HEADS, world) == "blocks"
        old = sum(gather_all.bytes_per_rank(SHAPE, 0, world, 2)[0]) if cut else split["total_bytes"]
        out.append(f"| {world} | {whole['total_bytes'] / 1e6:.2f} | {whole['modelled_s'] * 1e3:.3f} | "
                   f"{split['total_bytes'] / 1e6:.2f} ({', '.join(split['paths'])}) | {split['modelled_s'] * 1e3:.3f} | "
                   f"{split['bound_bytes'] / 1e6:.2f} | {old / 1e6:.2f} |")
    return out


def main() -> None:
    profile = get_profile(PROFILE)
    text = "\n".join([
        "# Per-head Newton-Schulz on FSDP2: bytes of one fused QKV (planned)",
        "",
        "Command (repository root): `python benchmarks/bench_split_heads.py` (simulation only: "
        "`muonlab.simulate`, no process runs, so the machine's load does not matter).",
        "",
        f"A (2304, 768) QKV (12 heads of 64) in bf16 on the wire, row-sharded over W ranks; modelled under "
        f"the `{PROFILE}` profile ({profile.ranks_per_node} ranks per node). Bytes are summed over the ranks.",
        "",
        "| W | whole: MB | whole: modelled ms | per head: MB (path) | per head: modelled ms | lower bound per head: MB "
        "| per head by the old padded gather_all: MB |",
        "|---|---|---|---|---|---|---|",
        *rows(),
        "",
        "Per head, each block cut by the shards moves only its pieces held off its owner (the rank holding most "
        "of it), out and back: the lower bound. Whole, the matrix's rows all travel to one owner and back. "
        "Before the blocks path, the cut blocks fell back to a padded all-gather of the whole parameter on "
        "every rank, each rank orthogonalizing all 36 blocks. On 2 ranks every head lies whole on a rank "
        "(1152 rows each): nothing moves.",
        "",
    ])
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
