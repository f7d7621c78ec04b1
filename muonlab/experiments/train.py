"""Train the small GPT with Muon under FSDP2 or DDP, or its MoE variant under expert parallelism x
FSDP2 ("ep"), in workers started by muonlab.launch (notebooks 02 and 03, the demo).

``train_worker`` runs on every rank and returns plain data (losses, the plan as rows, the counted
bytes, and on rank 0 every rank's spans of the last step), so a notebook or the CLI can show what
the optimizer did without touching the workers' tensors::

    from muonlab.launcher import launch
    from muonlab.experiments.train import train_worker
    results = launch(train_worker, 4, mode="fsdp", steps=5)
    results = launch(train_worker, 4, mode="ep", ep=2, num_experts=4, steps=5)  # (fsdp=2, ep=2)

The worker follows muonlab's device rule (:mod:`muonlab.distributed.device`): under NCCL the model
(moved by ``parallelize``) and each batch live on this rank's GPU, under gloo on the CPU.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from .. import runs
from .._base import check_whole
from ..comm.records import bytes_for_rank
from ..data import get_batch, load_corpus
from ..distributed.device import rank_device
from ..models import GPT, GPTConfig
from ..models.gpt import moe_config
from ..optim import Muon, muon_param_groups
from ..trace import StepRecorder, WholeStepRecorder
from .steps import distributed_steps, optimizer_report, plan_rows

__all__ = ["COMM_DTYPES", "MODES", "plan_rows", "tensor_devices", "train_worker"]

# The parallelize() modes that need no mesh from the caller ("hsdp" does).
MODES = ("fsdp", "ddp", "ep")
# The names comm_dtype_name and ns_dtype_name take; "auto" is Muon's default of each (comm_dtype "auto":
# each batch on the wire in its Newton-Schulz dtype).
COMM_DTYPES = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Experts each token goes to in train_worker's MoE GPT (moe_config's default; not an argument).
MOE_TOP_K = GPTConfig.top_k
STEPS_KEPT = 50
"""The last steps whose spans ``train_worker`` returns (``step_spans``)."""


def tensor_devices(model, opt) -> dict[str, list[str]]:
    """The devices this rank's parameters and optimizer state tensors live on, as sorted strings
    (a DTensor counts by its local shard), to check where a run actually computed. AdamW's step
    counters are left out: 0-d CPU tensors on every device, as in torch.optim."""
    state = {str(v.device) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
    return dict(params=sorted({str(p.device) for p in model.parameters()}), state=sorted(state))


def train_worker(
    mode: str = "fsdp",
    *,
    steps: int = 5,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    context: int = 64,
    batch_per_rank: int = 4,
    lr: float = 0.02,
    adamw_lr: float = 3e-3,
    comm_dtype_name: str = "auto",
    ns_dtype_name: str = "bf16",
    remainder_path: str | None = None,
    seed: int = 0,
    ep: int = 2,
    num_experts: int = 4,
    record: bool | str = True,
    whole_step_timeline: int = 0,
) -> dict:
    """Train for ``steps`` steps on this rank's slice of each global batch; return what happened.

    Every rank builds the model from the same seed and draws the same global batch of
    ``batch_per_rank * world_size`` windows from one seeded generator, then takes its own slice.
    Each step's loss goes to the launcher as it happens (``report_progress``: a launch's bar and
    live loss plot).

    Modes (``muonlab.distributed.parallelize``'s): "fsdp" (FSDP2 over the world), "ddp", and "ep":
    the MoE GPT (``num_experts`` experts per block) on ``build_ep_mesh(ep)``, a (world // ep, ep)
    mesh; ``apply_ep`` keeps this EP rank's experts, FSDP2-sharded over the ``MeshAxis.FSDP`` axis,
    and shards the dense parts over the world. ``ep`` and ``num_experts`` are read in "ep" mode only.

    Returns a dict with: rank, world_size, mode, losses (this rank's loss per step), mean_losses
    (mean over ranks per step), step_seconds (optimizer step per step), plan (``plan_rows``),
    plan_table (str), plan_bytes_sent / plan_bytes_recv (this rank's nonzero bytes per path
    according to the plan), stats (``last_step_stats()``), plan_batches (the ``BatchPlan`` records,
    for ``muonlab.viz.planner.plot_plan_per_rank``), device (this rank's, e.g. "cuda:0" or "cpu"),
    devices (``tensor_devices``: where the parameters and optimizer state ended up), spans: every
    rank's spans of the last step as dicts on rank 0, None on the other ranks, step_spans: the same
    for the last ``STEPS_KEPT`` steps, numbered (``muonlab.trace.StepRecorder``), span_clock: "gpu"
    or "host" (what the spans time), ns_choices (``Muon.resolved_choices()``) and record: the
    folder of the run record rank 0 wrote (None on the other ranks), whole_step_spans (see
    ``whole_step_timeline``). Per-rank entries of a plan row
    are group-local (a batch of expert banks in "ep" mode is planned over the ``MeshAxis.FSDP`` axis
    only).

    ``record``: True (default) has rank 0 keep a run record (muonlab.runs: the arguments, seeds,
    provenance, the mean losses and optimizer step seconds as a History, the plan table) in the
    launch's own folder ``runs/<launch name>/``, a string names a folder of its own under
    ``runs/``, False keeps none; ``muonlab.runs.load(name).rerun()`` launches it again.

    ``whole_step_timeline``: N > 0 records the last N steps whole (``muonlab.trace.WholeStepRecorder``:
    forward, backward, FSDP2's all-gathers and reduce-scatters, the optimizer's spans, under
    torch.profiler for those steps only) and returns every rank's spans on rank 0 as
    ``whole_step_spans`` (None on the other ranks, and when N is 0); CPU workers only.

    A ValueError naming the parameter, before any model is built: ``mode`` not in ``MODES``,
    ``steps``, ``batch_per_rank`` (or, in "ep" mode, ``ep``) not a whole number >= 1, in "ep"
    mode ``num_experts`` not one >= 2 (each token is routed to its top 2 experts), ``seed`` not
    one >= 0, a dtype name not in ``COMM_DTYPES``, ``whole_step_timeline`` not a whole number from 0
    to ``steps``.
    """
    _check_train_args(mode, steps=steps, batch_per_rank=batch_per_rank, seed=seed, ep=ep, num_experts=num_experts,
                      dtype_names={"comm_dtype_name": comm_dtype_name, "ns_dtype_name": ns_dtype_name})
    runs.check_record_arg(record)
    check_whole("whole_step_timeline", whole_step_timeline, 0)
    if whole_step_timeline > steps:
        raise ValueError(f"whole_step_timeline must be at most steps={steps} (the last steps are recorded), "
                         f"got {whole_step_timeline!r}")
    args = dict(mode=mode, steps=steps, d_model=d_model, n_layers=n_layers, n_heads=n_heads, context=context,
                batch_per_rank=batch_per_rank, lr=lr, adamw_lr=adamw_lr, comm_dtype_name=comm_dtype_name,
                ns_dtype_name=ns_dtype_name, remainder_path=remainder_path, seed=seed, ep=ep, num_experts=num_experts)
    world, rank = dist.get_world_size(), dist.get_rank()

    model, inner = _parallel_gpt(mode, seed=seed, ep=ep, num_experts=num_experts, d_model=d_model,
                                 n_layers=n_layers, n_heads=n_heads, context=context)
    extra = {} if remainder_path is None else dict(remainder_path=remainder_path)  # None: Muon's default
    opt = Muon(muon_param_groups(inner), lr=lr, adamw_lr=adamw_lr, comm_dtype=COMM_DTYPES[comm_dtype_name],
               ns_dtype=COMM_DTYPES[ns_dtype_name], **extra)
    recorder = StepRecorder(opt, keep=STEPS_KEPT)
    whole = None
    if whole_step_timeline:
        whole = WholeStepRecorder(model, opt, steps=whole_step_timeline, skip=steps - whole_step_timeline)
    ran = distributed_steps(model, opt, _corpus_batches(batch_per_rank, context, seed), range(steps))
    if whole is not None:
        whole.detach()

    plan = opt.plan()
    # Per-rank entries of a batch are indexed by this rank's place in the batch's group (the global
    # rank on the 1-D meshes of fsdp/ddp, the "fsdp" coordinate for expert banks in "ep" mode);
    # bytes_for_rank maps it, and leaves out paths that move nothing here, as the collectives do.
    plan_sent, plan_recv = bytes_for_rank(plan, rank)
    report = optimizer_report(opt, recorder)
    whole_step_spans = None if whole is None else whole.gather()
    folder = None
    if record is not False and rank == 0:
        folder = _keep_record(record, args, opt, mean_losses=ran.mean_losses, step_seconds=ran.opt_seconds,
                              world=world, plan_table=report["plan_table"])
    return dict(
        report, rank=rank, world_size=world, mode=mode, losses=ran.losses, mean_losses=ran.mean_losses,
        record=folder, step_seconds=ran.opt_seconds, plan_bytes_sent=plan_sent, plan_bytes_recv=plan_recv,
        plan_batches=list(plan), device=str(rank_device()), devices=tensor_devices(inner, opt),
        whole_step_spans=whole_step_spans,
    )


def _keep_record(record: bool | str, args: dict[str, Any], opt, *, mean_losses: list, step_seconds: list,
                 world: int, plan_table: str) -> str | None:
    """Rank 0's run record of ``train_worker`` (muonlab.runs), in the launch's folder unless named;
    a failure to write warns and fails no run. Returns the folder."""
    from ..train import History

    history = History(steps=list(range(1, len(mean_losses) + 1)), train_loss=list(mean_losses),
                      opt_time_s=list(step_seconds), ns_choices=opt.resolved_choices(),
                      tokens_per_step=args["batch_per_rank"] * world * args["context"])
    config = dict(train_worker=runs.encode(dict(args, world_size=world)), optimizer=runs.describe_optimizer(opt))
    rec = runs.new_record("train_worker", config=config, seeds=dict(model=args["seed"], batches=args["seed"]),
                          device=rank_device(), history=history, plan_table=plan_table)
    folder = runs.launch_folder() if record is True else None
    try:
        history.record = runs.save(rec, folder or runs.claim_folder("train_worker", None if record is True else record))
    except OSError as e:
        warnings.warn(f"train_worker: the run record was not written ({e})", stacklevel=2)
    return history.record


def _check_train_args(mode: str, *, steps, batch_per_rank, seed, ep, num_experts, dtype_names: dict) -> None:
    """``train_worker``'s own arguments, each error naming its parameter, before any model is built
    (the model's sizes are checked by GPTConfig, the optimizer's by Muon)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_whole("steps", steps, 1)
    check_whole("batch_per_rank", batch_per_rank, 1)
    check_whole("seed", seed, 0)
    if mode == "ep":  # read in "ep" mode only; 0 experts would silently train the dense GPT
        check_whole("ep", ep, 1)
        check_whole("num_experts", num_experts, 1)
        if num_experts < MOE_TOP_K:  # else GPTConfig refuses it later, naming top_k, not an argument here
            raise ValueError(f"num_experts must be >= {MOE_TOP_K} in 'ep' mode: each token is routed to "
                             f"top_k={MOE_TOP_K} experts (moe_config's default), got {num_experts!r}")
    for keyword, value in dtype_names.items():
        if value not in COMM_DTYPES:
            raise ValueError(f"{keyword} must be one of {sorted(COMM_DTYPES)}, got {value!r}")


def _parallel_gpt(mode: str, *, seed: int, ep: int, num_experts: int, **arch) -> tuple:
    """(model, the module whose parameters go to Muon): the GPT (the MoE GPT in "ep" mode), built
    from ``seed`` on every rank, then parallelized by ``mode``."""
    from ..distributed import parallelize

    torch.manual_seed(seed)
    if mode != "ep":
        model, inner, _ = parallelize(GPT(GPTConfig(**arch)), mode)
        return model, inner
    # MoE.forward returns a view and Block adds it out of place, so FSDP2's pre-backward hook is
    # kept; its warning about views would repeat in every layer and step of every worker.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMoE\) returned a view",
                            category=UserWarning)
    # same seed on every rank: apply_ep slices this EP rank's experts out of the full banks
    model, inner, _ = parallelize(GPT(moe_config(num_experts=num_experts, **arch)), mode, ep=ep)
    return model, inner


def _corpus_batches(batch_per_rank: int, context: int, seed: int):
    """``step -> this rank's batch``: its slice of a global batch of ``batch_per_rank * world``
    corpus windows, drawn in step order from one generator seeded alike on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    data = load_corpus("train")
    gen = torch.Generator().manual_seed(seed)
    mine = slice(rank * batch_per_rank, (rank + 1) * batch_per_rank)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = get_batch(data, batch_per_rank * world, context, gen)
        return x[mine], y[mine]

    return batch
