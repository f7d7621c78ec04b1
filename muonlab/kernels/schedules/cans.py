"""CANS: Chebyshev-type (Remez, adaptive interval) quintics for Newton-Schulz."""

import torch

from .base import Schedule

# Measured (tests/kernels/test_schedules.py): its first quintic sends sigma = 1 to 1.99 (no safety
# margin), and a 16-bit rounding above that lands outside the interval the next ones are built
# for: in bf16 rank-1 inputs came out as inf (plain form), in fp16 with a top singular value of
# 2.3. In fp32 and fp64 every input stays within 1.12 from five steps on; four leave it at 1.55.
WIDE = (torch.float32, torch.float64)

SCHEDULE = Schedule(
    name="cans",
    table=(
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    allowed={"plain": WIDE, "gram": WIDE},
    min_steps=5,
    source=("E. Grishina, M. Smirnov, M. Rakhuba, 'Accelerating Newton-Schulz Iteration for Orthogonalization "
            "via Chebyshev-type Polynomials' (CANS), arXiv:2506.10935 (2025); the five-step set of NVIDIA-NeMo/"
            "Emerging-Optimizers emerging_optimizers/orthogonalized_optimizers/muon_utils.py ('cans', generated "
            "with the authors' GrishKate/accelerating_orthogonalization polynomials.py; input divided by "
            "||X||_F, the last entry repeated past five steps)"),
)
