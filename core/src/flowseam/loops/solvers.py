"""The one stepper of every loop: which kernel moves the latents, resolved once per run.

Every loop family (``flow_match``, ``wan_causal``, ``ltx2``) builds one :class:`SolverSteps` per
run and calls it once per denoising step with the DiT's velocity; no loop looks a solver kernel
up itself or writes its own ODE / SDE-window / re-noise branch. What differs between loops are
*inputs* to it: the serving sampler's ops, the sigma schedule of each stage (the run, a chunk, an
LTX-2 stage), what an SDE rollout runs outside its window, whether a stage starts re-noised.
Decision: an SDE rollout takes Flow-GRPO's first-order steps on the same schedule, never UniPC's
multistep ones, and the RL recompute is the same object with the rollout's kernels pinned (C2).
What runs at a step: :meth:`SolverSteps.__call__`; every kernel output is checked right after
the call (:func:`flowseam.loops.checks.check_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from .. import ops
from ..errors import InvalidInputError, KernelPinError
from .checks import check_step
from ..noise import noise_like

if TYPE_CHECKING:  # pragma: no cover
    from ..seam.kernels import KernelTable
    from ..request import DiffusionParams
    from ..schedulers import Schedule, SolverConfig
    from .records import BehaviorRecord, LoopResult

#: the chunk sampler of Self-Forcing and FlowMatchEuler's stochastic sampling
X0_RENOISE = (ops.FLOW_MATCH_STEP, ops.FLOW_RENOISE)


@dataclass
class Step:
    """What one solver step produced.

    :ivar next_latents: the latents after the step (the input's shape, dtype and device).
    :ivar log_prob: ``(B,)`` float32 log-prob of ``next_latents`` (SDE steps only, else None).
    :ivar impl_id: the kernel that produced ``next_latents`` (the re-noise kernel for an x0 +
        re-noise step; pin it to recompute an SDE step's log-prob).
    :ivar sigma, sigma_next: the step's noise levels; ``sigma_max`` the SDE step's std rule at
        sigma == 1 (Flow-GRPO's ``sigmas[1]`` of the stage), None for a one-step stage.
    """

    next_latents: torch.Tensor
    log_prob: torch.Tensor | None
    impl_id: str
    sigma: float
    sigma_next: float
    sigma_max: float | None


class SolverSteps:
    """The solver of one loop run: the kernels it needs, looked up once; what runs at a step is
    in :meth:`__call__`.

    :param kernels: the platform's kernel table; every op is looked up here, once, in ``__init__``.
    :param params: the request's parameters (``sde_rollout``, ``noise_level``, ``sde_window``).
    :param generators: one per sample; stochastic steps draw their noise from them.
    :param sampler: the serving solver's ops. For ``flow_match`` the ops the checkpoint's
        scheduler names (:attr:`flowseam.schedulers.SolverConfig.ops`): ``flow_match_step``
        (Euler); ``flow_match_step`` to sigma 0 then ``flow_renoise`` to the next sigma for
        FlowMatchEuler's ``stochastic_sampling``; ``unipc_step`` (its history carried in an
        explicit :class:`flowseam.ops.UniPCState`, order and corrector per step as diffusers
        chooses them). The causal loop's chunk sampler is Self-Forcing's :data:`X0_RENOISE`
        (predict x0, re-noise it with fresh noise), LTX-2's is Euler.
    :param config: the checkpoint's solver, for UniPC's per-step order and corrector.
    :param renoise: resolve ``flow_renoise`` for :meth:`renoise` (a stage that starts re-noised:
        LTX-2's stage 2 starts from the upsampled latents re-noised to the first refine sigma).
    :param outside_window: what an SDE rollout runs outside its ``sde_window``: ``"ode"`` (the
        Euler step, the default) or ``"sampler"`` (the serving sampler; not a multistep one),
        for a loop whose sampler is the only one its model is trained for (the causal loop:
        Self-Forcing's x0 + re-noise, counted per chunk).
    :param model: the model whose DiT computes the velocities, to name its plugin when a
        velocity is non-finite (:func:`flowseam.loops.checks.check_step`).
    :param pinned: implementation ids to pin instead of looking ops up (:meth:`recompute`).
    :raises UnknownOpError: when no backend on the platform registers an op the run needs.
    :raises KernelPinError: when a ``pinned`` id is not available on the platform.
    """

    def __init__(self, kernels: "KernelTable", params: "DiffusionParams",
                 generators: Sequence[torch.Generator], *,
                 sampler: Sequence[str] = (ops.FLOW_MATCH_STEP,),
                 config: "SolverConfig | None" = None, renoise: bool = False, model: Any = None,
                 outside_window: str = "ode", pinned: Iterable[str] = ()) -> None:
        sampler = tuple(sampler)
        if sampler not in ((ops.FLOW_MATCH_STEP,), X0_RENOISE, (ops.UNIPC_STEP,)):
            raise InvalidInputError(f"sampler {'+'.join(sampler)!r}: flowseam's stepper runs "
                                    "flow_match_step, flow_match_step+flow_renoise or unipc_step")
        if sampler == (ops.UNIPC_STEP,) and config is None:
            raise InvalidInputError("the unipc_step sampler needs the checkpoint's solver config "
                                    "(its solver_order, solver_type and corrector settings)")
        self.params, self.generators, self.model, self.config = params, list(generators), model, config
        self.sde = bool(params.sde_rollout)
        self.window = range(*params.sde_window) if params.sde_window is not None else None
        if outside_window not in ("ode", "sampler") or (
                outside_window == "sampler" and sampler == (ops.UNIPC_STEP,)):
            raise InvalidInputError(f"outside_window={outside_window!r}: 'ode', or 'sampler' for "
                                    "a single-step sampler")
        #: what runs where the SDE does not: the serving sampler, or in an SDE rollout the Euler
        #: step unless the loop asked for its sampler
        self.sampler = (ops.FLOW_MATCH_STEP,) if self.sde and outside_window == "ode" else sampler
        needed = ([ops.FLOW_SDE_STEP] if self.sde else []) + (
            list(self.sampler) if not self.sde or self.window is not None else [])
        if renoise:
            needed.append(ops.FLOW_RENOISE)
        #: impl_id → kernel: the rollout's SDE kernels of a recompute (:meth:`recompute`), pinned
        self.pinned = {impl_id: kernels.pin(impl_id) for impl_id in pinned}
        self.kernels = {} if self.pinned else {op: kernels.get(op) for op in dict.fromkeys(needed)}
        #: op → impl_id of every kernel a step (or a re-noise) used, in first-use order
        self.used: dict[str, str] = {}
        self.sigmas: list[float] = []
        self.first = 0
        self.sigma_max: float | None = None
        self.state = ops.UniPCState.empty()

    @classmethod
    def recompute(cls, kernels: "KernelTable", result: "LoopResult") -> "SolverSteps":
        """The solver of an RL update's log-prob recompute for the rollout ``result``: the same
        stepper with the SDE kernel that produced the rollout's records pinned
        (``kernels.pin(record.impl_id)``, never a fresh lookup), so the PPO ratio is exactly 1
        before any weight changes (C2) even when two backends differ numerically.

        :raises KernelPinError: if that kernel is not available on ``kernels``' platform.
        :raises InvalidInputError: for a rollout without any log-prob (not an SDE rollout).
        """
        ids = [rec.impl_id for rec in result.records if rec.log_prob is not None]
        if not ids:
            raise InvalidInputError("Flow-GRPO needs SDE rollouts (params.sde_rollout=True); no "
                                    "step of the rollout has a log-prob")
        return cls(kernels, result.params, (), pinned=dict.fromkeys(ids))

    @property
    def impl_ids(self) -> dict[str, str]:
        """op → the implementation id of every kernel the run used (``LoopResult.kernels``)."""
        return dict(self.used)

    def how(self) -> str:
        """What stepped, in words: ``"ODE"`` (Euler), ``"x0 + re-noise"``, ``"multistep"``,
        ``"Flow-GRPO SDE rollout, first-order, SDE steps 2-4"``."""
        if not self.sde:
            return {X0_RENOISE: "x0 + re-noise", (ops.UNIPC_STEP,): "multistep"}.get(
                self.sampler, "ODE")
        return "Flow-GRPO SDE rollout, first-order" + (
            f", SDE steps {self.window.start}-{self.window.stop - 1}" if self.window else "")

    def line(self, solver_line: str, schedule: str | None = None) -> str:
        """The one line of ``LoopResult.solver``: ``solver_line`` (the serving solver's own
        description, ``"solver OP (class, source): settings"``) with the op that stepped and its
        kernels' ``[impl_id]``; for an SDE rollout, or with ``schedule`` (a name such as
        ``"stage-1"``), ``"solver OP [impl] (how) on the <schedule> schedule: settings"``."""
        if not self.sde and schedule is None:
            op = "+".join(self.sampler)
            impl = "+".join(self.kernels[o].impl_id for o in self.sampler)
            return solver_line.replace(f"solver {op} ", f"solver {op} [{impl}] ", 1)
        op = ops.FLOW_SDE_STEP if self.sde else "+".join(self.sampler)
        impl = "+".join(self.kernels[o].impl_id for o in op.split("+"))
        if schedule is None:
            schedule = self.config.scheduler_class if self.config is not None else "stage-1"
        settings = solver_line.split(": ", 1)[-1]
        return f"solver {op} [{impl}] ({self.how()}) on the {schedule} schedule: {settings}"

    def start(self, sigmas: "Sequence[float] | Schedule", first: int = 0) -> None:
        """Begin a stage: its ``N + 1`` sigmas (or the request's
        :class:`~flowseam.schedulers.Schedule`, whose first-order sigmas an SDE rollout steps),
        and the run's index of its first step (``sde_window`` and the records count steps that
        way). Resets a multistep solver's history.

        A stage is the whole run for ``flow_match``; each chunk for ``wan_causal`` (the same
        per-chunk schedule, the window counted per chunk); stage 1 and stage 2 for ``ltx2``
        (steps numbered across the stages)."""
        if hasattr(sigmas, "first_order_sigmas"):
            sigmas = sigmas.first_order_sigmas() if self.sde else sigmas.sigmas
        self.sigmas, self.first = [float(s) for s in sigmas], first
        #: Flow-GRPO's sigma_max: the SDE step's std at sigma == 1 uses the stage's next sigma
        self.sigma_max = self.sigmas[1] if len(self.sigmas) > 2 else None
        self.state = ops.UniPCState.empty()

    def _use(self, op: str) -> Any:
        kernel = self.kernels[op]
        self.used.setdefault(op, kernel.impl_id)
        return kernel

    def __call__(self, i: int, latents: torch.Tensor, velocity: torch.Tensor,
                 label: int | str | None = None) -> Step:
        """Step ``i`` of the run (the stage's step ``i - first``): from its sigma to the next
        with the DiT's ``velocity`` (the latents' shape).

        What runs:

        * **serving** (and a ROLLOUT without ``sde_rollout``): the sampler. The x0 + re-noise
          sampler steps to sigma 0 and re-noises to the next sigma; at the last step (next sigma
          0) x0 is the output and no noise is drawn (Self-Forcing's sampler; for FlowMatchEuler's
          stochastic sampling the output is the same as diffusers', which draws that noise and
          multiplies it by 0).
        * **an SDE rollout** (``sde_rollout=True``): Flow-GRPO's first-order steps on the *same*
          sigma schedule and DiT timesteps: ``flow_sde_step`` (with its Gaussian log-prob) inside
          the ``sde_window`` (every step without one). Outside the window the step is the
          probability-flow ODE's Euler step ``flow_match_step`` (Flow-GRPO's window:
          deterministic steps around it), whatever the checkpoint serves with, or the sampler
          with ``outside_window="sampler"``. UniPC is not used in a rollout at all: its corrector
          rewrites the previous step's output after the DiT has seen it, so a step would no
          longer be the Gaussian transition whose log-prob was recorded (Flow-GRPO's likelihood
          ratio needs each step to be one); on a UniPC schedule the first sigma, ``1 - 1e-6``, is
          taken as 1 (:meth:`flowseam.schedulers.Schedule.first_order_sigmas`).

        :param label: how an error names the step (default ``i``; the causal loop says
            ``"2 of chunk 1"``).
        :raises KernelFaultError: a kernel raised or returned a wrong or non-finite result,
            naming the step, op and ``impl_id``.
        :raises ComponentFaultError: the velocity was already non-finite (the DiT's plugin).
        """
        k = i - self.first
        sigma, sigma_next = self.sigmas[k], self.sigmas[k + 1]
        label = i if label is None else label
        model, params = self.model, self.params
        if self.sde and (self.window is None or i in self.window):
            kernel = self._use(ops.FLOW_SDE_STEP)
            out = kernel(latents, velocity, sigma, sigma_next,
                         noise=noise_like(latents, self.generators),
                         noise_level=params.noise_level, sigma_max=self.sigma_max)
            sample, log_prob = getattr(out, "sample", out), getattr(out, "log_prob", None)
            check_step(model, label, kernel, latents, velocity, sample, sigma, sigma_next,
                       log_prob, sde=True)
            return Step(sample, log_prob, kernel.impl_id, sigma, sigma_next, self.sigma_max)
        if self.sampler == (ops.UNIPC_STEP,):
            kernel = self._use(ops.UNIPC_STEP)
            steps = len(self.sigmas) - 1
            out = kernel(latents, velocity, sigma, sigma_next, self.state,
                         order=self.config.unipc_order(k, steps),
                         solver_type=self.config.config["solver_type"],
                         corrector=self.config.unipc_corrector(k))
            sample = getattr(out, "sample", out)
            check_step(model, label, kernel, latents, velocity, sample, sigma, sigma_next)
            self.state = out.state
            return Step(sample, None, kernel.impl_id, sigma, sigma_next, self.sigma_max)
        euler = self._use(ops.FLOW_MATCH_STEP)
        if self.sampler == X0_RENOISE:  # predict x0, re-noise it with fresh noise
            x0 = euler(latents, velocity, sigma, 0.0)
            check_step(model, label, euler, latents, velocity, x0, sigma, 0.0)
            if sigma_next <= 0.0:
                return Step(x0, None, euler.impl_id, sigma, sigma_next, self.sigma_max)
            renoise = self._use(ops.FLOW_RENOISE)
            out = renoise(x0, noise_like(x0, self.generators), sigma_next)
            check_step(model, label, renoise, x0, None, out, 0.0, sigma_next)
            return Step(out, None, renoise.impl_id, sigma, sigma_next, self.sigma_max)
        out = euler(latents, velocity, sigma, sigma_next)
        check_step(model, label, euler, latents, velocity, out, sigma, sigma_next)
        return Step(out, None, euler.impl_id, sigma, sigma_next, self.sigma_max)

    def renoise(self, latents: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
        """``(1 - sigma) * latents + sigma * noise`` with the platform's ``flow_renoise`` kernel
        (LTX-2's stage-2 start, diffusers' ``_create_noised_state``); the card draws ``noise``
        (its layout decides the draw order). Needs ``renoise=True``.

        :raises KernelFaultError: the kernel raised or returned a wrong or non-finite result.
        """
        kernel = self._use(ops.FLOW_RENOISE)
        out = kernel(latents, noise, sigma)
        check_step(self.model, "renoise", kernel, latents, None, out, 0.0, sigma)
        return out

    def log_prob(self, record: "BehaviorRecord", velocity: torch.Tensor) -> Any:
        """Flow-GRPO's SDE step of ``record`` evaluated at the rollout's own next latents
        (``prev_sample=record.next_latents``) with ``velocity`` (recomputed by the policy, with
        gradients if enabled): its ``log_prob`` ``(B,)``, ``mean`` and ``std`` (the KL to a
        reference uses them). Call it on a :meth:`recompute` solver, whose kernel is the one
        that produced the record.

        :raises KernelPinError: if ``record`` names a kernel this recompute did not pin.
        """
        kernel = self.pinned.get(record.impl_id)
        if kernel is None:
            raise KernelPinError(f"record {record.index} was produced by {record.impl_id}; this "
                                 f"recompute pinned {sorted(self.pinned)}")
        return kernel(record.latents, velocity, record.sigma, record.sigma_next,
                      prev_sample=record.next_latents, noise_level=self.params.noise_level,
                      sigma_max=record.sigma_max)


__all__ = ["SolverSteps", "Step", "X0_RENOISE"]
