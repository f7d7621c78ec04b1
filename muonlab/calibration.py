"""Measure a ``HardwareProfile`` on the machine it runs on, and keep it in a JSON file.

``calibrate()`` times what the cost model (``muonlab.comm.cost``) prices, with muonlab's own step
wherever it can, so the figures carry the host work the model's terms stand for:

- host cost per batch and per matrix of each phase (momentum, Newton-Schulz, update): Muon steps on
  tiny matrices in batches of 1, 4 and 12, read from the step's spans, a line fitted per phase;
- Newton-Schulz rate per dtype and shape class (``cost.SHAPE_CLASSES``): Muon steps on a stack of
  each class, the batch's planned FLOPs over its span less the host cost above;
- elementwise bandwidth (momentum and update): the largest stack's spans less their host cost;
- over a process group of two or more ranks: ``all_to_all_single`` at several sizes, back to back,
  a line fitted to the slowest rank's medians (latency, bandwidth), and the host cost of issuing one
  call.
  Without one, the links come from the shipped profile of this device's kind (named in ``source``).

Every rank of a group measures its own device, then takes the group's mean of each figure (the
links: the slowest rank's, as a collective ends when its last rank does), so every rank holds the
same profile and plans alike.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ._base import dist_on
from .comm.cost import MOMENTUM_PASSES, PROFILES, UPDATE_PASSES, HardwareProfile, shape_class
from .kernels.newton_schulz import cpu_has_native_bf16

__all__ = ["calibrate", "load_profile", "save_profile"]

_COMPUTE = ("momentum", "newton_schulz", "update")
_HOST_SHAPES = ((8, 8, 1), (8, 12, 4), (8, 16, 12))
"""(rows, cols, matrices): tiny batches of 1, 4 and 12 matrices (no shape the transpose of another: each is a batch of its own)."""


def _class_shapes(device: torch.device) -> list[tuple[int, int, int]]:
    """A stack per shape class, square (the plain form) and 1 x 4 (the gram form where "auto" takes
    it), sized to take a few tens of milliseconds a step here."""
    large = [(2048, 2048, 4), (2048, 8192, 1)] if device.type == "cuda" else [(520, 520, 1), (520, 1040, 1)]
    return [(48, 48, 16), (32, 128, 16), (256, 256, 4), (256, 1024, 2), *large]


def _linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def _muon_spans(shapes, device: torch.device, ns_dtype, group, steps: int) -> tuple[list, dict, list[dict]]:
    """Step a local Muon on random matrices of ``shapes``; (plan, {batch: resolved choice}, per step {batch:
    {phase: seconds}}, per step its span) over the last ``steps`` steps (the first two build the
    plan and warm up)."""
    from .comm.plan_vs_run import measured_phases
    from .optim import Muon
    from .trace.steps import StepRecorder

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(r, c, generator=gen).to(device))
              for r, c, n in shapes for _ in range(n)]
    opt = Muon(params, lr=1e-3, ns_dtype=ns_dtype if ns_dtype == "auto" else getattr(torch, ns_dtype),
               process_group=group)
    rec = StepRecorder(opt, keep=steps)
    for _ in range(2 + steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        opt.step()
    per_step, spanned = measured_phases(rec.spans(), rank=rec.spans()[0].rank)
    return opt.plan(), {c["batch"]: c for c in opt.resolved_choices()}, per_step, spanned


def _median_phase(per_step: list[dict], batch: int, phase: str) -> float:
    return statistics.median(s.get(batch, {}).get(phase, 0.0) for s in per_step)


def _device_figures(device: torch.device, group, steps: int) -> dict:
    """Host costs, Newton-Schulz rates and elementwise bandwidth of this rank's device."""
    # tiny steps (a few milliseconds): three times as many, as host time is the noisier figure
    plan, _, per_step, spanned = _muon_spans(_HOST_SHAPES, device, "auto", group, 3 * steps)
    host = []
    xs = [b.num_matrices for b in plan]
    for phase in ("momentum", "newton_schulz", "update"):
        a, b = _linear_fit(xs, [_median_phase(per_step, b.index, phase) for b in plan])
        host.append((phase, max(0.0, a), max(0.0, b)))
    # what the step's span holds beyond its phases, shared out per batch
    outside = statistics.median(total - sum(t for ph in s.values() for p, t in ph.items() if p in _COMPUTE)
                                for s, total in zip(per_step, spanned))
    host.append(("between", max(0.0, outside / len(plan)), 0.0))
    host_of = {p: (a, b) for p, a, b in host}

    def host_s(phase: str, n: int) -> float:
        a, b = host_of[phase]
        return a + b * n

    # the dtypes ns_dtype="auto" runs: bf16 on a GPU (fp32 there, ns_dtype=torch.float32, falls back to
    # matmul_flops: its Triton kernels would be compiled for this alone); fp32 on a CPU, and bf16 where
    # it is native (emulated bf16 runs at a tenth of fp32's rate and is never chosen)
    dtypes = ["bfloat16"] if device.type == "cuda" else ["float32"] + (["bfloat16"] if cpu_has_native_bf16() else [])
    rates, bw = [], []
    for dtype in dtypes:
        plan, ran, per_step, _ = _muon_spans(_class_shapes(device), device, dtype, group, steps)
        for b in plan:
            spanned_ns = _median_phase(per_step, b.index, "newton_schulz")
            ns = spanned_ns - host_s("newton_schulz", b.num_matrices)
            # where host cost is nearly all of it, no rate can be told from the noise: that class falls
            # back (matmul_rate), and its host cost, the part that counts, is priced either way
            if ns > 0.1 * spanned_ns and ran[b.index]["dtype"] == dtype:
                rates.append((dtype, shape_class(b.matrix_shape, ran[b.index]["form"]), sum(b.flops) / ns))
            # the momentum and update run in the parameters' fp32 whatever the Newton-Schulz dtype
            if dtype == dtypes[0] and shape_class(b.matrix_shape) == "large" and b.matrix_shape[0] == b.matrix_shape[1]:
                elems = b.num_matrices * math.prod(b.matrix_shape)
                t = sum(_median_phase(per_step, b.index, p) - host_s(p, b.num_matrices) for p in ("momentum", "update"))
                if t > 0:
                    bw.append((MOMENTUM_PASSES + UPDATE_PASSES) * 4 * elems / t)
    by_class: dict[tuple[str, str], list[float]] = {}  # two stacks may fall in one class (both plain)
    for d, c, r in rates:
        by_class.setdefault((d, c), []).append(r)
    rates = [(d, c, statistics.median(r)) for (d, c), r in sorted(by_class.items())]
    return dict(host=host, rates=rates, mem_bw=bw[0] if bw else None)


def _link_figures(group, device: torch.device, reps: int) -> dict:
    """all_to_all_single over ``group`` at several sizes: latency, bandwidth and host cost per call
    from the slowest rank's medians."""
    world = dist.get_world_size(group)
    sizes = [world * 256, world * 65536, world * 1048576]  # bf16 elements in, per rank
    times = []
    for numel in sizes:
        send = torch.ones(numel, dtype=torch.bfloat16, device=device)
        recv = torch.empty_like(send)
        samples = []
        dist.barrier(group=group)
        # back to back, no barrier between: as in a step, where each collective also waits for the
        # ranks' skew (a rank descheduled on a shared machine), which a barrier before each would hide
        for _ in range(reps + 1):  # the first call warms the connection up
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples[1:]))
    issue = []
    tiny = torch.ones(world, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(tiny)
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        work = dist.all_to_all_single(out, tiny, group=group, async_op=True)
        issue.append(time.perf_counter() - t0)
        work.wait()
    slowest = _max_over(group, [*times, statistics.median(issue)])
    times, per_call = slowest[:-1], slowest[-1]
    sent = [2 * n * (world - 1) / world for n in sizes]  # bytes leaving a rank (bf16)
    latency, per_byte = _linear_fit(sent, times)
    return dict(latency_s=max(0.0, latency - per_call), bw=1 / per_byte if per_byte > 0 else None,
                host_s_per_call=per_call, world=world, points=list(zip(sizes, times)))


def _max_over(group, values: list[float]) -> list[float]:
    """Each value's maximum over the group's ranks (NCCL reduces CUDA tensors, gloo CPU ones)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _agree(figures: dict, group) -> dict:
    """The group's mean of each rank's figures, in time per unit (seconds, s/FLOP, s/byte), so every
    rank plans alike. The mean, not the slowest: ranks sharing a loaded machine measure at different
    moments, and the run's phases are each rank's own. A rate only some ranks could measure
    (``_device_figures``) is the mean of theirs."""
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, figures, group=group)
    host = [(p, statistics.fmean(dict((q, (x, y)) for q, x, y in f["host"])[p][0] for f in every),
             statistics.fmean(dict((q, (x, y)) for q, x, y in f["host"])[p][1] for f in every))
            for p, _, _ in figures["host"]]
    per_flop: dict[tuple[str, str], list[float]] = {}
    for f in every:
        for d, c, r in f["rates"]:
            per_flop.setdefault((d, c), []).append(1 / r)
    rates = [(d, c, 1 / statistics.fmean(v)) for (d, c), v in sorted(per_flop.items())]
    per_byte = [1 / f["mem_bw"] for f in every if f["mem_bw"]]
    return dict(host=host, rates=rates, mem_bw=1 / statistics.fmean(per_byte) if per_byte else None)


def calibrate(process_group=None, *, device: torch.device | str | None = None, steps: int = 5,
              name: str | None = None) -> HardwareProfile:
    """A ``HardwareProfile`` measured here (see the module docstring); a few seconds.

    ``process_group``: the group whose collectives to measure (collective: every rank of it
    calls); None: the default group where torch.distributed is up with two or more ranks, else no
    links are measured. ``device``: where to measure (default: this rank's device, as muonlab's
    workers choose it). ``steps``: timed Muon steps per measurement."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if process_group is not None:
        if not dist_on():
            raise ValueError("process_group was given but torch.distributed is not initialized: "
                             "call dist.init_process_group first (or pass process_group=None)")
        if process_group is dist.GroupMember.NON_GROUP_MEMBER or (
                isinstance(process_group, dist.ProcessGroup) and dist.get_rank(process_group) < 0):
            raise ValueError(f"process_group does not hold this rank (global rank {dist.get_rank()}): "
                             "calibrate is called by the members of the group it measures")
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, "
                            f"got {type(process_group).__name__}")
    group = process_group
    if group is None and dist_on() and dist.get_world_size() > 1:
        group = dist.group.WORLD
    if device is None:
        from .distributed.device import rank_device  # the launcher's modules: imported only when needed
        device = rank_device()
    device = torch.device(device)
    on_group = group is not None and dist.get_world_size(group) > 1
    # the device part runs on this rank alone: a group of one makes Muon's plan local
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True) if dist_on() else None
    figures = _device_figures(device, alone, steps)
    if on_group:
        figures = _agree(figures, group)
    base = PROFILES["h100_node" if device.type == "cuda" else "cpu_gloo"]
    fields = dict(matmul_flops=max((r for *_, r in figures["rates"]), default=base.matmul_flops),
                  matmul_rates=tuple(sorted(figures["rates"])), host_s=tuple(figures["host"]),
                  mem_bw=figures["mem_bw"] or base.mem_bw)
    what = (f"Muon steps on {device.type} (host cost per phase, Newton-Schulz rate per dtype and shape "
            f"class, elementwise bandwidth)")
    if on_group:
        links = _link_figures(group, device, reps=max(3, steps))
        world = links["world"]
        bw = links["bw"] or base.intra_bw
        fields.update(intra_bw=bw, inter_bw=bw, ranks_per_node=world, latency_s=links["latency_s"],
                      host_s_per_call=links["host_s_per_call"])
        what += (f"; {dist.get_backend(group)} all_to_all_single over {world} ranks on one node "
                 f"(latency and bandwidth fitted at {len(links['points'])} sizes, slowest rank)")
    else:
        fields.update(intra_bw=base.intra_bw, inter_bw=base.inter_bw, ranks_per_node=base.ranks_per_node,
                      latency_s=base.latency_s)
        what += f"; links from the shipped profile {base.name!r} (no group of two or more ranks to measure)"
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    return HardwareProfile(name=name or f"calibrated_{device.type}", source=f"muonlab.calibrate: {what}",
                           date=now, **fields)


# ---------------------------------------------------------------- files

def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    """``profile`` as JSON at ``path``."""
    if not isinstance(profile, HardwareProfile):
        raise TypeError(f"profile must be a HardwareProfile, got {type(profile).__name__}")
    text = json.dumps(dataclasses.asdict(profile), indent=1, allow_nan=False)
    Path(path).write_text(text + "\n")


def load_profile(path: str | Path) -> HardwareProfile:
    """The ``HardwareProfile`` saved at ``path`` (``save_profile``); a ValueError names the file and
    what is wrong with it (not JSON, fields missing or unknown, a value out of range)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"hardware profile file {str(path)!r} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"hardware profile file {str(path)!r} holds a {type(data).__name__}, not an object of fields")
    known = {f.name: f for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(data) - set(known))
    missing = sorted(n for n, f in known.items() if n not in data and f.default is dataclasses.MISSING)
    if unknown or missing:
        raise ValueError(f"hardware profile file {str(path)!r}: fields {missing} missing, {unknown} unknown "
                         f"(a HardwareProfile has {sorted(known)})")
    try:
        # JSON has lists where the profile keeps tuples (hashable, frozen)
        for key in ("matmul_rates", "host_s"):
            if key in data:
                data[key] = tuple(tuple(row) for row in data[key])
        return HardwareProfile(**data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"hardware profile file {str(path)!r}: {e}") from None
