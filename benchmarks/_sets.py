"""Matrix sets shared by several benchmarks.

small48: the 48 hidden matrices of ``GPT(GPTConfig(d_model=8, n_layers=12, n_heads=2))`` (per layer
24x8 qkv, 8x8 attention output, 32x8 MLP in, 8x32 MLP out), every one routed to Muon by
``muon_param_groups``. Their Newton-Schulz work is tiny, so a step's time is nearly all the
optimizer's fixed host cost per matrix and per step: the set that measures it.
"""

from __future__ import annotations

SMALL48 = dict(d_model=8, n_layers=12, n_heads=2)


def small48_matrices() -> list[tuple[str, tuple[int, int]]]:
    """(name, shape) of the small set's 48 matrices, in the model's order; raises if the routing no
    longer sends exactly the blocks' 48 Linear weights to Muon (the set would have changed)."""
    import torch

    from muonlab import muon_param_groups
    from muonlab.models import GPT, GPTConfig

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL48))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    routed = [r.name for r in muon_param_groups(model).routes if r.algorithm == "muon"]
    out = [(n, shapes[n]) for n in routed]
    if len(out) != 48 or not all(n.startswith("blocks.") for n, _ in out):
        raise RuntimeError(f"muon_param_groups routed {len(out)} matrices of GPT({SMALL48}) to Muon, "
                           "not the blocks' 48: the small48 set has changed")
    return out
