"""Keller Jordan's Muon schedule: one quintic, repeated at every step."""

from .base import Schedule

SCHEDULE = Schedule(
    name="keller",
    table=((3.4445, -4.7750, 2.0315),),
    source=("Keller Jordan, 'Muon: An optimizer for hidden layers in neural networks' (2024), "
            "https://kellerjordan.github.io/posts/muon/; the coefficients of torch.optim.Muon"),
)
