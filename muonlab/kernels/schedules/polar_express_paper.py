"""Polar Express at any step count, as its authors publish it (1% safety margin).

The authors' reference implementation (NoahAmsel/PolarExpress, ``polar_express/basic.py``)
runs ``steps`` iterations as the first ``steps`` entries of one greedy sequence for singular
values in [1e-3, 1] (each polynomial the best odd quintic on the interval the previous ones
leave; the paper shows this greedy composition optimal, so a prefix is the schedule of its
length), and past its eighth entry repeats the last, the classic quintic (15/8, -10/8, 3/8) the
sequence converges to. Entries but the last are divided by the safety factor 1.01
(a / 1.01, b / 1.01^3, c / 1.01^5), and the input by 1.01 ||X||_F, exactly as there.
"""

import torch

from .base import Schedule

SAFETY = 1.01

# Measured (tests/kernels/test_schedules.py): fewer than five steps leave the top singular value
# above 1.5 (1.56 after four: the sequence is built to be composed); in the gram form with fp16
# iterates eight steps (the length it is published for) grew near-low-rank inputs to a top
# singular value of 946, ten to inf: the gram form restarts once in fp16, and these steps keep
# amplifying the rounding's negative eigenvalues (see muonlab.kernels.forms.gram). So there it
# iterates in fp32 or fp64 only; the plain form in every dtype.
EVERY = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# optimal_composition(l=1e-3, cushion=0.02) before the safety factor, as printed in basic.py
PUBLISHED = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

SCHEDULE = Schedule(
    name="polar_express_paper",
    table=tuple((a / SAFETY, b / SAFETY**3, c / SAFETY**5) for a, b, c in PUBLISHED[:-1]) + PUBLISHED[-1:],
    norm_scale=SAFETY,
    allowed={"plain": EVERY, "gram": (torch.float32, torch.float64)},
    min_steps=5,
    source=("N. Amsel, D. Persson, C. Musco, R. M. Gower, 'The Polar Express: Optimal Matrix Sign Methods and "
            "Their Application to the Muon Algorithm', arXiv:2505.16932 (2025); coefficients and safety factor "
            "from the authors' NoahAmsel/PolarExpress polar_express/basic.py (l = 1e-3, 8 entries, the last "
            "repeated)"),
)
