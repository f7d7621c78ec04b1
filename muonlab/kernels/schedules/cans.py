"""CANS: Chebyshev-type (Remez, adaptive interval) quintics for Newton-Schulz."""

from .base import Schedule

SCHEDULE = Schedule(
    name="cans",
    table=(
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    source=("E. Grishina, M. Smirnov, M. Rakhuba, 'Accelerating Newton-Schulz Iteration for Orthogonalization "
            "via Chebyshev-type Polynomials' (CANS), arXiv:2506.10935 (2025); the five-step set of NVIDIA-NeMo/"
            "Emerging-Optimizers emerging_optimizers/orthogonalized_optimizers/muon_utils.py ('cans', generated "
            "with the authors' GrishKate/accelerating_orthogonalization polynomials.py; input divided by "
            "||X||_F, the last entry repeated past five steps)"),
)
