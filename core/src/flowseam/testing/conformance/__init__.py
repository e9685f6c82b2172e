"""flowseam's conformance suite: the tests any backend package runs against itself.

Run it for one backend (or several; the default is every installed backend)::

    pytest --pyargs flowseam.testing.conformance --flowseam-backend mybackend

``test_kernels.py`` checks every kernel the backend registers against the numpy float64 oracle
and the op contracts; ``test_components.py`` checks where each component of every card's tiny
checkpoint was built and that what the backend built computes what cpu's build does;
``test_loops.py`` runs the loops end to end: serve parity with cpu (C1), a checkpoint's solvers
against diffusers' pipelines, and a real rollout's log-probs recomputed with the pinned kernels
(C2). The option and the ``flowseam_platform`` fixture come from
:mod:`flowseam.testing.pytest_plugin`; a backend states its promises and known failures through
:mod:`.expectations`. Every test and case: docs/writing-a-backend.md, sections 6 and 7.
"""
