"""flowseam's CPU backend (torch, float32). Loaded by flowseam through the ``flowseam.plugins``
entry point ``cpu = flowseam_cpu.plugin``; nothing imports it directly."""

__version__ = "0.1.0"
