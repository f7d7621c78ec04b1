"""class Muon: its options, state, and the step's stages in order.

The math lives in ``functional`` (momentum, update, AdamW); moving matrices between ranks and
orthogonalizing them lives in ``muonlab.comm`` (plan + paths). This file only wires them. Muon's
options are one frozen record (``options``); its other parts are mixins, each in its own module:
the parameter groups, names and views checked at construction (``param_groups``), the last step's
stats and the skip count (``step_stats``), where momentum lives (``momentum_homes``) and loading
a state dict (``saved_state``).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ..comm.collectives import CommCounter, dist_on, rank_or_zero
from ..comm.engine import COMMUNICATION, execute_plan
from ..comm.paths.subgroup import ranks_per_expert, subgroups_for
from ..comm.planner import plan_batches
from ..comm.records import BatchPlan, Plan
from ..comm.specs import MatrixSpec, even_share_bytes, local_shard, matrix_spec, process_group_for
from ..comm.wire import wire_itemsizes
from ..kernels.config import NSConfig, form_for
from ..kernels.newton_schulz import possible_backends, resolve_dtype, resolve_form
from ..kernels.runner import NewtonSchulzRunner, default_budget
from ..trace import Tracer
from . import functional as F
from . import nonfinite
from .agreement import Agreement, digest
from .momentum_homes import MomentumHomes
from .offload import StateStores
from .replicas import check_ranks_agree, fingerprints, fold, name_the_difference
from .options import MuonOptions, OptionAttribute, check_attribute, check_options
from .param_groups import NamedParams
from .saved_state import STATE_KEYS, SavedState
from .step_gate import StepGate
from .state_table import StateTable
from .step_program import StepContext, StepProgram, lr_of, part_of
from .step_graph import StepGraph, check_capture_place
from .step_stats import StepStats
from .rule_step import RuleStage, ensure_rule_state, refuse_unfit, rule_of, state_shapes, with_rule_sums
from .rules import RULES
from .prepared import PreparedStep, group_key, settings_values, step_digest
from .validation import (SETTINGS, check_hyperparameters,
                         checked_fused_banks, fmt_shape, grad_layout_mismatch, state_mismatch)


class _Planned(NamedTuple):
    """A plan with what the step needs beside it, cached per set of parameters."""

    plan: Plan
    specs: dict[int, MatrixSpec]
    """Parameter index -> its layout."""
    groups: dict
    """GroupKey -> (torch ProcessGroup, this rank's index in it)."""
    owners: dict[int, tuple]
    """Replicated (DDP) parameter index -> (process group, owner's global rank, owned here)."""
    grads_compared: bool = False
    """Whether the replicas' gradients were compared across ranks (see
    ``muonlab.optim.replicas.check_ranks_agree``): False for a plan made outside a step, or where a
    gradient was not finite; the next step that uses it compares them then."""


def _why_captured_again(old: tuple, new: tuple) -> str:
    """Why a captured step's key changed (Muon._graph_key's parts), in words."""
    if old[0] != new[0]:
        return "the prepared step changed: which parameters have gradients, a plan setting or an option"
    if old[1] != new[1]:
        return ("a setting changed (a float lr under a scheduler keeps the step eager: give lr as a tensor on the "
                "parameters' device, which a scheduler fills in place)")
    return ("a parameter or gradient moved: zero_grad(set_to_none=True), torch's default, makes new gradients "
            "each step; use zero_grad(set_to_none=False)")


def _layout(p: torch.Tensor) -> tuple:
    """What a plan depends on of one parameter: which tensor it is, its global and local shapes,
    dtype, device and (for a DTensor) placements."""
    return (id(p), tuple(p.shape), tuple(local_shard(p).shape), p.dtype, p.device,
            tuple(getattr(p, "placements", ())))


class Muon(NamedParams, StepStats, MomentumHomes, SavedState, Optimizer):
    """Muon for matrices, AdamW for everything else, in one optimizer.

    Each parameter group carries ``"algorithm": "muon" | "adamw"`` (default "muon"). Muon groups
    take ``lr, momentum, nesterov, weight_decay, ns_steps, ns_coefficients, eps, adjust_lr,
    momentum_form``; AdamW groups take ``lr, betas, eps, weight_decay`` and fall back to the
    ``adamw_*`` arguments. Muon parameters must be at least 2-D; each has a matrix view (see
    muonlab.comm.specs), from ``muon_param_groups`` or ``matrix_views``, else by its shape: 2-D
    "matrix" (out, in); 3-D "bank" (leading dims index independent matrices, e.g. experts); 4-D+
    "flatten" (a conv kernel (out, in, *k) is one (out, in * prod(k)) matrix: a 4-D parameter is
    far more often a conv kernel than a bank of banks). Same-shape matrices are orthogonalized
    together in one batched Newton-Schulz chain. Momentum, like every hyperparameter, may differ
    per group: it is kept and applied per parameter before batching, and matrices of different
    groups share a batch only when their Newton-Schulz settings are equal (DeepSpeed's ZeRO Muon,
    with one fused momentum buffer, needs a single coefficient).

    ``params`` may be tensors, ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``) or
    groups of either. Names are kept on the optimizer (``param_name(p)``), never in
    ``param_groups`` or the state dict. ``ns_coefficients`` is a preset name, a list of per-step
    ``(a, b, c)``, or one ``(a, b, c)`` used at every step (torch.optim.Muon's format).

    ``defaults`` holds the Muon group defaults (with ``"algorithm": "muon"``); torch's schedulers
    read it. Momentum cycling (``OneCycleLR``/``CyclicLR`` with ``cycle_momentum=True``) finds
    ``"momentum"`` there and writes ``group["momentum"]`` into every group: a Muon group's momentum
    cycles, and in an AdamW group that key replaces beta1 (``betas[0]``), as those schedulers cycle
    beta1 for torch's Adam; beta2 stays. Without a scheduler AdamW groups have no "momentum" key
    (giving one is refused as an option of the other algorithm).

    Copies: ``copy.deepcopy`` and pickling keep every setting, the parameter names and the state,
    and the copy steps exactly like the original; hooks are not copied (as in torch). A
    ``process_group`` is shared by a deepcopy, and refuses pickling.

    Args beyond the hyperparameters:
        ns_dtype: Newton-Schulz compute dtype. "auto": bf16 on CUDA (like torch.optim.Muon), and on
            a CPU bf16 only with native bf16 matmul and for matrices above
            ``muonlab.kernels.newton_schulz.CPU_FP32_MAX_WORK``, else fp32 (emulated bf16 runs at a
            third of fp32's rate; small products are faster in fp32); or a dtype (fp32 for tight
            parity).
        ns_form: "plain", "gram" (fewer FLOPs on rectangular matrices, see newton_schulz; its
            iterates are fp16 where the device multiplies fp16 natively, else fp32, never bf16) or
            "auto": the gram form where it saves at least 20% of the FLOPs and its iterates are no
            wider than ns_dtype (on a CPU without fp16 matmul, a 16-bit ns_dtype keeps the plain
            form), the plain form elsewhere; its error stays within 1.5x of the plain form's (see
            muonlab.kernels.newton_schulz.AUTO_GRAM_SAVING for the time and accuracy measured).
            "plain" computes torch.optim.Muon's iteration; matrix by matrix it keeps torch's bits
            where bf16 matmul is native (an emulated one, on an AVX2-only CPU, rounds by the
            operands' layout, and a tall matrix iterates as stored here, transposed in torch), but
            batched products may round differently (last-bit differences that grow over a
            run). In the update itself: tall bf16
            parameters (rows > cols) may differ in the last bf16 bit: torch adds its update as a
            transposed view, muonlab as a contiguous tensor, and torch's bf16 ``add_`` rounds the
            two layouts differently. A tensor lr (torch's capturable form: one element, on the
            parameters' device or the CPU) stays a tensor: the step reads it on the device, where a
            scheduler fills it in place, with no host read; each update is multiplied by it in fp32
            and the decay is p + p * (-lr * weight_decay), so the bits differ from a float lr's
            (last-bit differences; the same holds for AdamW groups, whose bias corrections then
            run on the device too). Its value is checked when a new tensor is set, not after
            each fill (muonlab.optim.prepared.TensorSetting). And one difference that is
            torch's: with bf16 parameters and ``nesterov=False`` torch.optim.Muon (2.13) hands its
            momentum buffer itself to its Newton-Schulz, which divides it by its norm in place;
            muonlab's buffer follows the documented recurrence.
        ns_backend: "auto" (per shape, torch or Triton, whichever was measured faster on this
            device; see muonlab.kernels.backend_choice), "torch" or "triton".
        momentum_dtype: dtype of Muon's momentum buffers. None (default): the parameter's dtype, as
            torch.optim.Muon keeps it: for bf16 parameters 2 bytes per element, and the momentum
            accumulates in bf16 (an EMA step smaller than bf16's resolution of the buffer is lost).
            torch.float32: 4 bytes per element (twice the state memory of bf16 parameters, the same
            for fp32 ones), every small gradient contribution kept; the Newton-Schulz input is cast
            from it.
        workspace_bytes: the most transient memory one Newton-Schulz call may take (its inputs,
            iterates and output). A batch of same-shape matrices that needs more runs in chunks
            that fit, into one reused workspace; None: max(256 MiB on a GPU or 8 MiB on a CPU, 5% of
            a rank's even share of the Muon parameter bytes). Must be the same on every rank (it
            shapes the plan; checked). An expert bank with more matrices on a rank than
            fit runs in parts (``BatchPlan.part``: momentum, Newton-Schulz and update a part at a
            time), so its momentum inputs are never all alive at once either; replicated (DDP)
            matrices run in batches whose all-gather, which every rank receives, holds about as
            many matrices as fit. Smaller saves memory; too small (below one matrix) runs one
            matrix at a time.
        ns_graphs: on CUDA, capture each chunk shape's Newton-Schulz chain in a CUDA graph once
            and replay it (one launch per chunk instead of three per iteration: faster below
            width ~4096, where eager launches leave the GPU idle). Costs the static buffers of
            one chunk per distinct chunk shape, held between steps. Ignored on CPU.
        process_group: the group replicated (plain-tensor, DDP) parameters are divided over;
            default: the default group when torch.distributed runs with more than one rank.
            DTensor parameters always use their own mesh. Replicas must hold equal weights and
            equal (DDP-averaged) gradients; both are compared when a plan is made, the gradients
            also at every step (see muonlab.optim.replicas). For a model per rank, each trained on its
            own data, give each rank a group of its own (``dist.new_group([rank])``).
        comm_dtype: dtype of matrices on the wire. "auto" (default): per batch, the dtype its
            Newton-Schulz computes in (bf16 where that is bf16, fp32 otherwise: a bf16 wire
            under fp32 iterates rounds away what the iteration lifts, see muonlab.comm.wire), so
            a distributed step equals one process; ``plan()`` gives each batch's
            (``BatchPlan.comm_itemsize``). torch.bfloat16: every batch in bf16 (half an fp32
            batch's bytes, with that rounding); torch.float32: every batch in fp32. Not fp16:
            momentum travels before it is normalised, and fp16's range can't hold it.
        remainder_path: "auto", "all_to_all" or "agrs" for row-sharded batches of fewer than W
            matrices; "auto" takes the lower modelled time under ``hardware_profile``.
        hardware_profile: a muonlab.comm.cost profile name or HardwareProfile (default:
            "h100_node" with CUDA, else "cpu_gloo").
        fused_banks: {parameter name: E} for 2-D parameters that stack E matrices on dim 0 (a
            fused expert bank (E*M, N), a fused QKV per head); each is orthogonalized as E separate
            matrices. Added to those ``muon_param_groups(split_heads=...)`` declared.
        matrix_views: {parameter name: "matrix" | "transpose" | "flatten" | "bank"} for Muon
            parameters whose view differs from their shape's default, e.g. "transpose" for a 2-D
            weight stored (in, out): orthogonalized as stored, its lr ratio reads (out, in).
            Overrides the views ``muon_param_groups`` declared.
        nonfinite: an inf or NaN in any gradient on any rank makes every rank "skip" the step
            (decided together by one exchange of per-rank flags; parameters and state untouched,
            counted in ``skipped_steps`` and ``last_step_stats()``), "raise" a ValueError naming
            the parameter and rank, or is "ignore"d. The flags travel in the step's one control
            exchange with the ranks' agreement digest, before anything is written or moved
            (see ``_control``); on a GPU reading this rank's flag synchronises once per step.
        nonfinite_decision: where "skip" is decided: "host" (above: a skipped step runs nothing)
            or "device" (nothing read: the flags are added on the device in one all-reduce of W
            numbers on the step's group, the step runs whole and writes only if no rank
            flagged, bit for bit as "host" otherwise; ``skipped_steps`` and the stats read the
            decision when asked; see muonlab.optim.step_gate). "device" needs nonfinite="skip".
        strategy: "muonlab" (the planner) or "redundant" (every rank gathers and orthogonalizes
            every matrix: the baseline, for benchmarks and parity).
        state_offload: None (state on the parameters' device), "cpu" (momentum and AdamW moments
            of this rank's shards in host memory, pinned with CUDA) or "disk" (in one
            memory-mapped file per rank under ``offload_dir``). The step fetches one parameter's
            state at a time onto the device, the next one's meanwhile, and writes it back after
            its update: results are bit-identical to state_offload=None (see muonlab.optim.offload).
            With "disk" the optimizer can't be copied or pickled, nor take new parameter groups.
        offload_dir: the directory of the "disk" state file (required for "disk"; locked per rank).
        keep_muon_momentum_in_memory: offload only the AdamW moments; Muon momentum stays resident.
        update_rule: what happens between a matrix's orthogonalized update and its parameter, per
            group (a key of ``muonlab.optim.rules.RULES``): "muon" (the update as it is) or
            "normuon" (NorMuon, Li et al. 2025: per-row second moments, decay ``normuon_beta2``,
            normalise the update, then rescaled to the norm ``normuon_scale`` picks; see
            muonlab.optim.rules.normuon). NorMuon keeps one fp32 number per row of each matrix
            (state key "row_variance", with the rows: on their FSDP2 shard, with an expert, on
            every DDP replica; on the parameters' device under ``state_offload``). A batch of
            matrices whose rows lie on several ranks adds one all-reduce of two numbers per
            matrix, which travels while the next batch computes (the batch is applied then; see
            muonlab.optim.rule_step). A matrix stored (in, out) (view "transpose") keeps one
            number per stored column (its neurons) and is normalised by column; where its rows are
            sharded its column sums travel instead (out numbers per matrix) and that state is
            replicated over the ranks holding the rows. Refused for shards on a dim other than 0.
        normuon_beta2: NorMuon's decay of the row second moments, in [0, 1).
        normuon_scale: the Frobenius norm NorMuon rescales its normalised update to: "code" (the
            orthogonalized update's own, as the authors' code) or "paper" (an orthogonal matrix's,
            sqrt(min(m, n)): with adjust_lr="match_rms_adamw" and nesterov=False, the paper's
            Algorithm 1); see muonlab.optim.rules.normuon.
        capture_after: None, or N >= 1: on CUDA, the hot step runs eagerly N times with the same
            prepared step, settings and tensors, is then captured whole in a CUDA graph
            (collectives included, on NCCL) and replayed at every later step; the host part
            (validation when something changed, the ranks' agreement) still runs before each
            replay (muonlab.optim.step_graph). Needs nonfinite_decision="device" (or
            nonfinite="ignore"), ns_graphs=False, no state_offload, CUDA parameters, and
            gradients kept in place (``zero_grad(set_to_none=False)``); a scheduler's lr should
            be a tensor on the parameters' device (a float lr that changes keeps the step eager).
            A replayed step records no spans; its stats keep bytes and the skip, not seconds
            (``trace_next_step()`` runs the next step eagerly, with its spans, keeping the graph).

    Distributed: ``plan()`` says which path each batch takes and what it moves and computes;
    ``last_step_stats()`` and ``last_step_spans()`` say what the last step measured.
    """

    _optimizer_spectral_observer = None
    """Set by a SpectralRecorder for one step: called per matrix with its Newton-Schulz output.
    Named like torch's hook attributes, so copies drop it as they drop hooks."""

    # The optimizer-wide options, read from ``self.options`` (a frozen MuonOptions); setting one
    # makes a checked new record (muonlab.optim.options).
    options: MuonOptions
    ns_dtype = OptionAttribute()
    ns_form = OptionAttribute()
    ns_backend = OptionAttribute()
    momentum_dtype = OptionAttribute()
    workspace_bytes = OptionAttribute()
    ns_graphs = OptionAttribute()
    process_group = OptionAttribute()
    comm_dtype = OptionAttribute()
    remainder_path = OptionAttribute()
    strategy = OptionAttribute()
    hardware_profile = OptionAttribute()
    nonfinite = OptionAttribute()
    nonfinite_decision = OptionAttribute()
    capture_after = OptionAttribute()

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: Any = "keller",
        eps: float = 1e-7,
        adjust_lr: str | None = "original",
        momentum_form: str = "ema",
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        *,
        ns_dtype: torch.dtype | str | None = "auto",
        ns_form: str = "auto",
        ns_backend: str = "auto",
        momentum_dtype: torch.dtype | None = None,
        workspace_bytes: int | None = None,
        ns_graphs: bool = False,
        process_group=None,
        comm_dtype: torch.dtype | str = "auto",
        remainder_path: str = "auto",
        strategy: str = "muonlab",
        hardware_profile=None,
        nonfinite: str = "skip",
        nonfinite_decision: str = "host",
        fused_banks: dict[str, int] | None = None,
        matrix_views: dict[str, str] | None = None,
        state_offload: str | None = None,
        offload_dir=None,
        keep_muon_momentum_in_memory: bool = False,
        update_rule: str = "muon",
        normuon_beta2: float = 0.95,
        normuon_scale: str = "code",
        capture_after: int | None = None,
    ):
        self.options = MuonOptions(
            ns_dtype=ns_dtype, ns_form=ns_form, ns_backend=ns_backend, momentum_dtype=momentum_dtype,
            workspace_bytes=workspace_bytes, ns_graphs=ns_graphs, process_group=process_group, comm_dtype=comm_dtype,
            remainder_path=remainder_path, strategy=strategy, hardware_profile=hardware_profile, nonfinite=nonfinite,
            nonfinite_decision=nonfinite_decision, capture_after=capture_after)
        # the options' checks that need the parameters run as each is added (_check_placed_options)
        check_capture_place(capture_after, state_offload, (), None)
        self._muon_defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, ns_coefficients=ns_coefficients, eps=eps, adjust_lr=adjust_lr,
            momentum_form=momentum_form, update_rule=update_rule, normuon_beta2=normuon_beta2,
            normuon_scale=normuon_scale,
        )
        self._adamw_defaults = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
        # the arguments themselves, not only the groups that use them: a bad adamw_lr must not
        # wait for the first AdamW group added later
        check_hyperparameters(self._muon_defaults, "muon", "", "")
        check_hyperparameters(self._adamw_defaults, "adamw", "adamw_", "")
        self._adamw_defaults["betas"] = tuple(adamw_betas)
        self.fused_banks = checked_fused_banks(fused_banks)
        self._runner: NewtonSchulzRunner | None = None
        self._skipped_on_host, self._skips_on_device = 0, None  # skipped_steps: host and device counts
        self._names: dict[torch.Tensor, str] = {}
        self._views: dict[str, str] = {}
        self._plans: dict[tuple, tuple] = {}
        self._prepared: PreparedStep | None = None  # the last prepared step (see step())
        self._settings_checked: tuple | None = None  # the groups' settings when last checked
        # Muon entry index -> global rank holding a replicated matrix's momentum (see
        # _relocate_momentum); absent: not known yet, found by _resolve_homes at the next step
        self._replica_home: dict[int, int] = {}
        self._agreement = Agreement()
        self._tracer = Tracer(rank=rank_or_zero())  # the step recording or recorded last
        self._spare_tracer = Tracer(rank=self._tracer.rank)
        self._stats: dict = {}
        self._stats_tracer = self._tracer  # the one _stats' seconds are read from (resolved lazily)
        self._stats_gate: tuple | None = None  # the last step's gate, read by last_step_stats()
        # Validate every group before torch's constructor stores any of them.
        groups = self._normalise_params(params)
        # torch's schedulers read `defaults`: "momentum" here (and no "betas") makes OneCycleLR and
        # CyclicLR cycle group["momentum"] in every group (see the class docstring). A copy, since
        # torch's __setstate__ adds keys to it.
        super().__init__(groups, dict(algorithm="muon", **self._muon_defaults))
        unknown = sorted(set(self.fused_banks) - set(self._names.values()))
        if unknown:
            raise ValueError(f"fused_banks names {unknown} are not parameters of this optimizer "
                             "(pass named parameters or muon_param_groups(model))")
        for p, name in self._names.items():
            if name in self.fused_banks:
                matrix_spec(-1, name, p, None, self.fused_banks[name])  # validates the shape
        self._check_views(matrix_views or {})
        # last: every other check has passed, so a refused option leaves no lock or file behind
        self._offload = StateStores(
            state_offload, offload_dir, keep_muon_momentum_in_memory,
            [(p, g["algorithm"]) for g in self.param_groups for p in g["params"]], self._names,
            rank_or_zero(), momentum_dtype)

    # ------------------------------------------------------------------ copies

    def _copied_state(self) -> dict:
        # torch's copies drop hooks too; the plan cache and the prepared step hold live process
        # groups and are rebuilt.
        # An instance attribute over a method is a wrapper someone installed (an LR scheduler wraps
        # step, holding a reference to THIS optimizer): a copy keeps its own method
        return {k: v for k, v in vars(self).items() if k not in ("_plans", "_prepared", "_step_graph")
                and not k.startswith("_optimizer_") and not callable(getattr(type(self), k, None))}

    def __getstate__(self) -> dict:
        """Everything but hooks and the plan cache, so a pickled Muon keeps its settings and names."""
        if self.process_group is not None:
            raise TypeError("a Muon with a process_group can't be pickled (a process group is a live "
                            "communicator): save state_dict() instead, or copy.deepcopy, which shares the group")
        return self._copied_state()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # also what torch's load_state_dict calls, with state and groups only
        if not isinstance(self.state, StateTable):  # a loaded state dict's defaultdict
            self.__dict__["state"] = StateTable(self.state)
        self.__dict__.setdefault("_plans", {})
        self.__dict__["_prepared"] = None  # made again at the next step (it holds live process groups)
        self.__dict__.setdefault("_settings_checked", None)
        self.__dict__.setdefault("_replica_home", {})  # pickled before momentum followed its owner
        self.__dict__.setdefault("_agreement", Agreement())  # pickled before the per-step agreement
        if "_skipped_on_host" not in self.__dict__:  # pickled when the count was a plain attribute
            self._skipped_on_host, self._skips_on_device = int(self.__dict__.pop("skipped_steps", 0)), None
        self.__dict__.setdefault("_stats_gate", None)  # pickled before the decision on the device
        if "_tracer" in self.__dict__ and "_spare_tracer" not in self.__dict__:  # pickled before GPU spans
            self._spare_tracer = Tracer(rank=self._tracer.rank)
            self._stats_tracer = self._tracer
        if "_offload" not in self.__dict__:  # pickled before state offload existed
            self._offload = StateStores(None, None, False, [], {}, 0)
        if "options" not in self.__dict__:  # pickled when each option was an attribute of its own
            legacy = {f.name: self.__dict__.pop(f.name) for f in dataclasses.fields(MuonOptions)
                      if f.name in self.__dict__}
            if "momentum_dtype" not in legacy:  # pickled before the memory options: momentum was fp32
                legacy.update(momentum_dtype=torch.float32, workspace_bytes=None, ns_graphs=False)
                self._runner = None
                for store in self._offload.stores():
                    store.momentum_dtype = torch.float32
            self.__dict__["options"] = MuonOptions(**legacy)  # nonfinite_decision: "host", as before the device's
        elif "capture_after" in self.__dict__:  # pickled when capture_after was an attribute beside the record
            self.__dict__["options"] = dataclasses.replace(self.options, capture_after=self.__dict__.pop("capture_after"))
        self.__dict__["_step_graph"] = None if self.capture_after is None else StepGraph(self.capture_after)

    def __setattr__(self, name: str, value: Any) -> None:
        """Every option set is applied or refused: ``options`` takes a checked ``MuonOptions``, and
        once constructed, a public name nothing would read (an argument read at construction only, a
        group setting, a near-miss of an option's name) is refused (muonlab.optim.options.check_attribute).
        Private names pass untouched."""
        if name == "options":
            self._set_options(value)
            return
        if name == "state" and not isinstance(value, StateTable):  # torch's constructor sets a defaultdict
            value = StateTable(value)
        if name[:1] != "_" and "_offload" in self.__dict__:  # constructed: _offload is set last
            public = {n for n in (*dir(type(self)), *self.__dict__) if not n.startswith("_")}
            check_attribute(name, public)
        super().__setattr__(name, value)

    def _set_options(self, options: MuonOptions) -> None:
        """Replace the options record (checked, also against the parameters and the state's home once
        they are known; a refused record changes nothing); a new ``capture_after`` makes a new
        StepGraph (the warm-up counts anew)."""
        check_options(options)
        if "_offload" in self.__dict__:  # constructed; in __init__ each parameter is checked as it is added
            check_capture_place(options.capture_after, self._offload.place, (), None)
            self._check_placed_options(options, [(p, g["algorithm"]) for g in self.param_groups for p in g["params"]])
        old = self.__dict__.get("options")
        super().__setattr__("options", options)
        if old is None or old.capture_after != options.capture_after:
            if self.__dict__.get("_step_graph") is not None:
                self._step_graph.release()
            self._step_graph = None if options.capture_after is None else StepGraph(options.capture_after)

    def __deepcopy__(self, memo: dict) -> "Muon":
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group  # shared, like a device: not state
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self._copied_state(), memo))
        return twin

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        """One step, in the order it runs:

        1. the prepared step (``_prepared_step``): validation, the step's description, the work
           lists; reused while nothing it depends on changed (``muonlab.optim.prepared``);
        2. the control exchange (``_control``): every rank about to take the same step, and no
           gradient non-finite on any rank; both decided before anything is written;
        3. the plan (``_plan_for``, cached; checked across ranks when new);
        4. the hot step (``_hot_step``): the non-finite gate where it is decided on the device,
           momentum moved to the matrices' owners where needed, AdamW, then the Muon batches
           (``_muon_step``: momentum, paths, Newton-Schulz, update). With ``capture_after`` it is
           captured in a CUDA graph once warm and replayed (muonlab.optim.step_graph).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        prepared = self._prepared_step()  # raises before any state changes
        self._offload.check()  # an offload file truncated or replaced: raise before any read
        graph = self._step_graph
        mode = "eager" if graph is None else graph.mode(self._graph_key(prepared), _why_captured_again)
        if self._tracer is self._stats_tracer:
            # record into the other tracer: if this step raises, the last step's stats can still
            # read their seconds (resolving them here instead would synchronise inside the step)
            self._tracer, self._spare_tracer = self._spare_tracer, self._tracer
        # a graph records no spans: capturing, the tracer keeps host time (CUDA events can't be recorded)
        self._tracer.reset(self._trace_device() if mode == "eager" else torch.device("cpu"))
        counter = CommCounter()
        seconds: dict[str, float] = {}  # the check's host seconds: its pass, and the exchange
        bad_ranks, bad_names = self._control(prepared, seconds)
        if bad_ranks:  # "skip" (under "raise" _control raised)
            self._skipped_on_host += 1
            self._record_stats(counter, seconds, skipped=True, nonfinite_ranks=bad_ranks, nonfinite_params=bad_names)
            return loss
        if mode == "replay":
            graph.replay()
            stats, stats_gate = graph.captured_stats  # the gate's flags are the graph's: this replay's
            self._stats, self._stats_gate, self._stats_tracer = dict(stats, seconds={}), stats_gate, self._tracer
            return loss
        if mode == "capture":
            graph.capture(lambda: self._hot_step(prepared, counter, seconds))
            graph.captured_stats = (copy.copy(self._stats), self._stats_gate)
            return loss
        self._hot_step(prepared, counter, seconds)
        if graph is not None:
            graph.ran_eagerly()
        return loss

    def _hot_step(self, prepared: PreparedStep, counter: CommCounter, seconds: dict) -> None:
        """Everything after the control exchange: device work only once the plan is made (the
        part ``capture_after`` captures in a CUDA graph)."""
        gate = self._gate(prepared) if self.nonfinite_decision == "device" else None
        planned = self._planned_for(prepared)
        if planned is not None:  # count this step's unhealthy updates, on the device (see last_step_stats)
            self._ns_runner().health.begin_step()
        if planned and (planned.owners or self._replica_home):  # where momentum lives follows the plan
            t0 = self._tracer.mark()
            if planned.owners:
                self._relocate_momentum(planned.owners, counter)
            if self._replica_home:
                self._spread_momentum(planned, counter)
            self._tracer.tally(COMMUNICATION, t0, self._tracer.mark())
        with self._tracer.span("adamw"):
            for group, params in prepared.work["adamw"]:
                self._adamw_group(group, params, gate)
        if planned is not None:
            self._muon_step(planned, counter, gate)
        if gate is None:
            self._record_stats(counter, seconds, skipped=False)
        else:
            self._count_skip(gate)
            self._record_stats(counter, seconds, skipped=None, gate=gate, checked=prepared.checked)

    def _graph_key(self, prepared: PreparedStep) -> tuple:
        """What a captured step depends on: the prepared step, the settings (a tensor lr by
        identity), and where every parameter and gradient it reads lies (muonlab.optim.step_graph)."""
        places = tuple((local_shard(p).data_ptr(), local_shard(p.grad).data_ptr()) for p in prepared.checked)
        return prepared.key, self._settings_checked, places

    def drop_captured_step(self) -> None:
        """Drop the CUDA graph of ``capture_after`` (if any): the step warms up and captures again.
        Call it before ``dist.destroy_process_group()``: a live graph holds NCCL work. Loading
        state and moving momentum between ranks call it too."""
        if self._step_graph is not None:
            self._step_graph.release()

    def trace_next_step(self) -> None:
        """With ``capture_after``: run the next step eagerly, so that it records its spans and
        seconds (a replayed step records none), and keep the captured graph for the steps after
        it. Without a captured step every step is eager, and this changes nothing."""
        if self._step_graph is not None:
            self._step_graph.eager_next()

    def _prepared_step(self) -> PreparedStep:
        """The prepared step for this step: the last one while its key holds, else a new one
        (validation first: a refused gradient or setting raises before anything changes). The
        settings read per step are checked whenever they changed."""
        key = (tuple(group_key(g) for g in self.param_groups), self.options)
        settings = settings_values(self.param_groups)
        if settings != self._settings_checked:
            for gi, group in enumerate(self.param_groups):
                self._check_lr_device(group, gi)  # first: reading a tensor lr on the wrong device fails
                check_hyperparameters(group, group["algorithm"], "", f" in parameter group {gi}")
        prepared = self._prepared
        if prepared is None or prepared.key != key:
            work = self._collect()
            group = self._check_group()
            together = group is not None and dist.get_world_size(group) > 1  # else nothing to agree on
            prepared = PreparedStep(
                key=key, work=work, indices=self._muon_indices(work["muon"]),
                checked=tuple(p for kind in ("muon", "adamw") for _, ps in work[kind] for p in ps),
                static_digest=digest(self._step_description(work, settings=False)) if together else 0,
                check_group=group if together else None)
            self._prepared = prepared
        self._settings_checked = settings
        return prepared

    def _control(self, prepared: PreparedStep, seconds: dict) -> tuple[list[int], list[str]]:
        """The step's commit decision, before anything is written: the non-finite check's flag of
        this rank (one fused pass over the grads) and the fingerprint of its replicated gradients
        (read with the flag), then one exchange with the other ranks of the step's group carrying
        them and the step's digest (``Agreement.check``: a rank that disagrees, or replicas whose
        gradients differ, make every rank raise the same error). Returns the global ranks with a
        non-finite gradient (the same on every rank) and this rank's culprits; raises under
        ``nonfinite="raise"``. ``seconds``: "check" (the pass) and "wait" (the exchange), host
        seconds, when the check is on.

        The fingerprint rides on the host's read of the flag: with ``nonfinite="ignore"`` or
        ``nonfinite_decision="device"`` (and so captured steps) no flag is read, and reading one
        would synchronise a GPU step that otherwise does not; there the replicas' gradients are
        compared when a plan is made only (muonlab.optim.replicas.check_ranks_agree)."""
        checking = self.nonfinite != "ignore" and self.nonfinite_decision == "host"  # else: _gate
        t0 = time.perf_counter()
        replicas = prepared.replicas if checking else ()
        values: list[int] = []  # the replicas' fingerprints, read with the flag
        flagged = checking and nonfinite.found([p.grad for p in prepared.checked],
                                               fingerprints([p.grad for p in replicas]) if replicas else None, values)
        t1 = time.perf_counter()
        group = prepared.check_group
        if group is not None:
            bad_ranks = self._agreement.check(
                group, step_digest(prepared, self._settings_checked), flagged,
                lambda: self._step_description(prepared.work), fold(values) if replicas else 0,
                lambda side: name_the_difference(side, self._plan_names(prepared, replicas), replicas, values))
        else:
            bad_ranks = [rank_or_zero()] if flagged else []
        if checking:
            seconds.update(check=t1 - t0, wait=time.perf_counter() - t1)
        if not bad_ranks:
            return [], []
        names = self._culprits(prepared.checked) if flagged else []
        if self.nonfinite == "raise":
            mine = f"; here: {', '.join(names)}" if names else ""
            raise ValueError(f"non-finite gradient on rank(s) {bad_ranks}{mine}")
        return bad_ranks, names

    def _plan_names(self, prepared: PreparedStep, params: tuple) -> list[str]:
        """Names of Muon parameters as the plan gives them (an unnamed one: "param<entry index>")."""
        index = {id(p): i for p, i in zip(prepared.checked, prepared.indices)}
        return [self._names.get(p, f"param{index[id(p)]}") for p in params]

    def _culprits(self, checked: tuple) -> list[str]:
        """The parameters among ``checked`` whose grad holds an inf or NaN, by name (or shape)."""
        return nonfinite.culprits([p.grad for p in checked], lambda i: self._names.get(
            checked[i], f"of shape {fmt_shape(checked[i].shape)}"))

    def _gate(self, prepared: PreparedStep) -> StepGate:
        """The step's decision on the device (nonfinite_decision="device"): this rank's flag,
        added with the other ranks' of the step's group in one async all-reduce, issued after the
        control exchange (so ranks that disagree raise before it)."""
        return StepGate.decide([p.grad for p in prepared.checked], self._trace_device(), prepared.check_group)

    def _check_lr_device(self, group: dict, gi: int) -> None:
        """A tensor lr lives on its parameters' device (read there by the step) or on the CPU."""
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor) or lr.device.type == "cpu":
            return
        for p in group["params"]:
            if local_shard(p).device != lr.device:
                raise ValueError(f"parameter group {gi}'s tensor lr is on {lr.device} and its parameter "
                                 f"{self._label(p)} on {local_shard(p).device}: put lr on the parameters' device")

    def _planned_for(self, prepared: PreparedStep) -> _Planned | None:
        """The prepared step's plan (None: no Muon parameter has a gradient), made (and checked
        across ranks, gradients included) by ``_plan_for`` on the first step that needs it, then
        kept with the prepared step."""
        if not prepared.indices:
            return None
        if prepared.planned is None:
            planned = self._plan_for(prepared.indices, stepping=True)
            if not planned.grads_compared:  # compared by the next step that uses this plan
                return planned
            self._prepared = prepared = dataclasses.replace(prepared, planned=planned)
        return prepared.planned

    def _step_description(self, work: dict[str, list], settings: bool = True) -> list[tuple]:
        """What this rank is about to do, for muonlab.optim.agreement: each parameter with a
        gradient (its name, or its place for an unnamed one; global shape, dtype; its group's
        Newton-Schulz config and, with ``settings``, its settings), then the step's options."""
        place: dict[int, str] = {}  # of unnamed parameters, made only if one has a gradient

        def name_of(p: torch.Tensor) -> str:
            if p in self._names:
                return self._names[p]
            if not place:
                place.update((id(q), f"#{k} of group {gi}")
                             for gi, g in enumerate(self.param_groups) for k, q in enumerate(g["params"]))
            return place[id(p)]

        items = []
        for kind in ("muon", "adamw"):
            for group, params in work[kind]:
                fields = ()
                if settings:
                    # a tensor setting read here, where ranks already disagree (the digest holds its kind only)
                    fields = tuple((k, f"tensor {float(group[k]):g} ({group[k].dtype} on {group[k].device.type})"
                                    if torch.is_tensor(group[k]) else group[k]) for k in SETTINGS[kind])
                if kind == "muon":
                    fields += (("newton_schulz", repr(self._ns_config(group))),)
                for p in params:
                    items.append((kind, name_of(p), (("shape", tuple(p.shape)), ("dtype", str(p.dtype))) + fields))
        items.append(("options", "", (("nonfinite", self.nonfinite),
                                      ("nonfinite_decision", self.nonfinite_decision),
                                      ("comm_dtype", str(self.comm_dtype)),
                                      ("workspace budget (workspace_bytes)",
                                       self._ns_runner().budget_bytes if self._muon_entries() else None),
                                      ("strategy", self.strategy), ("remainder_path", self.remainder_path),
                                      ("momentum offload", self._offload.place_of("momentum_buffer") or "none"))))
        return items

    def _check_group(self):
        """The process group whose ranks decide a skip together (None: this process alone)."""
        return self._replicate_group() if self.process_group is None else self.process_group

    def _collect(self) -> dict[str, list]:
        """Parameters with grads, per group; every grad, and the shape of each one's state, is
        checked before anything is modified (when a prepared step is made: torch itself refuses a
        grad of another shape, dtype or device than its parameter's)."""
        work: dict[str, list] = {"muon": [], "adamw": []}
        for group in self.param_groups:
            params = []
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise ValueError(f"parameter {self._label(p)} has a sparse gradient; Muon needs dense gradients")
                if torch.is_complex(g):
                    raise ValueError(f"parameter {self._label(p)} has a complex gradient")
                if not g.is_floating_point():
                    raise TypeError(f"parameter {self._label(p)} has a gradient of dtype {g.dtype}; "
                                    "gradients must be floating point")
                if g.shape != p.shape:
                    raise ValueError(
                        f"parameter {self._label(p)} has a gradient of shape {fmt_shape(g.shape)}"
                    )
                layout = grad_layout_mismatch(p, g)
                if layout:
                    raise ValueError(f"parameter {self._label(p)} has {layout}")
                mismatch = state_mismatch(p, self.state[p], self._rule_shapes(group, p)) if p in self.state else None
                if mismatch:
                    raise ValueError(
                        f"parameter {self._label(p)} has state {mismatch}: it changed shape after its state "
                        "was made (e.g. resize_token_embeddings); drop its state (del opt.state[p]) or "
                        "rebuild the optimizer")
                params.append(p)
            if params:
                work[group["algorithm"]].append((group, params))
        return work

    def _rule_shapes(self, group: dict, p: torch.Tensor) -> dict[str, tuple[int, ...]]:
        """The shapes of the state a Muon group's update rule keeps for ``p`` (none for AdamW)."""
        return state_shapes(group, p, self._view_of(p)) if group.get("algorithm") == "muon" else {}

    def _state_for(self, p: torch.Tensor, algorithm: str, group: dict | None = None) -> dict:
        """p's state, its missing keys made: zeros where they are kept (device, host or the state
        file), never all on the device; with a Muon ``group``, its update rule's state too."""
        state = self.state[p]
        keys = STATE_KEYS[algorithm]
        if keys[-1] not in state:  # new, or a replica's momentum dropped (muonlab.optim.momentum_homes)
            for key in keys:
                if key not in state:
                    state[key] = torch.tensor(0.0) if key == "step" else self._offload.new(p, key)
        if group is not None and RULES[group["update_rule"]].state_keys:
            ensure_rule_state(state, group, p, self._view_of(p))
        return state

    def _adamw_group(self, group: dict, params: list[torch.Tensor], gate: StepGate | None = None) -> None:
        items = [(p, p, self._state_for(p, "adamw")) for p in params]
        # no host read (muonlab.optim.functional.adamw_): the step count lives with the parameter
        on_device = gate is not None or isinstance(group["lr"], torch.Tensor) or self._step_graph is not None
        if on_device:
            for p in params:
                step = self.state[p]["step"]
                if step.device != local_shard(p).device:
                    self.state[p]["step"] = step.to(local_shard(p).device)
        beta1, beta2 = group["betas"]
        beta1 = group.get("momentum", beta1)  # a scheduler cycling momentum: see the class docstring
        # one parameter at a time (adamw_ is a loop over its lists, so this is the same arithmetic):
        # only the state being updated is on the device
        for p, (exp_avg, exp_avg_sq) in self._offload.each(items, ("exp_avg", "exp_avg_sq")):
            F.adamw_(
                [local_shard(p)], [local_shard(p.grad)], [exp_avg], [exp_avg_sq], [self.state[p]["step"]],
                lr=lr_of(group),
                betas=(beta1, beta2),
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                gate=gate,
                on_device=on_device,
            )

    # ------------------------------------------------------------------ Muon: plan, then paths

    def _muon_entries(self) -> list[tuple[dict, torch.Tensor]]:
        """Every Muon parameter with its group, in the optimizer's (rank-independent) order."""
        return [(g, p) for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]]

    def _replicate_group(self):
        if self.process_group is not None:
            return self.process_group
        return dist.group.WORLD if dist_on() and dist.get_world_size() > 1 else None

    def _plan_for(self, indices: tuple[int, ...], collective: bool = True, stepping: bool = False) -> "_Planned":
        """The plan for these Muon parameters. Cached: it depends only on metadata and on the
        settings below (part of the key, so changing one re-plans).

        A new plan is first checked against the other ranks' and its sub-groups made, both
        collectives. ``collective=False`` (``plan()``, which one rank may call alone) skips them
        and leaves the plan uncached, so the step still checks it. ``stepping``: called by a step,
        whose gradients (all present) are compared too; a plan made outside a step
        (consolidate_state, release_unowned_state: gradients there need not be a step's) has
        them compared by the first step that uses it, in one more exchange of the same check."""
        entries = self._muon_entries()
        # one config per group (settings may change between steps, so made anew each step)
        by_group = {id(g): self._ns_config(g) for g in self.param_groups if g["algorithm"] == "muon"}
        configs = tuple(by_group[id(entries[i][0])] for i in indices)
        # each parameter's identity and layout too: one may be replaced, resized (p.data = ...) or
        # resharded between steps, and a plan made for its old shape would update it wrongly
        layouts = tuple(_layout(entries[i][1]) for i in indices)
        rules = tuple(entries[i][0]["update_rule"] for i in indices)  # a rule may refuse a layout
        cache_key = (indices, configs, layouts, rules, self.comm_dtype, self.strategy, self.remainder_path,
                     self.hardware_profile)
        if cache_key not in self._plans:
            if self._runner is not None:  # a new plan is made outside the hot step: the place to read them
                self._runner.health.warn_unread(" (read when making a new plan)")
            for i in indices:  # still a matrix Muon can update (it may have changed since construction)
                self._check_param(entries[i][1], "muon")
            replicate = self._replicate_group()
            specs, groups = [], {None: (None, 0)}
            for i in indices:
                group, p = entries[i]
                name = self._names.get(p, f"param{i}")
                spec = matrix_spec(i, name, p, replicate, self.fused_banks.get(name, 1), self._view_of(p))
                refuse_unfit(group, spec)
                specs.append(spec)
                if spec.group not in groups:
                    groups[spec.group] = process_group_for(p, spec, replicate)
            compared = False
            if collective:  # before planning: disagreeing ranks can't plan alike
                compared = check_ranks_agree(self._check_group(), specs, configs, [entries[i][1] for i in indices],
                                             self._ns_runner().budget_bytes, grads=stepping)

            def momentum_dtype(spec: MatrixSpec) -> torch.dtype:  # what Newton-Schulz reads with ns_dtype=None
                return self._offload.dtype(entries[spec.index][1], "momentum_buffer")

            # each batch's wire dtype follows its Newton-Schulz dtype on this device (comm_dtype "auto")
            wire = wire_itemsizes(self.comm_dtype, device=self._device(), input_dtype=momentum_dtype)
            plan = plan_batches(
                specs, configs, comm_itemsize=wire,
                remainder_path=self.remainder_path, strategy=self.strategy, profile=self.hardware_profile,
                max_local_matrices=self._max_local_matrices,
            )
            plan = with_rule_sums(plan, {s.index: s for s in specs}, lambda i: rule_of(entries[i][0]))
            owners = {}
            for b in plan:
                if b.part is not None:  # a bank that can't be cut raises here, before anything changes
                    part_of(b, local_shard(entries[b.param_indices[0]][1]))
                if b.path == "subgroup" and collective:  # sub-groups are made collectively, here, never mid-step
                    subgroups_for(b.group, ranks_per_expert(b))
                if b.path == "owner":
                    pg, me = groups[b.group]
                    owners.update({i: (pg, dist.get_global_rank(pg, o), o == me)
                                   for i, o in zip(b.param_indices, b.owners)})
            planned = _Planned(plan, {s.index: s for s in specs}, groups, owners, compared)
            if not collective:
                return planned
            self._plans[cache_key] = planned
        elif stepping and not self._plans[cache_key].grads_compared:  # (the cache is alike on every rank)
            planned = self._plans[cache_key]
            compared = check_ranks_agree(self._check_group(), [planned.specs[i] for i in indices], configs,
                                         [entries[i][1] for i in indices], self._ns_runner().budget_bytes, grads=True)
            self._plans[cache_key] = planned._replace(grads_compared=compared)
        return self._plans[cache_key]

    def plan(self) -> list[BatchPlan]:
        """One record per batch (names, shape, path, ranks, bytes, FLOPs), from global metadata only."""
        plan = self._plan_for(tuple(range(len(self._muon_entries()))), collective=False).plan
        return list(plan)

    def resolved_choices(self) -> list[dict]:
        """What ``ns_dtype``, ``ns_form`` and ``ns_backend`` ("auto" or not) mean for each batch of
        the plan: one dict per batch with its names, matrix shape, matrices (a fused bank's or
        split head's blocks each count), path, wave (the first batch of
        the wave it travels in, or None: ``BatchPlan.travels_with``) and the Newton-Schulz dtype,
        form and backend. After a step these are what ran on this rank; before one (or for
        a batch this rank did not orthogonalize) the dtype and form follow the same rules from the
        shapes, and an "auto" backend reads "auto (timed at the first step)" where two could run.
        And ``wire_dtype``, what its matrices travel in (``comm_dtype``; the plan's, on every rank)."""
        runner_ran = self._runner.ran if self._runner is not None else {}
        device = self._device()
        rows = []
        for batch in self.plan():
            shape = tuple(batch.matrix_shape)
            ran = runner_ran.get(shape)
            if ran is None:
                cfg = batch.ns_config
                dtype = resolve_dtype(cfg.dtype, device, shape) or self._muon_entries()[0][1].dtype
                backends = possible_backends(cfg.backend, device, dtype)
                ran = dict(dtype=str(dtype).removeprefix("torch."), form=form_for(cfg, shape),
                           backend=backends[0] if len(backends) == 1 else "auto (timed at the first step)")
            rows.append(dict(batch=batch.index, names=batch.names, shape=shape, matrices=batch.num_matrices,
                             path=batch.path, wave=batch.travels_with, **ran,
                             wire_dtype=str(batch.wire_dtype).removeprefix("torch.")))
        return rows

    def _trace_device(self) -> torch.device:
        """Where the step's work runs, for the tracer's clock: the Muon parameters' device (CUDA
        events there), else the first parameter's."""
        entries = self._muon_entries()
        if entries:
            return self._device()
        for group in self.param_groups:
            for p in group["params"]:
                return local_shard(p).device
        return torch.device("cpu")

    # ------------------------------------------------------------------ state for checkpoints

    def init_state(self) -> None:
        """Create every parameter's state now (zeros, no collective), so every rank holds the
        same keys and global shapes before the first step, as distributed checkpointing needs."""
        for group in self.param_groups:
            for p in group["params"]:
                self._state_for(p, group["algorithm"], group if group["algorithm"] == "muon" else None)

    def state_residency(self) -> dict[str, int]:
        """Bytes of momentum and AdamW moments on the parameters' device between steps
        ("device_bytes") and offloaded ("offloaded_bytes": held where their store keeps them, the
        state file's mapping for "disk"), and the most the fetch window held on the device during a
        step so far ("peak_window_bytes")."""
        out = dict(device_bytes=0, offloaded_bytes=0, peak_window_bytes=self._offload.peak_window_bytes())
        for state in self.state.values():
            for key, value in state.items():
                if key in self._offload.by_key and torch.is_tensor(value):
                    local = local_shard(value)
                    where = "offloaded_bytes" if self._offload.by_key[key].holds(local) else "device_bytes"
                    out[where] += local.numel() * local.element_size()
        return out

    def _muon_indices(self, work: list[tuple[dict, list[torch.Tensor]]]) -> tuple[int, ...]:
        position = {id(p): i for i, (_, p) in enumerate(self._muon_entries())}
        return tuple(position[id(p)] for _, params in work for p in params)

    def _muon_step(self, planned: "_Planned", counter: CommCounter, gate: StepGate | None = None) -> None:
        """Batch by batch (see muonlab.comm.engine): momentum on the local shards, move,
        orthogonalize, move back, update; only the batches in flight hold inputs and outputs. The
        stages are the step program's (muonlab.optim.step_program), made once per prepared step.
        The step's commit decision was taken before (``_control``): everything here writes,
        through ``gate`` where it is taken on the device (muonlab.optim.step_gate)."""
        program = self._program_for(planned)
        stage = None
        if any(rule_of(g).transform is not None for g in self.param_groups if g["algorithm"] == "muon"):
            entries = self._muon_entries()

            def rule_state(i: int) -> dict:
                p = entries[i][1]
                state = self.state[p]  # a replica's rule state lives on every rank (muonlab.optim.rule_step)
                ensure_rule_state(state, entries[i][0], p, self._view_of(p))
                return state

            stage = RuleStage(entries=entries, specs=planned.specs, groups=planned.groups, state_of=rule_state,
                              counter=counter, apply_update=program.ruled_update, gate=gate)
        program.begin(StepContext(
            state=self.state, state_for=lambda p, group: self._state_for(p, "muon", group), offload=self._offload,
            tracer=self._tracer, gate=gate, observer=self._optimizer_spectral_observer, stage=stage))
        # 2. move, orthogonalize, move back
        execute_plan(planned.plan, planned.groups, prepare=program.prepare, apply=program.apply,
                     orthogonalize=self._ns_runner(), tracer=self._tracer, counter=counter,
                     device=self._device(), contexts=program.contexts)  # wire: each batch's
        if stage is not None:
            stage.flush()  # the last batch whose rule's sums travelled

    def _program_for(self, planned: "_Planned") -> StepProgram:
        """The step program of the plan: kept with the prepared step once the plan is
        (``_planned_for``); made anew for a plan not kept yet."""
        prepared = self._prepared
        if prepared.program is not None and prepared.program[0] is planned:
            return prepared.program[1]
        program = StepProgram(planned.plan, self._muon_entries(), planned.specs, planned.owners, planned.groups,
                              self._device())
        if prepared.planned is planned:
            self._prepared = dataclasses.replace(prepared, program=(planned, program))
        return program

    def _device(self) -> torch.device:
        """Where this rank's Muon shards live (the first Muon parameter's device)."""
        return local_shard(self._muon_entries()[0][1]).device

    def _ns_runner(self) -> NewtonSchulzRunner:
        """The Newton-Schulz runner (chunks within the workspace budget, reused buffers, graphs),
        made at the first step; its ``budget_bytes`` is the one budget the plan and the chunks use.
        The default is computed from each parameter's even share of its bytes, not from this
        rank's own shards: it decides how matrices are grouped into batches, so it must be the
        same on every rank (uneven FSDP2 shards would otherwise give ranks different plans)."""
        if self._runner is None:
            budget = self.workspace_bytes
            if budget is None:
                share = sum(even_share_bytes(p) for _, p in self._muon_entries())
                budget = default_budget(share, self._device().type)
            self._runner = NewtonSchulzRunner(budget, graphs=self.ns_graphs)
        return self._runner

    def _max_local_matrices(self, shape: tuple[int, int], cfg: NSConfig) -> int:
        """Matrices of ``shape`` one batch of the local path may hold within the budget: its
        results overwrite its momentum inputs, whose bytes serve as an iterate when their dtype
        is the compute dtype, and count at the momentum's itemsize otherwise (fp32 momentum into
        bf16 Newton-Schulz: twice the bytes); the first Muon parameter's momentum dtype stands
        for all."""
        dtype = resolve_dtype(cfg.dtype, self._device(), shape) or torch.float32
        momentum = self._offload.dtype(self._muon_entries()[0][1], "momentum_buffer")
        return self._ns_runner().chunk_size(shape, dtype, reuses_input=momentum == dtype, cfg=cfg,
                                            device=self._device(), input_dtype=momentum)

    def _ns_config(self, group: dict) -> NSConfig:
        """A Muon group's Newton-Schulz settings with the optimizer-wide dtype, form and backend."""
        return NSConfig(steps=group["ns_steps"], coefficients=group["ns_coefficients"], eps=group["eps"],
                        dtype=self.ns_dtype, **resolve_form(self.ns_form, self.ns_dtype, self._device()),
                        backend=self.ns_backend)
