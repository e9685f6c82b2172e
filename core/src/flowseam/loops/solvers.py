"""The solver of one loop run: which op steps the latents, resolved once before the first step.

Shared by every loop module (it sits below them, like :mod:`.records`). A loop builds one
:class:`SolverSteps` per run and calls it once per step with the velocity; it never looks a kernel
up again. What runs:

* **serving** (and ROLLOUT without ``sde_rollout``): the ops the checkpoint's scheduler names
  (:attr:`flowseam.schedulers.SolverConfig.ops`): ``flow_match_step``; for FlowMatchEuler's
  stochastic sampling ``flow_match_step`` to sigma 0 (the data prediction) and ``flow_renoise``
  to the next sigma with noise from the request's per-sample generators; or ``unipc_step`` (its
  history carried in an explicit :class:`flowseam.ops.UniPCState`, order and corrector per step
  as diffusers chooses them); on the checkpoint's sigma schedule;
* **an SDE rollout** (``sde_rollout=True``): Flow-GRPO's first-order steps on the *same* sigma
  schedule and DiT timesteps: ``flow_sde_step`` (with its log-prob) inside the ``sde_window``,
  the probability-flow ODE's Euler step ``flow_match_step`` outside it, whatever solver the
  checkpoint serves with. A multistep solver is not used in a rollout: UniPC's corrector rewrites
  the previous step's output after the DiT has seen it, so a step would no longer be the Gaussian
  transition whose log-prob was recorded (the likelihood ratio of Flow-GRPO needs each step to
  be one). On a UniPC schedule the first sigma, ``1 - 1e-6``, is taken as 1
  (:meth:`flowseam.schedulers.Schedule.first_order_sigmas`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import ops
from ..faults import check_step
from ..noise import noise_like

if TYPE_CHECKING:  # pragma: no cover
    from ..kernels import KernelTable
    from ..request import DiffusionParams
    from ..schedulers import Schedule


@dataclass
class Step:
    """What one solver step produced: the next latents, the log-prob (SDE steps only), the
    kernel that ran and the step's sigmas."""

    next_latents: torch.Tensor
    log_prob: torch.Tensor | None
    impl_id: str
    sigma: float
    sigma_next: float


class SolverSteps:
    """The solver of one loop run (see the module docstring).

    :param kernels: the platform's kernel table; every op is looked up here, once.
    :param schedule: the request's schedule (sigmas, timesteps, solver).
    :param params: the request's parameters (``sde_rollout``, ``noise_level``, ``sde_window``).
    :param generators: one per sample; stochastic steps draw their noise from them.
    :param model: the model whose DiT computes the velocities, to name its plugin when a
        velocity is non-finite (:func:`flowseam.faults.check_step`).

    Every kernel output is checked right after the call (the latents' shape, dtype and device,
    finite; an SDE step's ``(B,)`` finite log-prob): a wrong one raises
    :class:`~flowseam.errors.KernelFaultError` naming the step, op and ``impl_id``, or
    :class:`~flowseam.errors.ComponentFaultError` naming the DiT's plugin when the velocity it
    was given was already non-finite.
    """

    def __init__(self, kernels: "KernelTable", schedule: "Schedule", params: "DiffusionParams",
                 generators: list[torch.Generator], model: Any = None) -> None:
        self.model = model
        self.solver = schedule.solver
        self.params = params
        self.generators = generators
        self.num_steps = len(schedule.sigmas) - 1
        if params.sde_rollout:
            self.ops: tuple[str, ...] = (ops.FLOW_SDE_STEP,)
            self.sigmas = schedule.first_order_sigmas()
            self.ode = kernels.get(ops.FLOW_MATCH_STEP)  # outside the sde_window
        else:
            self.ops = self.solver.ops
            self.sigmas = list(schedule.sigmas)
        self.op = "+".join(self.ops)
        self.kernels = {op: kernels.get(op) for op in self.ops}
        self.kernel = self.kernels[self.ops[0]]
        self.window = range(*params.sde_window) if params.sde_window is not None else None
        #: Flow-GRPO's sigma_max: the SDE step's std at sigma == 1 uses the next sigma
        self.sigma_max = self.sigmas[1] if len(self.sigmas) > 2 else None
        self.state = ops.UniPCState.empty()

    @property
    def impl_id(self) -> str:
        """The implementation ids of the ops that step (``+``-joined when there are two)."""
        return "+".join(k.impl_id for k in self.kernels.values())

    @property
    def impl_ids(self) -> dict[str, str]:
        """op → the implementation id of its kernel (``LoopResult.kernels``)."""
        return {op: k.impl_id for op, k in self.kernels.items()}

    def describe(self) -> str:
        """One line: the op and kernel that ran and the schedule's settings and sources."""
        if self.op == ops.FLOW_SDE_STEP:
            how = ("Flow-GRPO SDE rollout, first-order"
                   + (f", SDE steps {self.window.start}-{self.window.stop - 1}" if self.window else ""))
            settings = self.solver.describe().split(": ", 1)[-1]
            return (f"solver {self.op} [{self.impl_id}] ({how}) on the "
                    f"{self.solver.scheduler_class} schedule: {settings}")
        return self.solver.describe().replace(f"solver {self.op} ", f"solver {self.op} "
                                              f"[{self.impl_id}] ", 1)

    def __call__(self, i: int, latents: torch.Tensor, velocity: torch.Tensor) -> Step:
        """Step ``i``: from ``sigmas[i]`` to ``sigmas[i + 1]`` with the DiT's ``velocity``."""
        sigma, sigma_next = self.sigmas[i], self.sigmas[i + 1]
        params = self.params
        model = self.model
        if self.op == ops.FLOW_SDE_STEP:
            if self.window is not None and i not in self.window:
                out = self.ode(latents, velocity, sigma, sigma_next)
                check_step(model, i, self.ode, latents, velocity, out, sigma, sigma_next)
                return Step(out, None, self.ode.impl_id, sigma, sigma_next)
            out = self.kernel(latents, velocity, sigma, sigma_next,
                              noise=noise_like(latents, self.generators),
                              noise_level=params.noise_level, sigma_max=self.sigma_max)
            sample, log_prob = getattr(out, "sample", out), getattr(out, "log_prob", None)
            check_step(model, i, self.kernel, latents, velocity, sample, sigma, sigma_next,
                       log_prob, sde=True)
            return Step(sample, log_prob, self.impl_id, sigma, sigma_next)
        if self.op == ops.UNIPC_STEP:
            out = self.kernel(latents, velocity, sigma, sigma_next, self.state,
                              order=self.solver.unipc_order(i, self.num_steps),
                              solver_type=self.solver.config["solver_type"],
                              corrector=self.solver.unipc_corrector(i))
            sample = getattr(out, "sample", out)
            check_step(model, i, self.kernel, latents, velocity, sample, sigma, sigma_next)
            self.state = out.state
            return Step(sample, None, self.impl_id, sigma, sigma_next)
        if ops.FLOW_RENOISE in self.kernels:  # stochastic sampling: predict x0, re-noise it
            renoise = self.kernels[ops.FLOW_RENOISE]
            x0 = self.kernel(latents, velocity, sigma, 0.0)
            check_step(model, i, self.kernel, latents, velocity, x0, sigma, 0.0)
            out = renoise(x0, noise_like(latents, self.generators), sigma_next)
            check_step(model, i, renoise, x0, None, out, 0.0, sigma_next)
            return Step(out, None, renoise.impl_id, sigma, sigma_next)
        out = self.kernel(latents, velocity, sigma, sigma_next)
        check_step(model, i, self.kernel, latents, velocity, out, sigma, sigma_next)
        return Step(out, None, self.impl_id, sigma, sigma_next)


__all__ = ["SolverSteps", "Step"]
