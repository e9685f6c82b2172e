"""flowseam's accel backend: ``torch.compile`` on the best torch device of the host.

flowseam finds this package only through its entry point (``accel = "flowseam_accel.plugin"``
in the ``flowseam.plugins`` group, see ``pyproject.toml``); core never imports it. It is the
worked example for third-party backend authors, one concept per module:

==============  =================================================================================
``plugin``      the hook implementations: backend declaration (its priority depends on the
                device), availability, arch chain, kernel registrations, component kinds and
                builder, conformance expectations
``device``      which torch device (cuda, else mps, else cpu), the arch chain, whether
                torch.compile can run here
``kernels``     ``flow_match_step``, ``flow_sde_step`` and ``flow_renoise``, fused by inductor,
                following the contracts in :mod:`flowseam.ops`
``components``  the ``dit`` (its repeated transformer blocks compiled in place: regional
                compilation) and the ``vae`` (its encoder and decoder compiled in place)
``compiled``    the compiled entry points' seconds, compiling booked apart from running
==============  =================================================================================

What accel provides, and what it leaves to cpu on purpose
    * device ``accel``, available wherever ``torch.compile`` can run (a supported Python, and a C++
      compiler for the CPU or triton for CUDA); priority 50 on a GPU or MPS (above cpu's 0,
      below cuda's 100), -10 where its torch device is the CPU, so that ``Platform.detect()``
      picks cpu there and nothing compiles unless asked (``Platform("accel")``, ``--backend
      accel``);
    * ``flow_match_step`` and ``flow_renoise`` at arch ``generic`` (found by walking the arch
      chain) and ``flow_sde_step`` at the most specific rung of the host (a direct hit); no
      ``attention``, ``cached_attention`` or ``unipc_step``: those fall back to cpu's eager kernels;
    * the ``dit`` and ``vae`` components; no ``text_encoder`` (nor the other kinds): the fallback
      to cpu is exercised wherever accel runs, and ``platform.explain()`` shows it.

Compile time, and warm starts
    Compilation is lazy, once per compiled function and input signature
    (:func:`compile_report` books those seconds apart); a DiT's repeated blocks share one
    block's graphs, and with dynamic shapes a new resolution is not a new signature. Across
    processes torch.compile's own caches serve warm starts: inductor's FX graph cache (generated
    code and compiled kernels, keyed by the traced graph, its inputs, the torch version and the
    inductor config) and the AOTAutograd cache, both under ``TORCHINDUCTOR_CACHE_DIR``. A later
    process still traces with dynamo, then loads instead of compiling; a changed key is a
    recompile, never a wrong result.
"""

from .compiled import compile_report, reset_compile_report
from .device import arch_chain, torch_device

__version__ = "0.1.0"

__all__ = ["arch_chain", "compile_report", "reset_compile_report", "torch_device"]
