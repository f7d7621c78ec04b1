"""Checks of Muon's options, hyperparameters and state, each error naming what is at fault.

Kept apart from the optimizer class so the class reads as the step's stages; every check runs
before anything is stored or changed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .._base import check_whole, whole_number  # noqa: F401 (named here by callers)
from ..comm.specs import DTensor
from ..comm.wire import WIRE_DTYPES
from ..kernels.coefficients import resolve_coefficients
from ..kernels.precision import is_number
from . import functional as F
from .rules import RULE_SETTINGS, check_rule_settings


def fmt_shape(shape) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def state_mismatch(p: torch.Tensor, state: dict, shapes: Mapping[str, tuple] | None = None) -> str | None:
    """The first state tensor whose shape differs from ``p``'s (or, for a key of ``shapes``, from
    that shape: an update rule's state), described, or None.

    DTensor parameters hold DTensor state: both shapes are global, so this compares like with like.
    """
    for key, value in state.items():
        expected = tuple((shapes or {}).get(key, p.shape))
        if key != "step" and torch.is_tensor(value) and tuple(value.shape) != expected:
            return f"{key} of shape {fmt_shape(value.shape)}"
    return None


def grad_layout_mismatch(p: torch.Tensor, g: torch.Tensor) -> str | None:
    """How gradient ``g`` is laid out unlike its parameter ``p``, described, or None.

    The step reads a DTensor's gradient shard by shard as its own: the gradient must be a DTensor
    on the same mesh with the same placements (a Partial one is not reduced yet, a Replicate one
    for a Shard parameter holds other rows), and a plain tensor's gradient a plain tensor."""
    p_dt, g_dt = DTensor is not None and isinstance(p, DTensor), DTensor is not None and isinstance(g, DTensor)
    if p_dt != g_dt:
        return (f"a {'DTensor' if g_dt else 'plain tensor'} gradient for a "
                f"{'DTensor' if p_dt else 'plain tensor'} parameter")
    if p_dt and (g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements)):
        return (f"a gradient with placements {tuple(g.placements)} on mesh {tuple(g.device_mesh.mesh.shape)}, "
                f"unlike the parameter's {tuple(p.placements)} on {tuple(p.device_mesh.mesh.shape)} (reduce or "
                "redistribute it to the parameter's layout first)")
    return None


def checked_fused_banks(fused_banks) -> dict[str, int]:
    if fused_banks is None:
        return {}
    if not isinstance(fused_banks, Mapping):
        raise TypeError(f"fused_banks must be a dict {{parameter name: number of matrices}}, got "
                        f"{type(fused_banks).__name__}")
    for name, num in fused_banks.items():
        if not isinstance(name, str):
            raise TypeError(f"fused_banks keys must be parameter names (str), got {name!r}")
        # bool is an int to Python, and True would silently mean "one matrix"
        if not isinstance(num, int) or isinstance(num, bool):
            raise TypeError(f"fused_banks[{name!r}] must be an int >= 1 (matrices stacked on dim 0), "
                            f"got {num!r} ({type(num).__name__})")
        if num < 1:
            raise ValueError(f"fused_banks[{name!r}] must be >= 1 (matrices stacked on dim 0), got {num}")
    return dict(fused_banks)


def check_betas(betas, prefix: str, where: str) -> None:
    if isinstance(betas, (str, bytes)) or not isinstance(betas, (tuple, list)):
        raise TypeError(f"{prefix}betas must be a pair (beta1, beta2), got {betas!r}{where}")
    if len(betas) != 2:
        raise ValueError(f"{prefix}betas must be a pair (beta1, beta2), got {betas!r}{where}")
    if not all(is_number(b) for b in betas):
        raise TypeError(f"{prefix}betas must hold numbers, got {betas!r}{where}")
    if not all(0 <= b < 1 for b in betas):
        raise ValueError(f"{prefix}betas must be in [0, 1), got {betas!r}{where}")


# Each algorithm's settings and their defaults (muonlab.Muon's keyword arguments; AdamW's take
# the prefix adamw_). Kept here, with the checks of their values, as validation reads the keys.
MUON_DEFAULTS = dict(
    lr=0.02,
    momentum=0.95,
    nesterov=True,
    weight_decay=0.0,
    ns_steps=5,
    ns_coefficients="keller",
    eps=1e-7,
    adjust_lr="original",
    momentum_form="ema",
    update_rule="muon",
    **RULE_SETTINGS,
)
ADAMW_DEFAULTS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

SETTINGS = {"muon": tuple(MUON_DEFAULTS), "adamw": tuple(ADAMW_DEFAULTS)}
"""The settings every group of an algorithm holds (a step reads each): the defaults' keys."""

ALGORITHM_NAMES = {"muon": "Muon", "adamw": "AdamW"}


def check_foreign_settings(group: Mapping, algorithm: str, where: str) -> None:
    """Refuse the other algorithm's settings in a group, which its step would silently ignore:
    Muon's (update_rule, ns_steps, normuon_beta2, ...) in an AdamW group, AdamW's betas in a Muon
    group. A "momentum" in an AdamW group is read (torch's schedulers cycle beta1 through it)."""
    other = "adamw" if algorithm == "muon" else "muon"
    read = set(SETTINGS[algorithm]) | ({"momentum"} if algorithm == "adamw" else set())
    foreign = [key for key in SETTINGS[other] if key in group and key not in read]
    if foreign:
        raise ValueError(f"{foreign} {'is a setting' if len(foreign) == 1 else 'are settings'} of "
                         f"{ALGORITHM_NAMES[other]} groups, which {'an' if algorithm == 'adamw' else 'a'} "
                         f"{ALGORITHM_NAMES[algorithm]} group does not "
                         f"read{where}: remove {'it' if len(foreign) == 1 else 'them'}, or put the parameters in a "
                         f"group with algorithm={other!r}")


def check_hyperparameters(values: dict, algorithm: str, prefix: str, where: str) -> None:
    """Types and ranges of a group's (or the constructor's) hyperparameters.

    ``prefix`` + key names the option (``adamw_lr``), ``where`` says which group it came from.
    """
    needed = SETTINGS[algorithm]
    missing = [key for key in needed if key not in values]
    if missing:
        raise ValueError(f"missing setting(s) {[prefix + k for k in missing]}{where}")
    check_foreign_settings(values, algorithm, where)

    def number(key: str, low: float, high: float = math.inf, *, low_open=False, high_open=False) -> None:
        value = values[key]
        if isinstance(value, torch.Tensor) and key == "lr":  # torch takes a one-element tensor lr
            if value.numel() != 1:
                raise ValueError(f"a tensor {prefix}lr must have exactly one element{where}, "
                                 f"got shape {fmt_shape(value.shape)}")
            value = value.item()
        elif not is_number(value):
            raise TypeError(f"{prefix}{key} must be a number, got {value!r} ({type(value).__name__}){where}")
        if not math.isfinite(value):
            raise ValueError(f"{prefix}{key} must be finite, got {value}{where}")
        if value < low or (low_open and value == low) or value > high or (high_open and value == high):
            rule = (f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}" if high < math.inf
                    else f"{'>' if low_open else '>='} {low}")
            raise ValueError(f"{prefix}{key} must be {rule}, got {value}{where}")

    number("lr", 0)
    number("weight_decay", 0)
    if algorithm == "adamw":
        number("eps", 0, low_open=True)  # 0 turns a zero gradient's update into 0/0
        check_betas(values["betas"], prefix, where)
        return
    # eps is a floor under each matrix's norm before Newton-Schulz: past 1 it swamps the matrix
    # (and past the compute dtype's range it overflows mid-step)
    number("eps", 0, 1, low_open=True)
    number("momentum", 0, 1, high_open=True)
    if not isinstance(values["nesterov"], bool):
        raise TypeError(f"nesterov must be a bool, got {values['nesterov']!r}{where}")
    try:
        resolve_coefficients(values["ns_coefficients"], values["ns_steps"])
    except (TypeError, ValueError) as err:
        raise type(err)(f"{err}{where}") from None
    if values["adjust_lr"] not in F.ADJUST_LR_MODES:
        raise ValueError(f"unknown adjust_lr {values['adjust_lr']!r}{where}; choose one of {F.ADJUST_LR_MODES}")
    if values["momentum_form"] not in F.MOMENTUM_FORMS:
        raise ValueError(
            f"unknown momentum_form {values['momentum_form']!r}{where}; choose one of {F.MOMENTUM_FORMS}")
    check_rule_settings(values, where)


def check_comm_dtype(comm_dtype) -> None:
    """The dtype of matrices on the wire: "auto" (each batch's Newton-Schulz dtype, see
    muonlab.comm.wire), bfloat16 or float32."""
    if isinstance(comm_dtype, str) and comm_dtype == "auto":
        return
    if not isinstance(comm_dtype, torch.dtype):
        raise TypeError(f'comm_dtype must be a torch.dtype or "auto", got {comm_dtype!r}')
    if comm_dtype not in WIRE_DTYPES:  # not fp16: see WIRE_DTYPES
        raise ValueError(f'comm_dtype must be bfloat16 (2 bytes, fp32\'s range) or float32 (or "auto"), '
                         f"got {comm_dtype}")


def check_workspace_bytes(workspace_bytes) -> None:
    """A Newton-Schulz workspace budget: an int >= 1 (bytes) or None."""
    if workspace_bytes is not None and (not isinstance(workspace_bytes, int) or isinstance(workspace_bytes, bool)):
        raise TypeError(f"workspace_bytes must be an int (bytes) or None, got {workspace_bytes!r}")
    if workspace_bytes is not None and workspace_bytes < 1:
        raise ValueError(f"workspace_bytes must be >= 1, got {workspace_bytes}")


def check_memory_options(momentum_dtype, workspace_bytes, ns_graphs) -> None:
    """Muon's momentum_dtype, workspace_bytes and ns_graphs."""
    if momentum_dtype is not None and not isinstance(momentum_dtype, torch.dtype):
        raise TypeError(f"momentum_dtype must be a torch dtype or None (the parameter's dtype), got {momentum_dtype!r}")
    if momentum_dtype is not None and momentum_dtype not in (torch.float16, torch.bfloat16, torch.float32,
                                                             torch.float64):
        raise ValueError(f"momentum_dtype must be a floating dtype (float16, bfloat16, float32, float64), "
                         f"got {momentum_dtype}")
    check_workspace_bytes(workspace_bytes)
    if not isinstance(ns_graphs, bool):
        raise TypeError(f"ns_graphs must be a bool, got {ns_graphs!r}")
