"""flowseam's conformance suite: the tests any backend package runs against itself.

Run it for one backend (or several; the default is every installed backend)::

    pytest --pyargs flowseam.testing.conformance --flowseam-backend mybackend

The ``--flowseam-backend`` option and the ``flowseam_platform`` fixture come from flowseam's pytest
plugin (:mod:`flowseam.testing.pytest_plugin`). Every test id starts with the backend's name. What
is checked, for the backend under test:

``test_kernels.py`` — every kernel it registers (every op, every arch rung on this host's chain;
rungs of other hosts are skipped with the reason):

* ``test_kernel_matches_oracle``: against the numpy float64 oracle
  (:mod:`flowseam.ops.reference`), with the tolerance of the output dtype
  (``flowseam.ops.reference.TOLERANCES``), for x/v in float32, float64, bfloat16, float16 and
  float32 latents with a bfloat16 velocity, on shapes of rank 2 to 5 (odd sizes, batch 1 to 3),
  at sigma 1 (with sigma_max), a middle step, the last step to sigma 0 and the SDE step at
  ``noise_level=0``; UniPC at orders 1-3, bh1 and bh2, with and without its corrector, from an
  empty history, to sigma 0 and on a repeated final sigma (sample and the whole state compared);
  attention with and without boolean/additive masks, cross-attention and a custom scale;
* ``test_kernel_rejects_bad_arguments``: ``ValueError`` for the contract's bad arguments
  (a per-sample ``(B,)`` sigma among them);
* ``test_sde_recompute_reproduces_log_prob``: C2 at the kernel level (recomputing with
  ``prev_sample=`` gives the rollout's log-prob, PPO ratio 1 within 1e-6), a seeded generator is
  deterministic, and the drawn noise is standard normal;
* ``test_sde_log_prob_gradient``: the gradient of the log-prob reaches x and v through the mean
  only, as Flow-GRPO's formula says.

``test_components.py`` — on tiny checkpoints of every card (:mod:`flowseam.testing.tiny`):

* ``test_component_placement``: each component was built where the backend's expectations say
  (by the backend itself, or falling back to cpu with ``fallback=True`` and a reason that
  ``platform.explain()`` shows);
* ``test_overridden_component_matches_cpu``: every component the backend built gives the
  outputs of the cpu build of the same weights on the inputs the serve loop gave it (tolerance
  of the component's dtype);
* ``test_expectations_agree_with_declarations``.

``test_loops.py`` — for ``wan2.1-t2v``, ``wan2.1-i2v`` and ``flux.1-t2i``:

* ``test_serve_parity_with_cpu`` (C1): the same request and seed on the backend and on cpu give
  the same latents and frames within the tolerance of the DiT's dtype;
* ``test_checkpoint_solver_matches_diffusers``: the solvers a checkpoint's scheduler may name
  (UniPC at orders 2 and 3, FlowMatchEuler's stochastic sampling, a static shift on FLUX) run
  through the platform's kernel for that op (or its cpu fallback) and equal diffusers' own
  pipeline on the same checkpoint and seed, within the tolerance of the DiT's dtype;
* ``test_rollout_log_prob_recomputes`` (C2): a real SDE rollout
  (``run_loop(..., profile=ExecutionProfile.ROLLOUT)``), then for every step the velocity
  recomputed with ``model.velocity`` and the log-prob recomputed with the *pinned* kernel
  (``platform.kernels.pin(record.impl_id)``): the PPO ratio is 1 within 1e-6.

Expectations and expected failures: a backend implements the hook
:func:`flowseam.seam.hookspecs.flowseam_conformance_expectations` (see
:class:`flowseam.ConformanceExpectations`); the file format is in
:mod:`flowseam.testing.conformance.expectations`. ``docs/writing-a-backend.md`` walks through it.

The whole suite takes well under a minute for the cpu backend on two CPU cores; backends that
compile (accel) pay their compile time once per graph (cached on disk across runs).
"""
