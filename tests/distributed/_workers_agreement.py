"""Workers for test_agreement.py: ranks that drift apart after the first step (a gradient on one
rank only, a setting changed on one rank, an extra parameter) are refused, by name, on every rank,
before anything changes, instead of hanging in mismatched collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonlab import Muon


def _setup(layout: str, state_offload: str | None = None):
    """Named Muon matrices (and an AdamW bias) the same on every rank: DTensor shards (fsdp) or
    replicas (ddp: plain tensors under the world group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    fulls = {"w0": torch.randn(8, 16, generator=gen), "w1": torch.randn(8, 16, generator=gen),
             "w2": torch.randn(12, 6, generator=gen)}
    if layout == "fsdp":
        params = {n: torch.nn.Parameter(distribute_tensor(f, mesh, [Shard(0)])) for n, f in fulls.items()}
    else:
        params = {n: torch.nn.Parameter(f.clone()) for n, f in fulls.items()}
    bias = torch.nn.Parameter(torch.zeros(8))
    opt = Muon([{"params": list(params.items())}, {"params": [("bias", bias)], "algorithm": "adamw"}],
               lr=0.02, ns_dtype=torch.float32, state_offload=state_offload)
    return params, bias, opt


def momentum_offloaded_on_one_rank() -> dict:
    """The last rank keeps its state on the CPU, the others resident: where momentum lives orders
    the step's collectives, so the ranks crashed in mismatched ones (gloo aborted a rank)."""
    last = dist.get_rank() == dist.get_world_size() - 1
    params, bias, opt = _setup("fsdp", state_offload="cpu" if last else None)
    _grads(params, bias, 1)
    try:
        opt.step()
    except ValueError as err:
        return dict(error=str(err), state=len(opt.state))
    return dict(error=None, state=len(opt.state))


def _grads(params, bias, seed: int):
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    for p in params.values():
        full = torch.randn(p.shape, generator=gen)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements) if hasattr(p, "placements") else full
    bias.grad = torch.randn(8, generator=gen)


def drift_after_the_first_step(layout: str, drift: str, side_group: bool = False) -> dict:
    """Step 0 alike everywhere; at step 1 the last rank drifts. Returns the error (on every rank)
    and whether anything changed on this rank.

    ``side_group``: the check runs on its own gloo group over the ranks, as it does under NCCL
    (the group is gloo here, so without this it would run on the step's own group). Returns too
    how many side groups were made and whether the one used is a group of its own."""
    params, bias, opt = _setup(layout)
    used = []  # the groups of every all_to_all_single (the real call still runs)
    if side_group:
        agreement = opt._agreement
        agreement._host_group = agreement._side_group  # the NCCL branch, on gloo
        real = dist.all_to_all_single

        def spy(*args, group=None, **kwargs):
            used.append(group)
            return real(*args, group=group, **kwargs)

        dist.all_to_all_single = spy
    _grads(params, bias, 1)
    opt.step()
    _grads(params, bias, 2)
    last = dist.get_rank() == dist.get_world_size() - 1
    if last and drift == "grad":
        params["w1"].grad = None
    elif last and drift == "lr":
        opt.param_groups[0]["lr"] = 0.04
    elif last and drift == "tensor_lr":
        opt.param_groups[0]["lr"] = torch.tensor(0.02)
    elif last and drift == "decision":
        opt.nonfinite_decision = "device"
    elif last and drift == "adamw_grad":
        bias.grad = None
    elif last and drift == "extra":
        extra = torch.nn.Parameter(torch.randn(4, 4))
        opt.add_param_group({"params": [("extra", extra)]})
        extra.grad = torch.randn(4, 4)
    before = [p.detach().clone() for p in (*params.values(), bias)]
    state = [s["momentum_buffer"].clone() for p, s in opt.state.items() if "momentum_buffer" in s]
    error = None
    try:
        opt.step()
    except ValueError as err:
        error = str(err)
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, (*params.values(), bias))) and all(
        torch.equal(a, s["momentum_buffer"]) for a, (p, s) in zip(state, (i for i in opt.state.items()
                                                                          if "momentum_buffer" in i[1])))
    out = dict(error=error, unchanged=unchanged)
    if side_group:
        made = list(opt._agreement._gloo.values())
        dist.all_to_all_single = real
        out.update(side_groups=len(made), own_group=bool(made) and made[0] is not dist.group.WORLD
                   and dist.get_process_group_ranks(made[0]) == list(range(dist.get_world_size())),
                   side_used=sum(g is made[0] for g in used) if made else 0)
    return out
