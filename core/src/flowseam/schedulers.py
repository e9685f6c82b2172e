"""Reading a checkpoint's scheduler: which solver op runs, on which sigma schedule, and where
every setting came from.

A diffusers checkpoint keeps its sampler in ``scheduler/scheduler_config.json`` (of the class
``model_index.json`` names; the file's ``_class_name`` must agree). flowseam serves what that file
says: :func:`resolve_solver` turns it into a :class:`SolverConfig` when a model is loaded, every
setting with its source (checkpoint, request, ``flowseam.json``, card default, diffusers default,
ignored). The sigma schedule and the DiT's timesteps are computed by the diffusers class itself
(``set_timesteps``, called as the card's pipeline calls it), so they are diffusers' own; only the
steps run through ``platform.kernels`` (:attr:`SolverConfig.ops`, picked once per loop run).
Options flowseam does not implement are refused by name before any weights load, unless the user
asks to ignore them. docs/schedulers.md lists the implemented options of each class and the
refusals.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from . import ops
from .errors import FlowseamError, InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .request import DiffusionParams

EULER = "FlowMatchEulerDiscreteScheduler"
UNIPC = "UniPCMultistepScheduler"

#: The scheduler classes flowseam runs.
SCHEDULER_CLASSES = (EULER, UNIPC)

CHECKPOINT, REQUEST, CARD_DEFAULT, DIFFUSERS_DEFAULT, IGNORED = (
    "checkpoint", "request", "card default", "diffusers default", "ignored")
#: the source of a setting the checkpoint's own serving defaults (``flowseam.json``) give
SERVING_DEFAULTS = "flowseam.json"

#: The keys of a class that set the request's flow shift (DiffusionParams.flow_shift).
SHIFT_KEY = {EULER: "shift", UNIPC: "flow_shift"}


def _bool_false(value: Any) -> bool:
    return not value


#: class → key → (is the value implemented?, why not). Checked on the resolved config.
_RULES: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    EULER: {
        "invert_sigmas": (_bool_false, "invert_sigmas=True (sigma rising from 0 to 1, Mochi's "
                          "convention) is not implemented: flowseam's loops step sigma down to 0"),
    },
    UNIPC: {
        "use_flow_sigmas": (lambda v: v is True, "UniPC without use_flow_sigmas=True is the "
                            "VP-diffusion solver; a flow-matching model needs flow sigmas"),
        "prediction_type": (lambda v: v == "flow_prediction", "a flow-matching DiT predicts a "
                            "velocity: UniPC needs prediction_type='flow_prediction'"),
        "predict_x0": (lambda v: v is True, "predict_x0=False is not defined for "
                       "prediction_type='flow_prediction' (diffusers raises for it too)"),
        "thresholding": (_bool_false, "dynamic thresholding (Imagen's, for pixel-space models) is "
                         "not implemented"),
        "solver_p": (lambda v: v is None, "solver_p (another scheduler as UniPC's predictor) is "
                     "not implemented"),
        "solver_order": (lambda v: isinstance(v, int) and not isinstance(v, bool)
                         and 1 <= v <= ops.UNIPC_MAX_ORDER,
                         f"flowseam's unipc_step implements orders 1-{ops.UNIPC_MAX_ORDER} "
                         "(Wan ships 2; diffusers recommends 2 guided, 3 unconditional)"),
        "solver_type": (lambda v: v in ("bh1", "bh2"), "solver_type must be 'bh1' or 'bh2'"),
        "use_exponential_sigmas": (_bool_false, "UniPC's exponential sigmas are VP sigmas in "
                                   "diffusers 0.42 (not converted to flow sigmas)"),
        "use_beta_sigmas": (_bool_false, "UniPC's beta sigmas are VP sigmas in diffusers 0.42 "
                            "(not converted to flow sigmas)"),
        "disable_corrector": (lambda v: isinstance(v, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in v),
            "disable_corrector must be a list of step indices"),
    },
}

#: Options that do nothing for a class as flowseam (and diffusers) runs it: read, not shown.
_NO_EFFECT = {
    EULER: frozenset(),
    UNIPC: frozenset({"beta_start", "beta_end", "beta_schedule", "trained_betas",
                      "timestep_spacing", "steps_offset", "rescale_betas_zero_snr",
                      "dynamic_thresholding_ratio", "sample_max_value", "sigma_min", "sigma_max"}),
}


@dataclass(frozen=True)
class SolverConfig:
    """The resolved solver of one model: the diffusers scheduler class that computes the sigma
    schedule, the op that steps it, and where each setting came from (docs/schedulers.md).

    :ivar scheduler_class: ``"FlowMatchEulerDiscreteScheduler"`` or ``"UniPCMultistepScheduler"``.
    :ivar config: every constructor argument of that class, resolved (what ``from_config`` gets).
    :ivar sources: key → where its value came from; ``"_class_name"`` for the class itself:

        * ``"checkpoint"``: the key is in ``scheduler_config.json`` (the default for everything
          the file says);
        * ``"request"``: a :class:`~flowseam.request.DiffusionParams` field the user set
          overrides its own setting only: ``flow_shift`` sets ``shift`` (FlowMatchEuler) or
          ``flow_shift`` (UniPC) and turns dynamic shifting off; fields left ``None`` change
          nothing (:meth:`for_request`);
        * ``"flowseam.json"``: the checkpoint's own serving defaults (:mod:`flowseam.checkpoint_defaults`):
          a ``flow_shift`` there is applied at load like a request's, below a request's own;
        * ``"card default"``: the model card's value for a key the checkpoint leaves out (or,
          with no scheduler folder at all, the card's scheduler class); never over a value the
          checkpoint gives;
        * ``"diffusers default"``: the class's own default for anything else (what diffusers
          would use);
        * ``"ignored"``: an option flowseam does not implement that the user asked to ignore
          (``flowseam.load(..., ignore_scheduler_options=[...])``, CLI
          ``--ignore-scheduler-option``): replaced by the class default, with a warning.
    :ivar ignored: the options the user asked to ignore, as ``"key=value"``.
    :ivar file: where the settings were read (for messages).
    """

    scheduler_class: str
    config: Mapping[str, Any]
    sources: Mapping[str, str]
    ignored: tuple[str, ...] = ()
    file: str = "scheduler/scheduler_config.json"

    # -- what runs ------------------------------------------------------------------------
    @property
    def ops(self) -> tuple[str, ...]:
        """The solver ops the loop gets from ``platform.kernels`` for serving: ``unipc_step``;
        ``flow_match_step``; or, for stochastic sampling, ``flow_match_step`` to sigma 0 (the
        data prediction) then ``flow_renoise`` to the next sigma."""
        if self.scheduler_class == UNIPC:
            return (ops.UNIPC_STEP,)
        if self.config.get("stochastic_sampling"):
            return (ops.FLOW_MATCH_STEP, ops.FLOW_RENOISE)
        return (ops.FLOW_MATCH_STEP,)

    @property
    def op(self) -> str:
        """The solver as one name: the ops joined by ``+``."""
        return "+".join(self.ops)

    @property
    def num_train_timesteps(self) -> int:
        return int(self.config.get("num_train_timesteps", 1000))

    @property
    def dynamic_shifting(self) -> bool:
        return bool(self.config.get("use_dynamic_shifting"))

    @property
    def flow_sigmas(self) -> bool:
        """True when the class computes its own flow sigmas from the step count (UniPC): a
        pipeline then passes no custom sigmas (FluxPipeline checks ``use_flow_sigmas``)."""
        return bool(self.config.get("use_flow_sigmas"))

    def source(self, key: str) -> str:
        return self.sources.get(key, DIFFUSERS_DEFAULT)

    def unipc_order(self, index: int, num_steps: int) -> int:
        """The order of UniPC's step ``index`` of ``num_steps``
        (:func:`flowseam.ops.unipc_order`)."""
        return ops.unipc_order(index, num_steps, int(self.config["solver_order"]),
                               bool(self.config["lower_order_final"]))

    def unipc_corrector(self, index: int) -> bool:
        """Whether UniPC's corrector runs at step ``index`` (not at the first step, nor after a
        step listed in ``disable_corrector``)."""
        return index > 0 and (index - 1) not in tuple(self.config.get("disable_corrector") or ())

    # -- per request ----------------------------------------------------------------------
    def for_request(self, params: "DiffusionParams", source: str = REQUEST) -> "SolverConfig":
        """This solver with the request's overrides: ``flow_shift`` (when set) replaces the
        class's shift key and turns dynamic shifting off. Fields left ``None`` change nothing.

        :param source: what the changed settings' source reads (the checkpoint's
            ``flowseam.json`` applies its ``flow_shift`` this way at load:
            :data:`SERVING_DEFAULTS`)."""
        if params.flow_shift is None:
            return self
        key = SHIFT_KEY[self.scheduler_class]
        config, sources = dict(self.config), dict(self.sources)
        config[key], sources[key] = float(params.flow_shift), source
        if config.get("use_dynamic_shifting"):
            config["use_dynamic_shifting"], sources["use_dynamic_shifting"] = False, source
        return replace(self, config=config, sources=sources)

    def scheduler(self) -> Any:
        """A fresh diffusers scheduler of this class and config."""
        import diffusers

        return getattr(diffusers, self.scheduler_class).from_config(dict(self.config))

    def timesteps(self, num_steps: int, *, sigmas: Any = None, mu: float | None = None,
                  device: Any = None) -> tuple[list[float], "torch.Tensor"]:
        """The schedule of ``num_steps`` steps, computed by the diffusers class itself
        (``set_timesteps``, called as the pipelines call it: custom ``sigmas`` when given, else
        the step count; ``mu`` for dynamic shifting).

        :returns: ``(sigmas, timesteps)``: N + 1 sigmas (Python floats from diffusers' float32
            values, ending in the final sigma) and the N timesteps the DiT is given, ``(N,)``
            float32 (UniPC's integer timesteps converted exactly).
        :raises ValueError: if dynamic shifting is on and no ``mu`` is given.
        """
        import torch

        if self.dynamic_shifting and mu is None:
            raise InvalidInputError(f"{self.file}: use_dynamic_shifting=True needs a resolution-"
                                    "dependent mu, which this pipeline does not pass")
        scheduler = self.scheduler()
        kwargs = {"mu": mu} if mu is not None else {}
        if sigmas is not None:
            scheduler.set_timesteps(sigmas=sigmas, device=device, **kwargs)
        else:
            scheduler.set_timesteps(num_steps, device=device, **kwargs)
        return scheduler.sigmas.tolist(), scheduler.timesteps.to(torch.float32)

    # -- reporting ------------------------------------------------------------------------
    def shown_keys(self) -> list[str]:
        """The settings :meth:`describe` shows: the ones that shape this class's schedule or
        steps as configured."""
        c = self.config
        keys: list[str] = []
        if c.get("use_dynamic_shifting"):
            keys += ["use_dynamic_shifting", "base_shift", "max_shift", "base_image_seq_len",
                     "max_image_seq_len", "time_shift_type"]
        else:
            keys += [SHIFT_KEY[self.scheduler_class], "use_dynamic_shifting"]
        if self.scheduler_class == UNIPC:
            keys += ["solver_order", "solver_type", "lower_order_final", "final_sigmas_type"]
            if c.get("disable_corrector"):
                keys.append("disable_corrector")
        else:
            keys.append("stochastic_sampling")
        for key in ("shift_terminal", "use_karras_sigmas", "use_exponential_sigmas",
                    "use_beta_sigmas"):
            if c.get(key):
                keys.append(key)
        if c.get("num_train_timesteps", 1000) != 1000:
            keys.append("num_train_timesteps")
        return [k for k in keys if k in c]

    def describe(self) -> str:
        """One line: the op, the class, and each shown setting with its source, e.g.
        ``solver unipc_step (UniPCMultistepScheduler, checkpoint): flow_shift=3.0 (checkpoint),
        solver_order=2 (checkpoint), ...``."""
        parts = [f"{k}={self.config[k]!r} ({self.source(k)})" for k in self.shown_keys()]
        parts += [f"{item} ignored" for item in self.ignored]
        return (f"solver {self.op} ({self.scheduler_class}, {self.source('_class_name')}): "
                + ", ".join(parts))

    def __str__(self) -> str:
        return self.describe()


def _init_keys(cls: type) -> list[str]:
    params = inspect.signature(cls.__init__).parameters
    return [n for n, p in params.items()
            if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _instantiate(cls: type, config: dict[str, Any], file: str) -> Any:
    try:
        return cls.from_config(config)
    except ImportError as exc:
        raise FlowseamError(f"{file}: {cls.__name__} with this config needs a missing package: "
                            f"{exc}") from exc
    except Exception as exc:  # diffusers' own validation (e.g. two sigma conversions at once)
        raise FlowseamError(f"{file}: diffusers refuses this {cls.__name__} config: "
                            f"{type(exc).__name__}: {exc}") from exc


def resolve_solver(raw: Mapping[str, Any] | None, *, card: str, default_class: str,
                   card_defaults: Mapping[str, Mapping[str, Any]], passes_mu: bool,
                   file: str = "scheduler/scheduler_config.json",
                   ignore: Iterable[str] = (), index_class: str | None = None) -> SolverConfig:
    """Read a checkpoint's scheduler config into a :class:`SolverConfig` (the sources of its
    settings: :attr:`SolverConfig.sources`; the implemented options: docs/schedulers.md).

    :param raw: the parsed ``scheduler_config.json``, or None when the checkpoint has no
        scheduler folder (then the card's scheduler class and defaults apply).
    :param index_class: the scheduler class ``model_index.json`` names (what diffusers loads);
        it must agree with ``raw``'s ``_class_name`` (or the user ignores ``_class_name``, and
        it wins, as in diffusers).
    :param card: the card's name (for messages).
    :param default_class: the card's scheduler class when the checkpoint names none.
    :param card_defaults: class → key → the card's value where the checkpoint says nothing.
    :param passes_mu: whether the card's pipeline passes a resolution-dependent ``mu``
        (FluxPipeline does, WanPipeline does not): dynamic shifting needs it.
    :param ignore: option names (``scheduler_config.json`` keys, or ``"_class_name"``) to ignore
        with a warning instead of refusing them.
    :raises FlowseamError: naming every unimplemented option of the file and what to do: an
        unknown scheduler class, ``model_index.json`` and ``scheduler_config.json`` naming
        different classes, a key the class does not have, ``invert_sigmas=True``, UniPC without
        flow sigmas or flow prediction, ``predict_x0=False``, ``thresholding``, ``solver_p``,
        orders above 3, UniPC's exponential/beta sigmas (VP sigmas in diffusers 0.42, not flow
        sigmas), dynamic shifting on a pipeline that passes no ``mu`` (Wan), and
        ``lower_order_final=False`` with a final sigma of 0 and an order >= 2 (diffusers divides
        by zero there).
    """
    import diffusers

    ignore = set(ignore)
    raw = dict(raw or {})
    ignored: list[str] = []
    sources: dict[str, str] = {}
    lenient = False  # keys the class does not know are ignored rather than refused
    cls_name = index_class or raw.get("_class_name")
    if index_class and raw.get("_class_name") not in (None, index_class):
        if "_class_name" not in ignore:
            raise FlowseamError(
                f"{file}: _class_name={raw['_class_name']!r}, but model_index.json names the "
                f"scheduler {index_class!r}; diffusers loads {index_class} and drops the keys it "
                "does not know, so the two must agree. Fix one of them, or pass "
                "ignore_scheduler_options=['_class_name'] (CLI: --ignore-scheduler-option "
                f"_class_name) to run {index_class} as diffusers does")
        ignored.append(f"_class_name={raw['_class_name']!r}")
        lenient = True
    if cls_name is None:
        cls_name, sources["_class_name"] = default_class, CARD_DEFAULT
    elif cls_name in SCHEDULER_CLASSES:
        sources["_class_name"] = CHECKPOINT
    elif "_class_name" in ignore:
        ignored.append(f"_class_name={cls_name!r}")
        cls_name, sources["_class_name"], lenient = default_class, IGNORED, True
    else:
        raise FlowseamError(
            f"{file}: _class_name={cls_name!r} is not implemented; flowseam runs "
            f"{EULER} (flow_match_step, with flow_renoise for stochastic sampling) and {UNIPC} "
            "(unipc_step). To run "
            f"{card}'s default {default_class} instead, pass ignore_scheduler_options="
            "['_class_name'] (CLI: --ignore-scheduler-option _class_name)")
    cls = getattr(diffusers, cls_name)
    keys = _init_keys(cls)

    problems: list[tuple[str, str]] = []
    for key in sorted(k for k in raw if not k.startswith("_") and k not in keys):
        if lenient or key in ignore:
            ignored.append(f"{key}={raw[key]!r}")
        else:
            problems.append((key, f"{key}={raw[key]!r} is not an option of diffusers "
                                  f"{diffusers.__version__}'s {cls_name}"))
    config: dict[str, Any] = {}
    defaults = card_defaults.get(cls_name, {})
    for key in keys:
        if key in raw:
            config[key], sources[key] = raw[key], CHECKPOINT
        elif key in defaults:
            config[key], sources[key] = defaults[key], CARD_DEFAULT
    resolved = {k: v for k, v in dict(_instantiate(cls, config, file).config).items()
                if not k.startswith("_")}

    class_defaults = {k: v for k, v in dict(cls().config).items() if not k.startswith("_")}
    for key, (ok, why) in _RULES.get(cls_name, {}).items():
        if not ok(resolved.get(key)):
            problems.append((key, f"{key}={resolved.get(key)!r}: {why}"))
    if resolved.get("use_dynamic_shifting") and not passes_mu:
        problems.append(("use_dynamic_shifting", "use_dynamic_shifting=True needs a resolution-"
                         f"dependent mu, which {card}'s diffusers pipeline never passes "
                         "(diffusers raises too); set it false and give a shift"))
    if (cls_name == UNIPC and not resolved.get("lower_order_final")
            and resolved.get("final_sigmas_type") == "zero"
            and isinstance(resolved.get("solver_order"), int) and resolved["solver_order"] >= 2):
        problems.append(("lower_order_final", "lower_order_final=False with "
                         "final_sigmas_type='zero' and solver_order >= 2: the last step to sigma 0 "
                         "would need an order >= 2 update, which is undefined there (diffusers "
                         "returns inf or fails to solve)"))

    refused = [(k, msg) for k, msg in problems if k not in ignore]
    if refused:
        lines = "\n".join(f"  - {msg}" for _, msg in refused)
        names = ", ".join(sorted({k for k, _ in refused}))
        raise FlowseamError(
            f"{file}: {card} cannot run this {cls_name} config as written; refused:\n{lines}\n"
            f"Fix the file, or pass ignore_scheduler_options=[...] (CLI: "
            f"--ignore-scheduler-option NAME) with {names} to run it without them (the output "
            "then differs from diffusers')")
    for key, msg in problems:  # the rest were asked to be ignored
        if key in resolved:
            ignored.append(f"{key}={resolved[key]!r}")
            config[key], sources[key] = class_defaults.get(key), IGNORED
        if key == "lower_order_final":  # a combination: ignoring it means lowering the order
            config[key], sources[key] = True, IGNORED
    if ignored:
        resolved = {k: v for k, v in dict(_instantiate(cls, config, file).config).items()
                    if not k.startswith("_")}
        warnings.warn(f"{file}: ignoring scheduler option(s) {', '.join(ignored)} at your "
                      f"request; {card}'s output will differ from diffusers'", UserWarning,
                      stacklevel=3)
    return SolverConfig(cls_name, resolved, sources, tuple(ignored), file)


@dataclass(frozen=True)
class Schedule:
    """One request's schedule: the sigmas (N + 1 floats), the DiT's timesteps ``(N,)`` float32,
    and the solver that made them (request overrides applied)."""

    sigmas: list[float]
    timesteps: Any
    solver: SolverConfig = field(repr=False)

    def first_order_sigmas(self) -> list[float]:
        """The sigmas a first-order step (Euler, Flow-GRPO's SDE step) takes on this schedule:
        diffusers' UniPC schedule starts at ``1 - 1e-6`` only to keep its log-SNR finite; a
        first-order step takes that first sigma as 1 (so the SDE step's ``sigma_max`` rule
        applies instead of a std of ``noise_level * 1000``). Otherwise the sigmas as they are."""
        sigmas = list(self.sigmas)
        if self.solver.scheduler_class == UNIPC and sigmas and math.isclose(
                sigmas[0], 1.0, rel_tol=0.0, abs_tol=2e-6):
            sigmas[0] = 1.0
        return sigmas


__all__ = ["CARD_DEFAULT", "CHECKPOINT", "DIFFUSERS_DEFAULT", "EULER", "IGNORED", "REQUEST",
           "SCHEDULER_CLASSES", "SERVING_DEFAULTS", "Schedule", "SolverConfig", "UNIPC",
           "resolve_solver"]
