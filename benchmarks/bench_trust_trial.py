"""The "trust" issue's outside trial, re-measured on the current code: each item the trial listed
(its figures from an older commit), run again here, briefly.

    PYTHONPATH=. python benchmarks/bench_trust_trial.py

Writes benchmarks/results/trust_trial.md (the command, the machine, one row or paragraph per item).
Multi-process items run on gloo CPU ranks through muonlab.launch (workers in
benchmarks/_trust_trial_workers.py, and the tests' own for items 1 and 6); item 6 runs again in a subprocess with
``PYTHONPATH=tools/cpu_kind/native_bf16`` prepended (muonlab then sees native bf16 matmul), whose
workers inherit it. Launch logs go to a temporary MUONLAB_RUNS_DIR, removed at the end. A few
minutes on a loaded 2-core machine.

``--fsdp-only JSON``: item 6 alone, its figures written to JSON (what the subprocess runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.distributed: the workers reused
from _machine import load  # noqa: E402
from _report import ROOT, md_table, results_path, text_table, write_report  # noqa: E402

import torch  # noqa: E402

FIRST = 400
"""Characters of an error's first line kept in the table."""


def first_line(text: str, limit: int = FIRST) -> str:
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line if len(line) <= limit else line[:limit] + " ..."


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _rel(got: torch.Tensor, ref: torch.Tensor, start: torch.Tensor) -> float:
    den = float((ref - start).double().norm())
    return float((got - ref).double().norm()) / den if den else float("nan")


# ---------------------------------------------------------------------------------- 1. forgot DDP, late form


def item1() -> tuple[list, str]:
    from muonlab.launcher import launch
    from tests.distributed._workers_replicas import late_form_runs

    cases = [("fp32", 1), ("fp32", 2), ("bf16", 1)]
    results = launch(late_form_runs, 2, cases, timeout_s=240, progress=False, name="trust_item1")
    rows = []
    for case in cases:
        per_rank = [results[r][case] for r in (0, 1)]
        same = per_rank[0]["error"] == per_rank[1]["error"]
        at = [o["at"] for o in per_rank]
        rows.append([f"{case[0]}, own rows from step {case[1]}", "/".join(map(str, at)),
                     cell(first_line(per_rank[0]["error"] or "no error")),
                     "yes" if same else "no", "/".join("yes" if o["unchanged"] else "NO" for o in per_rank),
                     "/".join(str(o["momentum"]) for o in per_rank)])
    header = ["case (2 gloo ranks)", "step raised (rank 0/1)", "ValueError (first line, rank 0; any other error fails the launch)",
              "same text on both ranks", "unchanged by the failing step (params, state, skip count; rank 0/1)",
              "momentum buffers kept"]
    cost = ("Cost of the check (not re-run here): benchmarks/results/peers_check.md, the replicas' per-step "
            "gradient fingerprint timed alone on a width-256 8-layer GPT's 36 matrices, W = 2 gloo: 4.19 ms per "
            "step, 0.66% of the replicas' step (0.92% of the FSDP2 step) at a load of about 5; 10.58 ms, 1.04% "
            "(0.52%) in the run before at a load of about 10; the A/B of the whole check (nonfinite='ignore' "
            "against check on) reads 1.005 (0.971-1.036) on replicas: no cost it can resolve.")
    return [header, rows], cost


# ---------------------------------------------------------------------------------- 2. QK-clip


def _tiny_llama(seed: int = 0):
    """tests/unit/test_qk_clip.py's tiny Llama: 2 layers, 4 heads, 2 kv heads, head_dim 8, layer 0's
    q/k weights x6."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        for w in (attn.q_proj.weight, attn.k_proj.weight):
            w.mul_(6.0)
    return model


def _max_of(clip, forward) -> list[torch.Tensor]:
    """Each layer's max logit per head in ``forward()`` (no_grad), leaving the clip's record as it was."""
    kept = [h.module.qk_max_logit for h in clip.heads]
    for h in clip.heads:
        h.module.qk_max_logit = None
    with torch.no_grad():
        forward()
    seen = [h.module.qk_max_logit.clone() for h in clip.heads]
    for h, m in zip(clip.heads, kept):
        h.module.qk_max_logit = m
    return seen


def _calls_of(clip):
    seen = {}
    handles = [h.module.register_forward_pre_hook(lambda mod, a, kw: seen.__setitem__(mod, (a, kw)), with_kwargs=True)
               for h in clip.heads]
    return seen, handles


QK_TAU = 2.0
QK_STEPS = 30


def _qk_run(lr: float, tau: float) -> dict:
    """QK_STEPS Muon steps (fp32 Newton-Schulz) on the tiny Llama, a fresh (4, 16) batch per step,
    QKClip(tau) applied after each step (Kimi's order). After each step and clip, each layer is
    recomputed on the input it saw after the step (the same batch): its max logit / tau."""
    from muonlab import Muon, muon_param_groups
    from muonlab.optim.qk_clip import QKClip

    model = _tiny_llama()
    opt = Muon(muon_param_groups(model), lr=lr, ns_dtype=torch.float32)
    clip = QKClip(model, tau=tau)
    gen = torch.Generator().manual_seed(5)
    recomputed, identity_err = [], 0.0
    for _ in range(QK_STEPS):
        x = torch.randint(0, 100, (4, 16), generator=gen)
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
        if tau == math.inf:
            clip.apply()
            continue
        calls, handles = _calls_of(clip)
        stepped = _max_of(clip, lambda: model(input_ids=x, use_cache=False))
        for handle in handles:
            handle.remove()
        step = clip.apply()
        clipped = _max_of(clip, lambda: [h.module(*calls[h.module][0], **calls[h.module][1]) for h in clip.heads])
        recomputed.append(max(float(c.max()) for c in clipped) / tau)
        for s, g, c in zip(stepped, step.gamma, clipped):
            identity_err = max(identity_err, float(((c.double() - s.double() * g) / (s.double() * g)).abs().max()))
    clip.close()
    over = [s.overshoot for s in clip.history]
    per_step_max = [float(torch.stack([m.max() for m in s.max_logit]).max()) for s in clip.history]
    return dict(overshoot=over, max_logit=per_step_max, recomputed=recomputed, identity_err=identity_err,
                clipped=sum(s.clipped_heads for s in clip.history))


def _qk_no_update() -> float:
    """The docstring's promise without an update in between: a forward, the clip (no step), each
    layer recomputed on the input it saw: max / tau."""
    from muonlab.optim.qk_clip import QKClip

    model = _tiny_llama()
    x = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(5))
    probe = QKClip(model, tau=math.inf)
    first = _max_of(probe, lambda: model(input_ids=x, use_cache=False))
    probe.close()
    tau = float(first[0].sort().values[1])  # layer 0: one head under tau, the others over
    clip = QKClip(model, tau=tau)
    calls, handles = _calls_of(clip)
    with torch.no_grad():
        model(input_ids=x, use_cache=False)
    for handle in handles:
        handle.remove()
    clip.apply()
    clipped = _max_of(clip, lambda: [h.module(*calls[h.module][0], **calls[h.module][1]) for h in clip.heads])
    clip.close()
    return max(float(c.max()) for c in clipped) / tau


def item2() -> tuple[list, str]:
    torch.set_num_threads(1)
    rows = []
    for lr in (0.05, 0.3, 1.0):
        on, off = _qk_run(lr, QK_TAU), _qk_run(lr, math.inf)
        after = on["overshoot"][1:]  # steps whose forward followed a clip
        rec = on["recomputed"]
        rows.append([lr, f"{max(after):.2f}x", f"{sorted(after)[len(after) // 2]:.2f}x",
                     f"{max(on['max_logit']):.2f}", f"{max(off['max_logit']):.1f}",
                     f"{max(rec):.2f}x (median {sorted(rec)[len(rec) // 2]:.2f}x)", f"{on['identity_err']:.1e}",
                     on["clipped"]])
    header = ["Muon lr", f"recorded max logit / tau, steps 2-{QK_STEPS} after step and clip (max)", "(median)",
              f"max logit with clip (tau {QK_TAU:g})", "max logit without clip", "same batch recomputed after step and "
              "clip, per layer on its input: max / tau", "recomputed = gamma x stepped logits (max rel. err.)",
              "heads clipped (all steps)"]
    no_update = _qk_no_update()
    note = (f"Without an update between the forward and the clip (the promise's case: forward, clip, each "
            f"layer recomputed on the input it saw; tau between layer 0's lowest two head maxima): max / tau = "
            f"{no_update:.9f} (1 + {no_update - 1:.1e}).")
    return [header, rows], note


# ---------------------------------------------------------------------------------- 3 and 4. refusals


def _attempt(fn) -> tuple[str, str]:
    """(exception type, or "accepted"; its message's first line). A refusal that left the
    optimizer's record or parameters changed says so after the type."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fn()
        except Exception as err:  # noqa: BLE001
            kept = getattr(err, "trial_unchanged", None)
            tag = "" if kept is None else (" (nothing changed)" if kept else " (BUT the optimizer changed)")
            return type(err).__name__ + tag, first_line(str(err))
    return "accepted", ""


def item3_4() -> tuple[list, list]:
    from muonlab import Muon
    from muonlab.distributed import parallelize
    from muonlab.optim.qk_clip import QKClip

    w, b = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))

    def muon(**kw):
        return Muon([dict(params=[("w", w)]), dict(params=[("b", b)], algorithm="adamw")], **kw)

    def changed(setter, **kw):
        def run():
            opt = muon(**kw)
            before = opt.options
            try:
                setter(opt)
            except Exception as err:
                err.trial_unchanged = opt.options is before
                raise
        return run

    three = [
        ('opt.options = "plain"', changed(lambda o: setattr(o, "options", "plain"))),
        ('opt.options = dict(ns_form="plain")', changed(lambda o: setattr(o, "options", dict(ns_form="plain")))),
        ("opt.capture_after = 3 (default nonfinite_decision)", changed(lambda o: setattr(o, "capture_after", 3))),
        ('opt.capture_after = 3 (nonfinite_decision="device", CPU params)',
         changed(lambda o: setattr(o, "capture_after", 3), nonfinite_decision="device")),
        ('opt.ns_fomr = "plain"', changed(lambda o: setattr(o, "ns_fomr", "plain"))),
        ('update_rule="normuon" on an AdamW group (constructor)',
         lambda: Muon([dict(params=[("w", w)]), dict(params=[("b", b)], algorithm="adamw", update_rule="normuon")])),
    ]

    def written_later():
        opt = muon()
        opt.param_groups[1]["update_rule"] = "normuon"
        for p in (w, b):
            p.grad = torch.ones_like(p)
        before = [w.detach().clone(), b.detach().clone()]
        try:
            opt.step()
        except Exception as err:
            err.trial_unchanged = torch.equal(before[0], w) and torch.equal(before[1], b)
            raise
    three.append(("group['update_rule'] = \"normuon\" written into the AdamW group, then step", written_later))
    rows3 = [[cell(what), *map(cell, _attempt(fn))] for what, fn in three]

    from muonlab.models import GPT, GPTConfig

    model = GPT(GPTConfig(d_model=16, n_layers=1, n_heads=2, context=8))
    four = [
        ('QKClip(model).attach("adam")', lambda: QKClip(model, tau=10.0).attach("adam")),
        ('parallelize([nn.Parameter(...)], "fsdp")',
         lambda: parallelize([torch.nn.Parameter(torch.randn(2, 2))], "fsdp")),
        (f'Muon(..., ns_backend="triton") at construction (CUDA {torch.cuda.is_available()}, '
         f'TRITON_INTERPRET={os.environ.get("TRITON_INTERPRET", "unset")})', lambda: muon(ns_backend="triton")),
        ('opt.ns_backend = "triton" after construction', changed(lambda o: setattr(o, "ns_backend", "triton"))),
    ]
    rows4 = [[cell(what), *map(cell, _attempt(fn))] for what, fn in four]
    header = ["what", "exception now", "message (first line)"]
    return [header, rows3], [header, rows4]


# ---------------------------------------------------------------------------------- 5. warm pool, interrupts, hangs


def _gone(pid: int, limit_s: float = 10.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    return False


def item5() -> tuple[list, list, list]:
    from _trust_trial_workers import hang_mid_run, pid_and_reduce, raise_on_rank

    from muonlab.launcher import WorkerError, WorkerTimeout, launch
    from muonlab.launcher import shutdown_workers

    shutdown_workers()
    kill_rows = []
    pids = launch(pid_and_reduce, 2, warm=True, timeout_s=120, progress=False, name="trust_warm_0")
    for trial in range(1, 4):
        killed = pids[1]
        os.kill(killed, signal.SIGKILL)
        gone = _gone(killed)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                pids = launch(pid_and_reduce, 2, warm=True, timeout_s=120, progress=False, name=f"trust_warm_{trial}")
                outcome = "returned, new workers" if not set(pids.values()) & {killed} else "returned (same pids?)"
            except WorkerError as err:
                outcome = f"{type(err).__name__}: {first_line(str(err), 160)}"
                pids = launch(pid_and_reduce, 2, warm=True, timeout_s=120, progress=False,
                              name=f"trust_warm_{trial}b")
        seconds = time.perf_counter() - t0
        said = [str(w.message) for w in caught if "warm" in str(w.message)]
        kill_rows.append([trial, "yes" if gone else "no (10 s)", outcome, f"{seconds:.1f}",
                          cell(first_line(said[0], 200)) if said else "-"])

    timing_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("KeyboardInterrupt", "RuntimeError"):
            warm_before = "warm pool (up)" if kind == "KeyboardInterrupt" else "warm=True (fresh pool)"
            try:
                launch(raise_on_rank, 2, 1, kind, tmp, warm=True, timeout_s=120, progress=False,
                       name=f"trust_raise_{kind}")
                timing_rows.append([kind, warm_before, "no error!", "-", "-", "-"])
            except WorkerError as err:
                ended = time.time()
                raised = float(Path(tmp, "raised").read_text())
                named = any(f"{kind}: deliberate {kind}" in text for text in err.failures.values())
                timing_rows.append([kind, warm_before, f"{type(err).__name__}, ranks {err.ranks}",
                                    "yes" if named else "NO", f"{ended - raised:.2f}",
                                    cell(first_line(str(err), 160))])
        shutdown_workers()

    hang_rows = []
    for timeout in (8,):
        t0 = time.perf_counter()
        try:
            launch(hang_mid_run, 2, 1, 3, timeout_s=timeout, warm=False, progress=False, name="trust_hang")
            hang_rows.append([timeout, "no timeout!", "-", "-", f"{time.perf_counter() - t0:.1f}", "-"])
        except WorkerTimeout as err:
            hang_rows.append([timeout, f"{err.phase}", str(err.ranks), str(err.waiting),
                              f"{time.perf_counter() - t0:.1f}", cell(first_line(str(err), 220))])
        except WorkerError as err:
            hang_rows.append([timeout, f"WorkerError (not a timeout): {type(err).__name__}", str(err.ranks), "-",
                              f"{time.perf_counter() - t0:.1f}", cell(first_line(str(err), 220))])
    return ([["trial", "killed pid gone", "next launch (within ~1 s of the kill)", "launch seconds", "warning"],
             kill_rows],
            [["raised on rank 1", "pool", "surfaced as", "its type and message in the rank's failure text",
              "seconds from raise to the launch's exception",
              "message (first line)"], timing_rows],
            [["timeout_s", "phase", "ranks named (hung)", "waiting", "launch seconds", "message (first line)"],
             hang_rows])


# ---------------------------------------------------------------------------------- 6. FSDP2 against one process


def fsdp_figures() -> dict:
    from _trust_trial_workers import MLP_CASES, MLP_WIDTHS, fsdp_runs

    from muonlab.launcher import launch
    from muonlab.kernels.newton_schulz import cpu_has_native_bf16
    from tests.distributed._workers_wire import build_mlp

    start = {n: p.detach().clone() for n, p in build_mlp(MLP_WIDTHS).named_parameters()}
    out = {"native_bf16_parent": cpu_has_native_bf16(), "worlds": {}}
    for world in (2, 3, 4):
        res = launch(fsdp_runs, world, 3, timeout_s=400, progress=False, name=f"trust_fsdp_w{world}")
        figs = {}
        for case in MLP_CASES:
            worst = 0.0
            for r in res.values():
                ref, got = r["defaults"], r[case]["params"]  # one process with Muon's defaults
                worst = max([worst] + [_rel(got[n], ref[n], start[n]) for n in ref if ref[n].dim() == 2])
            figs["/".join(case)] = worst
        choices = {(tuple(shape), d, w) for shape, d, w in res[0][("rows", "defaults")]["choices"]}
        figs["choices"] = [list(map(str, c)) for c in sorted(choices)]
        figs["native_bf16_workers"] = all(r["native_bf16"] for r in res.values())
        out["worlds"][world] = figs
    return out


def item6() -> tuple[list, str]:
    here = fsdp_figures()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(["tools/cpu_kind/native_bf16", *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "native.json")
        proc = subprocess.run([sys.executable, __file__, "--fsdp-only", str(path)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise RuntimeError(f"native_bf16 subprocess failed ({proc.returncode}): {proc.stderr[-2000:]}")
        native = json.loads(path.read_text())
    from _trust_trial_workers import MLP_CASES

    rows = []
    for kind, figs in (("this CPU (no native bf16)", here), ("PYTHONPATH=tools/cpu_kind/native_bf16", native)):
        for world, f in figs["worlds"].items():
            rows.append([kind, world, *(f"{f['/'.join(c)]:.2e}" for c in MLP_CASES),
                         "; ".join(f"{s} {d}/{w}" for s, d, w in f["choices"]),
                         f"{figs['native_bf16_parent']}/{f['native_bf16_workers']}"])
    header = ["CPU kind", "ranks", *(f"{g} grads, {o}" for g, o in MLP_CASES),
              "per shape: Newton-Schulz dtype / wire dtype (defaults)", "muonlab sees native bf16 (parent/workers)"]
    note = ("Figures: the largest, over the three weight matrices and every rank, of ||W_fsdp - W_one|| / "
            "||W_one - W_start|| after 3 steps (lr 0.02, momentum 0.95, weight decay 0.01, 2 rows per rank, "
            "MSE). 'rows': FSDP2's own backward on each rank's rows (gradients differ from one process's by the "
            "rounding of their reduce-scatter); 'global': the whole batch's one-process gradient handed to each "
            "rank as its shard (the optimizer's inputs exactly one process's). defaults = comm_dtype='auto'; "
            "bf16_wire (comm_dtype=torch.bfloat16) is the control that a coarser wire still shows.")
    return [header, rows], note


# ---------------------------------------------------------------------------------- 7. compare without spread


def item7() -> tuple[list, str]:
    from muonlab.experiments import compare as compare_mod
    from muonlab.stats import paired_t_test, welch_t_test

    finals = {"a": [4.0, 4.0, 4.0], "b": [4.1, 4.1, 4.1]}
    reach = {"a": [5, 5, 5], "b": [7, 7, 7]}
    steps = 10
    runs = [compare_mod.Run(config=name, seed=seed, final_val_loss=final, choices=[], init_digest="w",
                            batch_digest=f"batches {seed}", seconds=0.0, step_seconds=[0.5] * steps,
                            train_loss=[3.0 if i + 1 < reach[name][seed] else 2.0 for i in range(steps)])
            for name in finals for seed, final in enumerate(finals[name])]
    result = compare_mod.summarize(runs, {n: {} for n in finals}, seeds=range(3), steps=steps, target=2.0, window=1)
    lines = [ln.strip() for ln in result.table(seconds=True).splitlines() if ln.strip().startswith("b - a")]
    rows = [["compare table (summarize of made-up runs: every seed a 4.0 / b 4.1, target at step 5 / 7)", cell(ln)]
            for ln in lines]
    for name, fn in (("paired_t_test([4.1]*3, [4.0]*3)", paired_t_test), ("welch_t_test([4.1]*3, [4.0]*3)",
                                                                         welch_t_test)):
        t = fn(finals["b"], finals["a"])
        rows.append([name, cell(f"verdict {t.verdict()!r}, p {t.p_value}, note {t.note!r}")])
    t = paired_t_test([4.1, 4.2, 4.3], [4.0, 4.0, 4.0])
    rows.append(["control: paired_t_test([4.1, 4.2, 4.3], [4.0]*3)", cell(f"verdict {t.verdict()!r}, p {t.p_value:.3g}")])
    return [["call", "what it says now"], rows], ""


# ---------------------------------------------------------------------------------- 8. NorMuon scales


def item8() -> tuple[list, str]:
    from muonlab import Muon, muon_param_groups
    from muonlab.models import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(d_model=128, n_layers=2)  # the README's quick-start model
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, cfg.vocab_size, (4, cfg.context + 1), generator=gen) for _ in range(5)]
    runs, default_scale = {}, None
    for scale in ("code", "paper"):
        torch.manual_seed(0)
        model = GPT(cfg)
        kw = {} if scale == "code" else dict(normuon_scale="paper")
        opt = Muon(muon_param_groups(model), lr=0.02, weight_decay=0.0, update_rule="normuon", ns_dtype=torch.float32,
                   **kw)
        if scale == "code":
            default_scale = next(g["normuon_scale"] for g in opt.param_groups if g["algorithm"] == "muon")
        names = {p: n for n, p in model.named_parameters()}
        muon = [(names[p], p) for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
        steps = []
        for t in batches:
            before = {n: p.detach().clone() for n, p in muon}
            model(t[:, :-1], t[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
            steps.append({n: float((p.detach() - before[n]).norm()) for n, p in muon})
        runs[scale] = steps
    rows = []
    for k in (0, len(batches) - 1):
        ratios = [runs["paper"][k][n] / runs["code"][k][n] for n in runs["code"][k]]
        what = "step 1 (same weights, same gradients)" if k == 0 else f"step {k + 1} (each on its own trajectory)"
        rows.append([what, len(ratios), f"{min(ratios):.3f}", f"{sorted(ratios)[len(ratios) // 2]:.3f}",
                     f"{max(ratios):.3f}"])
    note = (f"Default normuon_scale: {default_scale!r} (N = ||O||_F, the authors' code, normuon.py of "
            "zichongli5/NorMuon); the paper's form is normuon_scale=\"paper\" (N = sqrt(min(m, n)); Algorithm 1 "
            "exactly with adjust_lr=\"match_rms_adamw\", nesterov=False). Ratio = ||dW|| with \"paper\" / ||dW|| with "
            "the default, per Muon matrix of the quick-start GPT (d_model 128, 2 layers), lr 0.02, weight decay 0, "
            "fp32 Newton-Schulz, the same lr ratio for both.")
    return [["step", "matrices", "min ratio", "median", "max"], rows], note


# ---------------------------------------------------------------------------------- main


OLD = {
    1: "no error; replicas identical, each 3e-4..2.9e-2 off its own one-process run",
    2: "recorded max logit / tau after step and clip: 1.13x (lr 0.05), 1.5-2.3x (0.3), 3.5x (1.0); without clip 247 vs ~8",
    3: "accepted / silently ignored / a broken optimizer",
    4: "unclear errors",
    5: "a warm worker killed while idle: WorkerError blaming the user's function, 3 of 3; KeyboardInterrupt 10.6 s vs 1.0 s "
       "for an ordinary exception; a hang of one rank named [0, 1]",
    6: "up to 0.147 of a matrix's displacement with the defaults; 0 with comm_dtype=fp32",
    7: "\"significant, p < 0.001\"",
    8: "the paper's form 0.82-0.87x as large as the default",
}

TITLES = {1: "Forgot DDP, late form (2 gloo ranks, replicated GPT, muonlab.Muon, gradients never all-reduced)",
          2: "QK-clip on a tiny Llama", 3: "The options record", 4: "Errors that were unclear",
          5: "Warm pool, interrupts, hangs", 6: "FSDP2 with the defaults against one process",
          7: "compare with zero spread", 8: "NorMuon's two scales"}


def _section(n: int, parts: list, seconds: float) -> str:
    out = [f"## {n}. {TITLES[n]}", "", f"Trial (older commit): {OLD[n]}.", ""]
    for part in parts:
        if isinstance(part, list):
            out += [md_table(*part), ""]
            print(text_table(*part))
        elif part:
            out += [part, ""]
            print(part)
    out.append(f"({seconds:.1f} s)")
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fsdp-only", metavar="JSON", help="item 6 alone, written to JSON (the subprocess's part)")
    parser.add_argument("--items", type=int, nargs="*", default=list(range(1, 9)))
    args = parser.parse_args(argv)

    from muonlab.launcher import RUNS_DIR_ENV

    runs_dir = tempfile.mkdtemp(prefix="trust_trial_runs_")
    os.environ[RUNS_DIR_ENV] = runs_dir
    try:
        if args.fsdp_only:
            figs = fsdp_figures()
            Path(args.fsdp_only).write_text(json.dumps(figs))
            return
        started = time.perf_counter()
        load_before = load()
        sections = []
        calls = {1: item1, 2: item2, 3: None, 4: None, 5: item5, 6: item6, 7: item7, 8: item8}
        done34 = None
        for n in args.items:
            print(f"\n=== item {n}: {TITLES[n]}", flush=True)
            t0 = time.perf_counter()
            try:
                if n in (3, 4):
                    done34 = done34 or item3_4()
                    parts = [done34[0] if n == 3 else done34[1]]
                else:
                    got = calls[n]()
                    parts = list(got)
            except Exception:  # noqa: BLE001 - a failing item is itself a finding
                parts = ["The item FAILED to run:\n\n```\n" + traceback.format_exc()[-3000:] + "\n```"]
            sections.append(_section(n, parts, time.perf_counter() - t0))
        total = time.perf_counter() - started
        body = ("Each item of the trust issue's outside trial (figures from an older commit) re-run on the current "
                f"code. Whole run: {total:.0f} s.\n\n" + "\n\n".join(sections))
        write_report(results_path("trust_trial"), "The trust issue's trial, re-measured", body, script=__file__,
                     argv=argv, machine_note=f"Load average {load_before} at the start, {load()} at the end; "
                     f"launches on gloo CPU ranks, one torch thread each.")
        print(f"total {total:.0f} s")
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
