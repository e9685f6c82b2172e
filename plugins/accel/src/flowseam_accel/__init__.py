"""flowseam's accel backend: ``torch.compile`` on the best torch device of the host.

flowseam finds this package only through its entry point (``accel = "flowseam_accel.plugin"``
in the ``flowseam.plugins`` group, see ``pyproject.toml``); core never imports it. It is also
the worked example for third-party backend authors, one concept per module:

================  ===============================================================================
``plugin``        the hook implementations: backend declaration, availability, arch chain,
                  kernel registrations, component kinds and builder
``device``        which torch device (cuda, else mps, else cpu), the arch chain, whether
                  torch.compile can run here
``kernels``       ``flow_match_step``, ``flow_sde_step`` and ``flow_renoise``, fused by
                  inductor (on the CPU the Euler step is cpu's eager call, measured faster),
                  following the contracts in :mod:`flowseam.ops`
``components``    the ``dit`` builder: the real diffusers class, its repeated transformer
                  blocks compiled in place (regional compilation); why the VAE is left to cpu
``aot``           the blocks' no-grad calls through AOTInductor packages cached on disk
``compiled``      compile once per signature; compile seconds booked apart from run seconds
================  ===============================================================================

What accel provides, and what it leaves to cpu on purpose:

* device ``accel``, priority 50 (above cpu's 0, below cuda's 100); available wherever
  ``torch.compile`` can run (a supported Python, and a C++ compiler for the CPU or triton for CUDA);
* ``flow_match_step`` at arch ``generic`` (found by walking the arch chain) and ``flow_sde_step`` at
  the most specific rung of the host (a direct hit); no ``attention`` kernel (cpu's is used),
  and no ``unipc_step``: that solver falls back to cpu's eager kernel (a few elementwise passes per step; ``platform.explain()`` shows the fallback);
* the ``dit`` component; no ``vae`` (cpu's eager oneDNN build: compiling the Wan VAE cost most
  of a cold start, see :mod:`flowseam_accel.components`) and no ``text_encoder``: both fall back
  to cpu, and ``platform.components`` / ``platform.explain()`` say so.

Compile time
    Compilation is lazy and happens once per module (or kernel) and input signature; a DiT's
    repeated blocks share one compiled block (regional compilation, see
    :mod:`flowseam_accel.components`), and with dynamic shapes a new resolution or frame count is
    not a new signature (a batch of one still is); :func:`compile_report` returns the seconds spent compiling apart from the seconds spent
    running (how they are told apart: :mod:`flowseam_accel.compiled`).

Reusing compiled code across processes
    inductor caches its work on disk, so only the first process pays the full compile. The FX
    graph cache (``torch._inductor.config.fx_graph_cache``, on by default) stores the generated
    code and the compiled C++/triton kernels, keyed by a hash of the traced graph, its input
    metadata, the torch version and the inductor config; the AOTAutograd cache
    (``torch._functorch.config.enable_autograd_cache``, on by default) stores the
    forward/backward split on top of it. Both live under ``TORCHINDUCTOR_CACHE_DIR`` (default
    ``/tmp/torchinductor_<user>``). A later process still traces with dynamo (that part is not
    cached; regional compilation keeps it to one block per block class) but then loads instead
    of compiling. The DiT blocks' no-grad calls and the float32 solver kernels on the CPU (the
    Euler step there compiles nothing at all, see :mod:`flowseam_accel.kernels`) skip
    dynamo altogether: their AOTInductor packages (:mod:`flowseam_accel.aot`,
    :mod:`flowseam_accel.kernels`) are stored under the same directory
    (:mod:`flowseam_accel.store`) and loaded as they are (figures: ``bench/backends.py --cold``, in the README's benchmark table). To keep the cache across machines or CI runs, point
    ``TORCHINDUCTOR_CACHE_DIR`` at a persistent directory before the first compile (or ship the
    artifacts with ``torch.compiler.save_cache_artifacts()`` / ``load_cache_artifacts()``), and
    keep torch, this package and the inductor config the same: any change is a new key, i.e. a
    recompile, never a wrong result. ``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` turns the cache off, to
    measure a cold compile.
"""

from .compiled import compile_report, reset_compile_report
from .device import arch_chain, torch_device

__version__ = "0.1.0"

__all__ = ["arch_chain", "compile_report", "reset_compile_report", "torch_device"]
