"""class Muon: its public API over its parts, and the step's stages in order.

The math lives in ``functional``; moving and orthogonalizing matrices in ``muonlab.comm``. Muon wires
parts that own their state and take what they read as arguments, each in its own module: the options
(``options``), parameter groups, names and views (``param_groups``), the step's record (``step_stats``),
replicas' momentum homes (``momentum_homes``), state and pickles (``saved_state``, ``pickled``), the
plan (``planning``), the step's inputs and commit decision (``step_inputs``, ``control``) and the
groups' updates (``group_steps``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from ..comm.collectives import CommCounter, rank_or_zero
from ..comm.records import BatchPlan
from ..comm.specs import local_shard
from ..kernels.config import NSConfig
from ..kernels.runner import NewtonSchulzRunner
from ..trace import Span
from .agreement import Agreement
from .arguments import ARGS
from .momentum_homes import MomentumHomes
from .offload import StateStores
from .nonfinite import control
from .group_steps import adamw_group
from .pickled import brought_up_to_date, copied_state
from .step_inputs import check_settings, collect, graph_key, new_prepared_step, step_description
from .planning import Planned, new_runner, ns_config, plan_for, replicate_group, resolved_choices, why_captured_again
from .options import OPTION_NAMES, MuonOptions, OptionAttribute, check_attribute, check_options
from .param_groups import NamedParams
from .saved_state import checked_state_dict, init_states, residency, restore_kept_dtypes
from .step_gate import StepGate
from .state_table import StateTable
from .step_program import StepProgram
from .step_graph import StepGraph, check_capture_place
from .step_stats import StepRecord, clock_device
from .prepared import PreparedStep, group_key, settings_values
from .validation import ADAMW_DEFAULTS, MUON_DEFAULTS  # the group defaults' one home


class Muon(Optimizer):
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

    Distributed: ``plan()`` says which path each batch takes and what it moves and computes;
    ``last_step_stats()`` and ``last_step_spans()`` say what the last step measured.

    Args beyond the hyperparameters (ns_dtype, ns_form, ... capture_after): each in full in
    muonlab.optim.arguments, whose text follows here in ``help(Muon)``.
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
    memory_budget = OptionAttribute()

    def __init__(
        self,
        params: Iterable,
        lr: float = MUON_DEFAULTS["lr"],
        momentum: float = MUON_DEFAULTS["momentum"],
        nesterov: bool = MUON_DEFAULTS["nesterov"],
        weight_decay: float = MUON_DEFAULTS["weight_decay"],
        ns_steps: int = MUON_DEFAULTS["ns_steps"],
        ns_coefficients: Any = MUON_DEFAULTS["ns_coefficients"],
        eps: float = MUON_DEFAULTS["eps"],
        adjust_lr: str | None = MUON_DEFAULTS["adjust_lr"],
        momentum_form: str = MUON_DEFAULTS["momentum_form"],
        adamw_lr: float = ADAMW_DEFAULTS["lr"],
        adamw_betas: tuple[float, float] = ADAMW_DEFAULTS["betas"],
        adamw_eps: float = ADAMW_DEFAULTS["eps"],
        adamw_weight_decay: float = ADAMW_DEFAULTS["weight_decay"],
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
        nonfinite: str = "skip", nonfinite_decision: str = "host",
        fused_banks: dict[str, int] | None = None,
        matrix_views: dict[str, str] | None = None,
        state_offload: str | None = None,
        offload_dir=None,
        keep_muon_momentum_in_memory: bool = False,
        update_rule: str = MUON_DEFAULTS["update_rule"],
        normuon_beta2: float = MUON_DEFAULTS["normuon_beta2"],
        normuon_scale: str = MUON_DEFAULTS["normuon_scale"],
        capture_after: int | None = None, memory_budget: int | str | None = "auto",
    ):
        arguments = locals()  # the group defaults and options given: each table's keys pick them
        self.options = MuonOptions(**{name: arguments[name] for name in OPTION_NAMES})
        # the options' checks that need the parameters run as each is added (check_placed_options)
        check_capture_place(capture_after, state_offload, (), None)
        # the group defaults from the tables' keys (muonlab.optim.validation), checked
        self._params = named = NamedParams.from_arguments(arguments, fused_banks)  # names, views, banks
        self._runner: NewtonSchulzRunner | None = None
        self._plans: dict[tuple, tuple] = {}
        self._prepared: PreparedStep | None = None  # the last prepared step (see step())
        self._settings_checked: tuple | None = None  # the groups' settings when last checked
        self._homes = MomentumHomes()  # where replicated matrices' momentum lives
        self._agreement = Agreement()
        self._record = StepRecord(rank_or_zero())  # the last step's stats and spans, the skip count
        groups = named.normalise(params)  # every group validated before torch's constructor stores it
        # torch's schedulers read `defaults`: "momentum" here (no "betas") makes OneCycleLR and CyclicLR
        # cycle group["momentum"] in every group (class docstring); a copy: torch's __setstate__ adds keys
        super().__init__(groups, dict(algorithm="muon", **named.defaults["muon"]))
        named.check_declared(matrix_views, self.param_groups)
        # last: every other check has passed, so a refused option leaves no lock or file behind
        self._offload = StateStores(
            state_offload, offload_dir, keep_muon_momentum_in_memory,
            [(p, g["algorithm"]) for g in self.param_groups for p in g["params"]], named.names,
            rank_or_zero(), momentum_dtype)

    # ------------------------------------------------------------------ copies

    def __getstate__(self) -> dict:
        """Everything but hooks and the plan cache, so a pickled Muon keeps its settings and names."""
        if self.process_group is not None:
            raise TypeError("a Muon with a process_group can't be pickled (a process group is a live "
                            "communicator): save state_dict() instead, or copy.deepcopy, which shares the group")
        return copied_state(self)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # also what torch's load_state_dict calls, with state and groups only
        brought_up_to_date(self.__dict__)  # as pickled by an earlier version too (muonlab.optim.pickled)
        self.__dict__["_step_graph"] = None if self.capture_after is None else StepGraph(self.capture_after)

    def __setattr__(self, name: str, value: Any) -> None:
        """Every option set is applied or refused: ``options`` takes a checked ``MuonOptions``, and once
        constructed, a public name nothing would read is refused (muonlab.optim.options.check_attribute)."""
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
            self._params.check_options_placed(options, self.param_groups, self._offload.place)
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
        twin.__setstate__(copy.deepcopy(copied_state(self), memo))
        return twin

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        """One step, in the order it runs: 1. the prepared step (``_prepared_step``: validation, the
        step's description, the work lists), reused while nothing it depends on changed
        (muonlab.optim.prepared); 2. the control exchange (muonlab.optim.nonfinite): every rank about to
        take the same step, and no gradient non-finite on any rank, decided before anything is
        written; 3. the plan (muonlab.optim.planning, cached; checked across ranks when new); 4. the
        hot step (``_hot_step``): the gate where the decision is on the device, momentum moved to
        replicas' owners, AdamW, then the Muon batches (muonlab.optim.group_steps). With
        ``capture_after`` it is captured in a CUDA graph once warm and replayed (muonlab.optim.step_graph)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        prepared = self._prepared_step()  # raises before any state changes
        if self._offload.place == "disk":  # the file truncated or replaced: raise before any read
            self._offload.check()
        graph = self._step_graph
        mode = "eager" if graph is None else graph.mode(graph_key(prepared, self._settings_checked), why_captured_again)
        # a graph records no spans: capturing, the tracer keeps host time (CUDA events can't be recorded)
        record = self._record
        record.begin(prepared.clock if mode == "eager" else torch.device("cpu"))
        counter = CommCounter()
        seconds: dict[str, float] = {}  # the check's host seconds: its pass, and the exchange
        bad_ranks, bad_names = control(prepared, self._settings_checked, self.options, self._agreement,
                                       self._params.names, lambda: self._step_description(prepared.work), seconds)
        if bad_ranks:  # "skip" (under "raise" control raised)
            record.skipped_on_host += 1
            record.record(counter, seconds, True, self._runner, nonfinite_ranks=bad_ranks, nonfinite_params=bad_names)
            return loss
        if mode == "replay":
            graph.replay()
            record.replayed(graph.captured_stats)  # the gate's flags are the graph's: this replay's
            return loss
        if mode == "capture":
            graph.capture(lambda: self._hot_step(prepared, counter, seconds))
            graph.captured_stats = record.captured()
            return loss
        self._hot_step(prepared, counter, seconds)
        if graph is not None:
            graph.ran_eagerly()
        return loss

    def _hot_step(self, prepared: PreparedStep, counter: CommCounter, seconds: dict) -> None:
        """After the control exchange: device work only once the plan is made (what ``capture_after`` captures)."""
        # decided on the device: one async all-reduce of the flags, after the control exchange
        gate = (StepGate.decide([p.grad for p in prepared.checked], prepared.clock, prepared.check_group, prepared.plain,
                                prepared.rank) if self.options.nonfinite_decision == "device" else None)
        planned = self._planned_for(prepared)
        if planned and (planned.owners or self._homes.home):  # where momentum lives follows the plan
            self._homes.follow(planned, self._muon_entries(), self.state, self._offload, self._record.tracer, counter)
        tracer, on_device = self._record.tracer, gate is not None or self._step_graph is not None
        start = tracer.mark()  # the "adamw" span, into the tracer's log (muonlab.trace.Tracer.log)
        try:
            for group, params in prepared.work["adamw"]:
                adamw_group(group, params, self.state, self._offload, gate, on_device)
        finally:
            tracer.log.append(("adamw", start, tracer.mark(), {}))
        if planned is not None:
            self._program_for(planned).run(self.state, self._ns_runner(), tracer, counter, gate,
                                           self._optimizer_spectral_observer)
        self._record.record(counter, seconds, False if gate is None else None, self._runner, gate, prepared.checked)

    def _trace_device(self) -> torch.device:
        """Where the step's work runs, for the tracer's clock (muonlab.optim.step_stats.clock_device)."""
        return clock_device(self.param_groups)

    def drop_captured_step(self) -> None:
        """Drop the CUDA graph of ``capture_after`` (if any): the step warms up and captures again.
        Call it before ``dist.destroy_process_group()``: a live graph holds NCCL work. Loading
        state and moving momentum between ranks call it too."""
        if self._step_graph is not None:
            self._step_graph.release()

    def param_name(self, p: torch.Tensor) -> str | None:
        """The name given at construction (from named_parameters), or None."""
        return self._params.names.get(p)

    @property
    def fused_banks(self) -> dict[str, int]:
        """{parameter name: E} of 2-D parameters orthogonalized as E stacked matrices (see above)."""
        return self._params.fused_banks

    @property
    def _views(self) -> dict[str, str]:
        return self._params.views

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate, fill per-algorithm defaults, then register (names stay outside the group)."""
        self.param_groups.append(self._params.new_group(param_group, self.param_groups, self.options,
                                                        self.__dict__.get("_offload")))

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient (under nonfinite_decision="device" the device's
        count is read here: one synchronisation on a GPU)."""
        return self._record.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, count: int) -> None:
        self._record.set_skipped_steps(count)

    @property
    def _skips_on_device(self) -> torch.Tensor | None:
        return self._record.skips_on_device

    def last_step_stats(self) -> dict:
        """Bytes per collective and seconds per phase of the last step that completed or was skipped,
        its non-finite check and its updates' health, as a copy (each field:
        muonlab.optim.step_stats.StepRecord.last_step_stats)."""
        return self._record.last_step_stats(self._runner, self._params.names)

    def last_step_spans(self) -> list[Span]:
        """This rank's spans of the step ``last_step_stats()`` describes (gather them with
        muonlab.trace.gather_spans); on CUDA GPU-timed, and the first read after a step
        synchronises the device once."""
        return self._record.last_step_spans()

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
            check_settings(self.param_groups, self._params)
        prepared = self._prepared
        if prepared is None or prepared.key != key:
            self._prepared = prepared = new_prepared_step(key, self._collect(), self._muon_entries(), replicate_group(
                self.process_group), lambda work: self._step_description(work, settings=False), self._trace_device())
        self._settings_checked = settings
        return prepared

    def _planned_for(self, prepared: PreparedStep) -> Planned | None:
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
        """What this rank is about to do, for the ranks' agreement (muonlab.optim.step_inputs)."""
        entries = self._muon_entries()
        options, device = self.options, self._device() if entries else None
        return step_description(work, self.param_groups, self._params.names, lambda g: ns_config(g, options, device),
                                options, self._ns_runner().budget_bytes if entries else None,
                                self._offload.place_of("momentum_buffer"), settings)

    def _collect(self) -> dict[str, list]:
        """Parameters with grads, per group, checked (muonlab.optim.step_inputs.collect)."""
        return collect(self.param_groups, self.state, self._params)

    def _muon_entries(self) -> list[tuple[dict, torch.Tensor]]:
        """Every Muon parameter with its group, in the optimizer's (rank-independent) order."""
        return [(g, p) for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]]

    def _plan_for(self, indices: tuple[int, ...], collective: bool = True, stepping: bool = False) -> Planned:
        """The plan for these Muon entries (muonlab.optim.planning.plan_for), cached in ``_plans``."""
        entries = self._muon_entries()
        return plan_for(self._plans, indices, entries, self.options, self._params, self._offload,
                        self._ns_runner() if entries else None, self._device() if entries else None,
                        replicate_group(self.process_group), collective=collective, stepping=stepping)

    def plan(self) -> list[BatchPlan]:
        """One record per batch (names, shape, path, ranks, bytes, FLOPs), from global metadata only."""
        return list(self._plan_for(tuple(range(len(self._muon_entries()))), collective=False).plan)

    def resolved_choices(self) -> list[dict]:
        """What ``ns_dtype``, ``ns_form`` and ``ns_backend`` ("auto" or not) mean for each batch of
        the plan: one dict per batch with its names, matrix shape, matrices (a fused bank's or
        split head's blocks each count), path, wave (the first batch of
        the wave it travels in, or None: ``BatchPlan.travels_with``) and the Newton-Schulz dtype,
        form and backend. After a step these are what ran on this rank; before one (or for
        a batch this rank did not orthogonalize) the dtype and form follow the same rules from the
        shapes, and an "auto" backend reads "auto (timed at the first step)" where two could run.
        And ``wire_dtype``, what its matrices travel in (``comm_dtype``; the plan's, on every rank)."""
        return resolved_choices(self.plan(), self._runner, self._device(), self._muon_entries()[0][1].dtype)

    # ------------------------------------------------------------------ state for checkpoints

    def consolidate_state(self) -> None:
        """Collective (call on every rank): each replicated matrix's momentum is broadcast from
        the rank holding it, so that every rank holds every state tensor, e.g. before saving a
        checkpoint."""
        self.drop_captured_step()  # momentum made and moved between ranks: capture again
        owned = self._owned()  # first: the zeros init_state makes must not read as momentum held
        self.init_state()
        self._homes.consolidate(owned, self.state, self._offload)

    def release_unowned_state(self) -> None:
        """Drop the momentum of replicated matrices this rank does not hold for the group (after a
        save or a load): it lives on one rank only, a ZeRO-1 style saving. Collective only after a
        load (where it lies is asked then)."""
        self.drop_captured_step()
        self._homes.release(self._owned(), self.state)

    def _owned(self) -> list:
        """Replicated matrices with their momentum's home (muonlab.optim.momentum_homes)."""
        entries = self._muon_entries()
        owners = self._plan_for(tuple(range(len(entries)))).owners
        return self._homes.owned(owners, entries, self.state)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader, checked first, then state tensors restored in their saved dtype.

        Every saved state tensor must have its parameter's shape (a checkpoint of another model
        would otherwise load and fail at the next step, after AdamW's step counters moved); a step
        count may be a Python number. Each state tensor is kept in its own dtype (momentum:
        ``momentum_dtype``; AdamW moments: fp32), not the parameter's dtype torch's loader casts
        floating state to, which would break exact resume of fp32 state for bf16 parameters. A
        replicated (DDP) matrix's momentum lives on one rank, so one rank's state_dict holds only the
        momentum that rank was home to: load each rank's own, or call consolidate_state() on every
        rank before state_dict() (muonlab.checkpoint does) to load one everywhere."""
        named = self._params
        checked, pairs, offloaded = checked_state_dict(state_dict, self.param_groups, self._offload, named.label,
                                                       named.view_of)
        self.drop_captured_step()  # new state tensors: a captured step reads the old ones
        super().load_state_dict(checked)
        self._homes.home.clear()  # where the loaded momentum lies: asked at the next step
        restore_kept_dtypes(pairs, self.state, self._offload, offloaded)

    def init_state(self) -> None:
        """Create every parameter's state now (zeros, no collective), so every rank holds the
        same keys and global shapes before the first step, as distributed checkpointing needs."""
        init_states(self.param_groups, self.state, self._offload, self._params.view_of)

    def state_residency(self) -> dict[str, int]:
        """Bytes of momentum and AdamW moments on the parameters' device between steps
        ("device_bytes") and offloaded ("offloaded_bytes": held where their store keeps them, the
        state file's mapping for "disk"), and the most the fetch window held on the device during a
        step so far ("peak_window_bytes")."""
        return residency(self.state, self._offload)

    def _program_for(self, planned: Planned) -> StepProgram:
        """The step program of the plan: kept with the prepared step once the plan is
        (``_planned_for``); made anew for a plan not kept yet."""
        prepared = self._prepared
        if prepared.program is not None and prepared.program[0] is planned:
            return prepared.program[1]
        program = StepProgram(planned.plan, self._muon_entries(), planned.specs, planned.owners, planned.groups,
                              self._device(), param_groups=self.param_groups, offload=self._offload,
                              view_of=self._params.view_of)
        if prepared.planned is planned:
            self._prepared = dataclasses.replace(prepared, program=(planned, program))
        return program

    def _device(self) -> torch.device:
        """Where this rank's Muon shards live (the first Muon parameter's device)."""
        return local_shard(self._muon_entries()[0][1]).device

    def _ns_runner(self) -> NewtonSchulzRunner:
        """The Newton-Schulz runner, made at the first step (muonlab.optim.planning.new_runner): its
        ``budget_bytes`` is the one budget the plan and the chunks use."""
        if self._runner is None:
            self._runner = new_runner(self.options, self._muon_entries(), self._device())
        return self._runner

    def _ns_config(self, group: dict) -> NSConfig:
        """A Muon group's Newton-Schulz settings with the optimizer-wide dtype, form and backend."""
        return ns_config(group, self.options, self._device())


Muon.__doc__ = (Muon.__doc__ or "") + ARGS  # each argument in full, kept in muonlab.optim.arguments
