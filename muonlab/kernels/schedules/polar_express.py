"""Polar Express with five steps, as modded-nanogpt ships it (2% safety margin)."""

from .base import Schedule

SCHEDULE = Schedule(
    name="polar_express",
    table=(
        (8.1566, -22.4833, 15.8788),
        (4.0429, -2.8089, 0.5000),
        (3.8917, -2.7725, 0.5061),
        (3.2858, -2.3681, 0.4645),
        (2.3465, -1.7098, 0.4232),
    ),
    # the coefficients assume sigma_max < 1 / 1.02
    norm_scale=1.02,
    source=("N. Amsel, D. Persson, C. Musco, R. M. Gower, 'The Polar Express: Optimal Matrix Sign Methods and "
            "Their Application to the Muon Algorithm', arXiv:2505.16932 (2025); the five-step schedule of "
            "KellerJordan/modded-nanogpt train_gpt.py (Polar Express with a 2e-2 safety factor, input divided "
            "by 1.02 ||X||_F), rounded to 4 decimals. For other step counts see 'polar_express_paper'"),
)
