"""Run named optimizer configurations over several seeds, and ask whether one is better or it is noise.

    from muonlab.experiments.compare import compare
    from muonlab.models import GPTConfig

    result = compare({"plain": dict(ns_form="plain"), "gram": dict(ns_form="gram")},
                     model=GPTConfig(d_model=128, n_layers=2, n_heads=4, context=64), seeds=(0, 1, 2), steps=60)
    print(result.table())                   # per configuration: final loss, steps to target, CIs, NS choices
    result.difference("gram", "plain")      # a paired t-test on the final validation loss

A seed fixes both the initial model (``torch.manual_seed(seed)`` before it is built) and the batches
(``train(..., seed=seed)``): every configuration under one seed starts from the same weights and
sees the same batches, so its difference to another is paired by seed and the seed-to-seed noise
cancels. Each run records digests of its initial weights and of every batch it trained on; the
comparison checks the pairing from them instead of assuming it (and falls back to Welch's unpaired
test where it does not hold). The statistics are in :mod:`muonlab.stats`.

``nprocs=k`` runs the (configuration, seed) runs on k worker processes started by
:func:`muonlab.launch` (rank r takes every k-th run, each on its own device under the
device rule), instead of one after the other here. Plots and the panel: :mod:`muonlab.viz.compare`.

A model of your own compares as ``train`` trains it (``batches``, ``loss_fn``, ...); every
comparison is kept as a run record (:mod:`muonlab.runs`), and ``against=muonlab.runs.load(name)``
adds configurations to a saved one without running its runs again. Time to target is counted in
steps and in wall-clock seconds (``table(seconds=True)``).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import runs as run_records
from .. import stats
from .._base import check_whole
from ..bars import in_notebook_kernel, notebook_bar
from ..models import GPT, GPTConfig
from ..trace.ns_choice import ns_choice_summary
from ..train import OPTIMIZERS, default_device, make_optimizer, train

__all__ = ["Comparison", "ConfigResult", "Run", "compare", "run_one"]

METRICS = ("final_val_loss", "steps_to_target", "seconds_to_target")
METRIC_TEXT = {"final_val_loss": ("final val loss", 3), "steps_to_target": ("steps to target", 1),
               "seconds_to_target": ("seconds to target", 3)}
TESTS = ("auto", "paired", "welch")
# A run whose last training loss is above this many times its first has diverged (see Run.diverged).
DIVERGED_ABOVE = 1.25
# Names a configuration may give ns_dtype as (a str survives a panel and a notebook's JSON alike).
DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
               "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


# ---------------------------------------------------------------- one run


@dataclass
class Run:
    """One configuration trained from one seed."""

    config: str
    seed: int
    train_loss: list[float]
    """The training loss at steps 1..steps."""
    final_val_loss: float
    """The validation loss after the last step (``train``'s fixed validation windows)."""
    choices: list[dict]
    """``Muon.resolved_choices()`` after the run (what ran per plan batch); [] for AdamW."""
    init_digest: str
    """sha1 of the initial parameters: equal across configurations under one seed."""
    batch_digest: str
    """sha1 of every training batch in order: equal across configurations under one seed."""
    seconds: float
    step_seconds: list[float] = field(default_factory=list)
    """Wall-clock seconds of each training step (forward, backward, optimizer: ``History.step_time_s``)."""
    has_val: bool = True
    """Whether the run was validated (a model of your own without ``val_batches`` is not)."""

    @property
    def diverged(self) -> bool:
        """A non-finite loss anywhere, or a run that ends more than ``DIVERGED_ABOVE`` times the
        loss it started at (a run that merely fails to learn ends near its start, and counts)."""
        losses = [*self.train_loss, self.final_val_loss] if self.has_val else self.train_loss
        return not all(math.isfinite(x) for x in losses) or self.train_loss[-1] > DIVERGED_ABOVE * self.train_loss[0]

    def seconds_to(self, step: int) -> float | None:
        """Wall-clock training seconds from the start to the end of ``step`` (None: not recorded)."""
        return sum(self.step_seconds[:step]) if len(self.step_seconds) >= step else None


def _settings(name: str, settings: Mapping) -> tuple[str, dict]:
    """(optimizer name, make_optimizer keywords) of one configuration; ``preset`` names
    ``ns_coefficients`` and a dtype may be named ("fp32", "bfloat16", ...)."""
    if not isinstance(settings, Mapping):
        raise TypeError(f"configuration {name!r} must map setting names to values (e.g. dict(lr=0.02)), "
                        f"got {type(settings).__name__}")
    kwargs = dict(settings)
    optimizer = kwargs.pop("optimizer", "muon")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"configuration {name!r}: optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if "preset" in kwargs:
        if "ns_coefficients" in kwargs:
            raise ValueError(f"configuration {name!r} gives both preset and ns_coefficients: they are one setting")
        kwargs["ns_coefficients"] = kwargs.pop("preset")
    dtype = kwargs.get("ns_dtype")
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"configuration {name!r}: ns_dtype {dtype!r} is not 'auto' nor one of "
                             f"{sorted(DTYPE_NAMES)}")
        kwargs["ns_dtype"] = DTYPE_NAMES[dtype]
    return optimizer, kwargs


def _build_model(model, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the seed's initial weights, the same for every configuration
    if isinstance(model, GPTConfig):
        return GPT(model)
    if isinstance(model, torch.nn.Module):  # one initial model for every seed: the seeds vary the batches
        return copy.deepcopy(model)
    net = model()
    if not isinstance(net, torch.nn.Module):
        raise TypeError(f"the model function returned {type(net).__name__}, not an nn.Module")
    return net


def _digest_params(model: torch.nn.Module) -> str:
    h = hashlib.sha1()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_one(name: str, settings: Mapping, *, model, seed: int, steps: int, process_group=None,
            train_kwargs: Mapping | None = None) -> Run:
    """Train configuration ``settings`` (see ``compare``) from ``seed`` for ``steps`` steps.
    ``process_group``: Muon's (a launched worker's group of itself: its run is its own).
    ``train_kwargs``: ``train``'s batch source, loss and batch settings for a model of your own."""
    optimizer, kwargs = _settings(name, settings)
    qk_clip = kwargs.pop("qk_clip", None)
    if process_group is not None and optimizer == "muon":
        kwargs["process_group"] = process_group
    net = _build_model(model, seed)
    init_digest = _digest_params(net)
    opt = make_optimizer(optimizer, net, **kwargs)
    batches = hashlib.sha1()

    def record_batch(module, args, kwargs_):  # training forwards only: evaluation's windows are fixed
        if module.training:
            for t in [*args, *kwargs_.values()]:
                if torch.is_tensor(t):
                    batches.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())

    hook = net.register_forward_pre_hook(record_batch, with_kwargs=True)
    start = time.perf_counter()
    try:
        hist = train(net, opt, steps=steps, seed=seed, progress=False, desc=f"{name} seed {seed}", qk_clip=qk_clip,
                     record=False, **(train_kwargs or {}))
    finally:
        hook.remove()
    choices = opt.resolved_choices() if hasattr(opt, "resolved_choices") else []
    final = hist.val_loss[-1] if hist.val_loss else math.nan
    return Run(config=name, seed=seed, train_loss=list(hist.train_loss), final_val_loss=final,
               choices=[dict(c, names=list(c["names"]), shape=list(c["shape"])) for c in choices],
               init_digest=init_digest, batch_digest=batches.hexdigest(), seconds=time.perf_counter() - start,
               step_seconds=list(hist.step_time_s), has_val=bool(hist.val_loss))


def _run_share(jobs: list[tuple[str, int]], configs: dict, *, model, steps: int, train_kwargs=None) -> list[Run]:
    """A launched worker's runs: every world_size-th job from its rank on (launch's entry point)."""
    import torch.distributed as dist

    from ..launcher.progress import report_progress

    rank, world = dist.get_rank(), dist.get_world_size()
    # Each rank trains its own runs: Muon on the default (world) group would take the ranks for
    # replicas of one model and refuse their different settings. Every rank creates every
    # one-rank group, in the same order, as new_group requires.
    solos = [dist.new_group([r]) for r in range(world)]
    mine = jobs[rank::world]
    out = []
    try:
        for k, (name, seed) in enumerate(mine):
            out.append(run_one(name, configs[name], model=model, seed=seed, steps=steps, process_group=solos[rank],
                               train_kwargs=train_kwargs))
            report_progress(step=k + 1, loss=out[-1].final_val_loss, total=len(mine))
    finally:
        for group in solos:
            dist.destroy_process_group(group)
    return out


# ---------------------------------------------------------------- per configuration


def _smoothed(losses: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps (fewer at the start)."""
    out, total = [], 0.0
    for i, x in enumerate(losses):
        total += x
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


def _first_at_or_below(curve: Sequence[float], target: float) -> int | None:
    return next((i + 1 for i, x in enumerate(curve) if x <= target), None)


@dataclass
class ConfigResult:
    """One configuration over every seed. Statistics leave diverged runs out (``diverged_seeds``
    names them); ``mean``/``low``/``high`` are the per-step mean training loss and its t interval."""

    name: str
    settings: dict
    runs: list[Run]
    steps: list[int]
    mean: list[float]
    low: list[float]
    high: list[float]
    final_val_loss: stats.Estimate
    steps_to_target: stats.Estimate
    reached: int
    """Runs (not diverged) whose smoothed loss reached the target."""
    choices: str
    """``ns_choice_summary`` of the runs' resolved choices ("a | b" if seeds differed)."""
    seconds_to_target: stats.Estimate
    """Wall-clock training seconds until the step that reached the target (``Run.seconds_to``)."""

    @property
    def diverged_seeds(self) -> list[int]:
        return [r.seed for r in self.runs if r.diverged]

    @property
    def kept(self) -> list[Run]:
        return [r for r in self.runs if not r.diverged]

    @property
    def label(self) -> str:
        return f"{self.name} ({self.choices})"


# ---------------------------------------------------------------- the comparison


@dataclass
class Comparison:
    """What ``compare`` returns: per configuration a ``ConfigResult``, the target the steps count
    to, and ``tests``: each configuration against the first on both metrics (``difference``)."""

    configs: dict[str, ConfigResult]
    seeds: list[int]
    steps: int
    target: float
    window: int
    confidence: float
    paired: dict[int, bool]
    """Per seed: did every configuration start from the same weights and see the same batches."""
    tests: list[tuple[str, str, str, stats.TestResult]] = field(default_factory=list)
    """(a, b, metric, result) for every configuration a after the first, b the first."""
    machines: dict[str, str] = field(default_factory=dict)
    """Per configuration, where its seconds were measured (``muonlab.runs.machine_of``)."""
    record: str | None = None
    """The folder of this comparison's run record (muonlab.runs), None when none was written."""

    def values(self, name: str, metric: str) -> dict[int, float]:
        """{seed: value} of ``metric`` for configuration ``name``'s runs that count (not diverged;
        for steps_to_target, reached)."""
        if name not in self.configs:
            raise ValueError(f"no configuration {name!r}; have {list(self.configs)}")
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        out = {}
        for r in self.configs[name].kept:
            if metric == "final_val_loss":
                value = r.final_val_loss if r.has_val else None
            else:
                value = _first_at_or_below(_smoothed(r.train_loss, self.window), self.target)
                if metric == "seconds_to_target" and value is not None:
                    value = r.seconds_to(value)
            if value is not None:
                out[r.seed] = float(value)
        return out

    def difference(self, a: str, b: str, *, metric: str = "final_val_loss", test: str = "auto") -> stats.TestResult:
        """A two-sided t-test of mean(a) - mean(b) on ``metric``. ``test``: "paired" (over the
        seeds both have; valid when the runs of a seed share weights and batches), "welch"
        (unpaired), or "auto": paired when ``paired`` holds for every seed, else Welch."""
        if test not in TESTS:
            raise ValueError(f"test must be one of {TESTS}, got {test!r}")
        va, vb = self.values(a, metric), self.values(b, metric)
        if test == "auto":
            test = "paired" if all(self.paired.values()) else "welch"
        if test == "welch":
            return stats.welch_t_test(list(va.values()), list(vb.values()), self.confidence)
        both = [s for s in va if s in vb]
        return stats.paired_t_test([va[s] for s in both], [vb[s] for s in both], self.confidence)

    def rows(self) -> list[dict]:
        """One dict per configuration, as ``table`` prints it."""
        return [dict(config=c.name, seeds=len(c.runs), final_val_loss=c.final_val_loss,
                     steps_to_target=c.steps_to_target, seconds_to_target=c.seconds_to_target, reached=c.reached,
                     diverged=c.diverged_seeds, newton_schulz=c.choices) for c in self.configs.values()]

    def table(self, *, seconds: bool = False) -> str:
        """A fixed-width table (numbers rounded to what seeds can tell apart) and the tests.
        ``seconds``: also the wall-clock seconds to the target, beside the steps, and their tests."""
        pct = f"{100 * self.confidence:g}%"
        head = ["configuration", f"final val loss ({pct} CI)", f"steps to {self.target:.3f} ({pct} CI)"]
        head += [f"seconds to {self.target:.3f} ({pct} CI)"] if seconds else []
        rows = [(*head, "diverged", "Newton-Schulz")]
        for c in self.configs.values():
            n = len(c.runs)
            reach = f" {c.reached}/{n} reached" if c.reached < n - len(c.diverged_seeds) else ""
            cells = [c.name, _estimate(c.final_val_loss, 3), _estimate(c.steps_to_target, 1) + reach]
            cells += [_estimate(c.seconds_to_target, 3)] if seconds else []
            rows.append((*cells, ",".join(map(str, c.diverged_seeds)) or "-", c.choices))
        last = len(rows[0]) - 1
        widths = [max(len(row[k]) for row in rows) + 2 for k in range(last)]
        lines = ["".join(f"{v:<{w}}" for v, w in zip(row, widths)) + row[last] for row in rows]
        lines.append(f"seeds {self.seeds}, {self.steps} steps; steps to target: the first step whose "
                     f"{self.window}-step mean training loss is at most {self.target:.3f}")
        if seconds:
            lines.append("seconds to target: wall-clock seconds of the training steps (forward, backward, optimizer) "
                         "up to that step")
            if len(set(self.machines.values())) > 1:
                lines.append("seconds measured on different machines: " + "; ".join(
                    f"{name}: {where}" for name, where in self.machines.items()))
        for a, b, metric, t in self.tests:
            if seconds or metric != "seconds_to_target":
                lines.append(describe_test(a, b, metric, t))
        if not all(self.paired.values()):
            bad = [s for s, ok in self.paired.items() if not ok]
            lines.append(f"seeds {bad}: configurations did not start alike or saw other batches; tests are unpaired")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _estimate(e: stats.Estimate, digits: int) -> str:
    if e.n == 0:
        return "-"
    if e.n == 1:
        return f"{e.mean:.{digits}f} (1 run)"
    return f"{e.mean:.{digits}f} [{e.low:.{digits}f}, {e.high:.{digits}f}]"


def _p_text(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def verdict_text(t: stats.TestResult, alpha: float = 0.05) -> str:
    """The verdict with what it rests on: "p = 0.012: significant at 0.05", or "undecided (why)"."""
    if not t.decided:
        return f"undecided ({t.note})"
    return f"{_p_text(t.p_value)}: {t.verdict(alpha)} at {alpha:g}"


def describe_test(a: str, b: str, metric: str, t: stats.TestResult, alpha: float = 0.05) -> str:
    """One line: the difference with its interval, the test, and the verdict at ``alpha``."""
    what, digits = METRIC_TEXT[metric]
    if not t.decided:  # no interval: it would claim a precision nothing measured
        shown = "" if math.isnan(t.difference) else f" {t.difference:+.{digits}f},"
        return f"{a} - {b}, {what}:{shown} {t.test}: {verdict_text(t, alpha)}"
    return (f"{a} - {b}, {what}: {t.difference:+.{digits}f} [{t.low:+.{digits}f}, {t.high:+.{digits}f}], "
            f"{t.test} (df {t.df:.1f}), {verdict_text(t, alpha)}")


def _config_result(name: str, settings: dict, runs: list[Run], *, target: float, window: int,
                   confidence: float) -> ConfigResult:
    kept = [r for r in runs if not r.diverged]
    n_steps = len(runs[0].train_loss)
    mean, low, high = [], [], []
    for i in range(n_steps):
        e = stats.mean_ci([r.train_loss[i] for r in kept], confidence)
        mean.append(e.mean)
        low.append(e.low)
        high.append(e.high)
    reached = [(r, s) for r, s in ((r, _first_at_or_below(_smoothed(r.train_loss, window), target)) for r in kept)
               if s is not None]
    seconds = [t for t in (r.seconds_to(s) for r, s in reached) if t is not None]
    choices = " | ".join(dict.fromkeys(ns_choice_summary(r.choices) for r in runs))
    return ConfigResult(name=name, settings=dict(settings), runs=runs, steps=list(range(1, n_steps + 1)),
                        mean=mean, low=low, high=high,
                        final_val_loss=stats.mean_ci([r.final_val_loss for r in kept if r.has_val], confidence),
                        steps_to_target=stats.mean_ci([s for _, s in reached], confidence), reached=len(reached),
                        choices=choices, seconds_to_target=stats.mean_ci(seconds, confidence))


def summarize(runs: Sequence[Run], configs: Mapping[str, Mapping], *, seeds: Sequence[int], steps: int,
              target: float | None = None, window: int | None = None, confidence: float = 0.95,
              machines: Mapping[str, str] | None = None) -> Comparison:
    """Build the ``Comparison`` of finished runs (``compare`` calls it; so may a caller with runs
    from elsewhere). ``target`` None: what the first configuration (the baseline) reached in every
    seed, the highest final ``window``-step mean training loss of its runs that did not diverge
    (of all such runs if none of its did): a better configuration reaches it sooner, a worse one
    later or not at all (the table says how many of its runs did)."""
    window = max(1, steps // 10) if window is None else window
    check_whole("window", window, 1)
    by_config = {name: sorted((r for r in runs if r.config == name), key=lambda r: r.seed) for name in configs}
    if target is None:
        baseline = [r for r in by_config[next(iter(configs))] if not r.diverged]
        ends = [_smoothed(r.train_loss, window)[-1] for r in (baseline or [r for r in runs if not r.diverged])]
        target = max(ends) if ends else math.nan
    paired = {}
    for s in seeds:
        mine = [r for r in runs if r.seed == s]
        paired[s] = len({r.init_digest for r in mine}) == 1 and len({r.batch_digest for r in mine}) == 1
    result = Comparison(
        configs={name: _config_result(name, dict(configs[name]), by_config[name], target=target, window=window,
                                      confidence=confidence) for name in configs},
        seeds=list(seeds), steps=steps, target=target, window=window, confidence=confidence, paired=paired,
        machines=dict(machines or {}))
    names = list(configs)
    validated = any(r.has_val for r in runs)  # a model of your own without val_batches has no final val loss
    result.tests = [(a, names[0], metric, result.difference(a, names[0], metric=metric))
                    for a in names[1:] for metric in METRICS if validated or metric != "final_val_loss"]
    return result


# ---------------------------------------------------------------- the call


def _check_inputs(configs, model, seeds, steps, nprocs, confidence) -> tuple[dict, list[int]]:
    if not isinstance(configs, Mapping) or not configs:
        raise ValueError("configs must be a non-empty dict {name: settings}, e.g. "
                         "{'lr 0.02': dict(lr=0.02), 'lr 0.01': dict(lr=0.01)}")
    for name in configs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"configuration names must be non-empty strings, got {name!r}")
        _settings(name, configs[name])
    if model is None:
        raise ValueError("model is needed: a GPTConfig, an nn.Module or a function returning a fresh one (or "
                         "against= a saved comparison whose model is kept)")
    if not isinstance(model, (GPTConfig, torch.nn.Module)) and not callable(model):
        raise TypeError(f"model must be a GPTConfig, an nn.Module or a function returning a fresh nn.Module, got "
                        f"{type(model).__name__}")
    if isinstance(seeds, (int, str)) or not isinstance(seeds, Sequence) or not seeds:
        raise ValueError(f"seeds must be a non-empty sequence of seeds, e.g. (0, 1, 2), got {seeds!r}")
    for s in seeds:
        check_whole("each seed", s, 0)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct, got {list(seeds)}: a repeated seed repeats a run")
    if steps is None:
        raise ValueError("steps is needed (or against= a saved comparison, whose steps it takes)")
    check_whole("steps", steps, 1)
    if nprocs is not None:
        check_whole("nprocs", nprocs, 1)
    stats.mean_ci([0.0], confidence)  # refuses a confidence outside (0, 1)
    return {name: dict(configs[name]) for name in configs}, [int(s) for s in seeds]


def _check_optimizers(configs: dict, model, seed: int) -> None:
    """Build every configuration's optimizer once on the first seed's model, so a setting no
    optimizer takes is refused, naming its configuration, before any run starts."""
    net = _build_model(model, seed)
    for name, settings in configs.items():
        optimizer, kwargs = _settings(name, settings)
        qk_clip = kwargs.pop("qk_clip", None)
        try:
            if qk_clip is not None:  # tau, and attention QK-clip can find, on a model of the configurations' kind
                from ..optim.qk_clip import QKClip

                QKClip(net, tau=qk_clip).close()
            make_optimizer(optimizer, net, **kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"configuration {name!r}: {e}") from e


def _progress_bar(total: int, progress: bool):
    if not progress:
        return None
    if in_notebook_kernel():
        return notebook_bar("compare", total, unit="run")
    from tqdm import tqdm

    return tqdm(total=total, desc="compare", unit="run", leave=False)


def _warm_up(configs: dict, model, seed: int, train_kwargs: dict) -> None:
    """Two untimed steps of each configuration: a process's first steps pay one-time costs (kernel
    choices, allocator growth) that would land on whichever run came first and skew its seconds.
    Each run then seeds its model and batches afresh, so its losses are as without this."""
    for name, settings in configs.items():
        run_one(name, settings, model=model, seed=seed, steps=2, train_kwargs=train_kwargs)


def _saved(against) -> list[tuple[Comparison, run_records.RunRecord | None]]:
    """(comparison, its record or None) of each saved comparison ``against`` names."""
    items = [against] if isinstance(against, (Comparison, run_records.RunRecord)) else against
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not items:
        raise TypeError("against must be a saved comparison (muonlab.runs.load(name)), a Comparison, or a list of "
                        f"them, got {type(against).__name__}")
    out = []
    for item in items:
        if isinstance(item, run_records.RunRecord):
            if item.comparison is None:
                raise ValueError(f"against: record {item.name!r} is a {item.kind} record, not a comparison")
            out.append((item.comparison, item))
        elif isinstance(item, Comparison):
            out.append((item, None))
        else:
            raise TypeError(f"against holds a {type(item).__name__}: give saved comparisons (muonlab.runs.load) "
                            f"or Comparisons")
    return out


def _merge_saved(saved, configs: dict, seeds, steps) -> tuple[dict, list[Run], dict, list[int], int, int]:
    """(saved settings, saved runs, their machines, seeds, steps, window) of the saved comparisons,
    checked against each other and against the new configurations (names apart, same seeds and steps)."""
    settings, runs, machines = {}, [], {}
    first = saved[0][0]
    seeds = list(first.seeds) if seeds is None else [*seeds]
    steps = first.steps if steps is None else steps
    for result, _ in saved:
        clash = [n for n in result.configs if (isinstance(configs, Mapping) and n in configs) or n in settings]
        if clash:
            raise ValueError(f"against: configuration {clash[0]!r} is both saved and in configs (or in two saved "
                             f"comparisons): rename the new one")
        if result.steps != steps:
            raise ValueError(f"against: a saved comparison ran {result.steps} steps, these runs {steps}: steps must "
                             f"be equal for a comparison")
        if sorted(result.seeds) != sorted(seeds):
            raise ValueError(f"against: a saved comparison ran seeds {result.seeds}, these seeds {seeds}: they must "
                             f"be the same, so that each seed's runs pair")
        settings.update({name: c.settings for name, c in result.configs.items()})
        runs += [r for c in result.configs.values() for r in c.runs]
        machines.update(result.machines)
    return settings, runs, machines, seeds, steps, first.window


def _described_model(model) -> tuple[dict, Any]:
    """(what a record says of compare's model, the module to keep in initial.pt or None)."""
    if isinstance(model, GPTConfig):
        return dict(kind="gpt", config=run_records.encode(dataclasses.asdict(model))), None
    if isinstance(model, torch.nn.Module):
        return dict(kind="module", **run_records.describe_model(model)), model
    ref = run_records.function_ref(model)
    if ref:
        return dict(kind="factory", function=ref), None
    return dict(kind="factory", kept=False, why=f"{model!r} is not importable: pass model= to rerun"), None


def inputs_from_record(record: run_records.RunRecord, given: Mapping) -> dict:
    """compare's model, seeds, steps, batch source and loss as a saved comparison ran them (what it
    kept), each replaced by ``given`` where given; a ValueError names what was not kept."""
    config = record.config
    out = dict(seeds=record.comparison.seeds, steps=record.comparison.steps, window=record.comparison.window,
               target=config.get("target"), confidence=record.comparison.confidence,
               eval_batches=config.get("eval_batches", 4), batch_size=config.get("batch_size"))
    described = config.get("model") or {}
    if "model" not in given:
        if described.get("kind") == "gpt":
            out["model"] = GPTConfig(**run_records.decode(described["config"]))
        elif described.get("kind") == "factory" and described.get("function"):
            out["model"] = run_records.import_ref(described["function"])
        elif described.get("kind") == "module" and record.files.get("initial"):
            out["model"] = record.read("initial")["model"]
        else:
            raise ValueError(f"record {record.name!r}: its model was not kept ({described.get('why', described)}): "
                             f"pass model=")
    out.update(run_records.kept_inputs(record, given))
    out.update(given)
    return out


def _keep_record(result: Comparison, record, *, model, seeds, steps, target, confidence, train_kwargs) -> None:
    described_model, module = _described_model(model)
    config = dict(model=described_model, steps=steps, seeds=seeds, target=target, window=result.window,
                  confidence=confidence, configs={n: run_records.encode(c.settings) for n, c in result.configs.items()},
                  loss_fn=run_records.describe_loss(train_kwargs.get("loss_fn")),
                  batch_size=train_kwargs.get("batch_size"), eval_batches=train_kwargs.get("eval_batches", 4))
    data = {}
    for key in ("batches", "val_batches"):
        config[key], kept = run_records.describe_batches(train_kwargs.get(key))
        if kept is not None:
            data[key] = kept
    files = {}
    if data:
        files["data"] = data
    if module is not None:
        kept_model, why = run_records.snapshot(module)
        if kept_model is None:
            config["model"]["kept"], config["model"]["why"] = False, why
        else:
            files["initial"] = kept_model
    rec = run_records.new_record("compare", config=config, seeds=dict(runs=list(seeds)), comparison=result, files=files,
                                 device=default_device())
    try:
        result.record = run_records.save(rec, run_records.claim_folder(
            "compare", record if isinstance(record, str) else None))
    except OSError as e:
        import warnings

        warnings.warn(f"compare: the run record was not written ({e}); the Comparison is returned as usual",
                      stacklevel=3)


def compare(configs: Mapping[str, Mapping], *, model: GPTConfig | torch.nn.Module | Callable[[], torch.nn.Module] = None,
            seeds: Sequence[int] | None = None, steps: int | None = None, target: float | None = None,
            window: int | None = None, confidence: float = 0.95, nprocs: int | None = None,
            progress: bool = True, batches=None, loss_fn: Callable | str | None = None, batch_size: int | None = None,
            val_batches=None, eval_batches: int = 4, against=None, record: bool | str = True,
            **launch_kwargs) -> Comparison:
    """Train every named configuration from every seed; return a ``Comparison``.

    ``configs``: {name: settings}. Settings are ``muonlab.train.make_optimizer``'s keywords:
    ``optimizer`` ("muon", the default, or "adamw"), ``lr``, ``adamw_lr``, ``weight_decay`` and
    Muon's options (``momentum``, ``ns_steps``, ``ns_form``, ``ns_dtype`` (a dtype or "fp32",
    "bf16", ...), ``ns_backend``, ``update_rule="normuon"``, ...); ``preset`` is
    ``ns_coefficients`` ("keller", "xtuner", "polar_express"); ``qk_clip`` (tau) runs QK-clip after
    every step (MuonClip: ``train``'s ``qk_clip``). ``model``: a ``GPTConfig`` (muonlab's GPT, on
    the corpus), a function returning a fresh model (built after ``torch.manual_seed(seed)``; for
    ``nprocs`` a module-level function) or an nn.Module (each run trains a copy: every seed starts
    from its weights). A model of your own trains as ``train`` trains it: ``batches`` (a dataset of
    tensors with ``batch_size``, a callable ``step -> batch``, a DataLoader), ``loss_fn``,
    ``val_batches`` (``eval_batches`` batches after the last step: the final validation loss;
    without it there is none, and no test of it). ``seeds`` default (0, 1, 2).

    Per configuration: the training loss per step (mean and t interval over seeds), the final
    validation loss, the steps to ``target`` (default: what the first configuration reached, see
    ``summarize``; smoothed over ``window`` steps, default steps // 10) and the wall-clock seconds
    of training up to that step, each with a ``confidence`` t interval; ``tests`` holds each
    configuration against the first on each, paired by seed (``Comparison.difference`` for any
    pair); ``table(seconds=True)`` shows the seconds. A diverged run (``Run.diverged``) is kept,
    shown, and left out of the statistics. Seconds compare where runs do not share the cores: run
    them one after another (``nprocs`` None) or one per device.

    ``against``: saved comparisons (``muonlab.runs.load(name)``, or Comparisons) whose runs join
    these without running again; their configurations come first (the first is the baseline),
    their seeds and steps must be these (the default), and a saved record supplies the model,
    batches and loss it kept where they are not given.

    ``nprocs``: None runs here, one run after another; k runs them on k processes through
    ``muonlab.launch`` (``launch_kwargs``, e.g. ``device="cpu"``, go to it).
    ``progress``: a bar over the runs. ``record``: True (default) keeps the comparison as a run
    record (muonlab.runs) in ``runs/compare-<date>``, a string names the folder, False keeps none;
    ``Comparison.record`` is the folder. Every argument and every configuration's settings are
    checked (an optimizer is built for each) before the first run.
    """
    run_records.check_record_arg(record)
    saved_settings, saved_runs, machines, window_saved = {}, [], {}, None
    given = {k: v for k, v in dict(model=model, batches=batches, loss_fn=loss_fn, batch_size=batch_size,
                                   val_batches=val_batches).items() if v is not None}
    if against is not None:
        saved = _saved(against)
        rec = next((r for _, r in saved if r is not None), None)
        if rec is not None:  # what the saved record kept, where this call does not give it
            kept = inputs_from_record(rec, given)
            model, batches, loss_fn = kept["model"], kept.get("batches"), kept.get("loss_fn")
            batch_size, val_batches = kept.get("batch_size"), kept.get("val_batches")
            eval_batches = kept.get("eval_batches", eval_batches)
        saved_settings, saved_runs, machines, seeds, steps, window_saved = _merge_saved(saved, configs, seeds, steps)
    configs, seeds = _check_inputs(configs, model, (0, 1, 2) if seeds is None else seeds, steps, nprocs, confidence)
    window = window_saved if window is None else window
    if nprocs is None and launch_kwargs:
        raise ValueError(f"{sorted(launch_kwargs)} are launch's keywords: give nprocs to launch workers")
    if window is not None:
        check_whole("window", window, 1)
    if target is not None and not (isinstance(target, (int, float)) and math.isfinite(target)):
        raise ValueError(f"target must be a finite loss or None, got {target!r}")
    if isinstance(batches, Iterator):
        raise ValueError("batches is an iterator, which the first run would use up: pass a DataLoader, a list, a "
                         "dataset of tensors or a callable step -> batch")
    train_kwargs = {k: v for k, v in dict(batches=batches, loss_fn=loss_fn, batch_size=batch_size,
                                          val_batches=val_batches).items() if v is not None}
    if batches is not None:
        train_kwargs["eval_batches"] = eval_batches
    elif train_kwargs:
        raise ValueError(f"{sorted(train_kwargs)} are read with batches= of your own (a model of your own); "
                         "muonlab's GPT trains on the corpus")
    _check_optimizers(configs, model, seeds[0])
    jobs = [(name, seed) for seed in seeds for name in configs]
    start = time.monotonic()
    if nprocs is None:
        _warm_up(configs, model, seeds[0], train_kwargs)
        runs = []
        bar = _progress_bar(len(jobs), progress)
        try:
            for name, seed in jobs:
                runs.append(run_one(name, configs[name], model=model, seed=seed, steps=steps,
                                    train_kwargs=train_kwargs))
                if bar is not None:
                    bar.set_postfix_str(f"{name} seed {seed}: val loss {runs[-1].final_val_loss:.3f}")
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        where = run_records.machine_of(run_records.provenance(default_device()))
    else:
        from ..launcher import launch

        results = launch(_run_share, nprocs, jobs, configs, model=model, steps=steps, train_kwargs=train_kwargs,
                         progress=progress, **launch_kwargs)
        runs = [r for rank in sorted(results) for r in results[rank]]
        where = f"{nprocs} launched processes"
    if progress and in_notebook_kernel():  # the line a saved notebook keeps, where the bar's widget is gone
        print(f"compare: {len(configs)} configurations x {len(seeds)} seeds, {steps} steps each, "
              f"{time.monotonic() - start:.0f} s")
    machines.update({name: where for name in configs})
    result = summarize([*saved_runs, *runs], {**saved_settings, **configs}, seeds=seeds, steps=steps, target=target,
                       window=window, confidence=confidence, machines=machines)
    if record is not False:
        _keep_record(result, record, model=model, seeds=seeds, steps=steps, target=target, confidence=confidence,
                     train_kwargs=train_kwargs)
    return result
