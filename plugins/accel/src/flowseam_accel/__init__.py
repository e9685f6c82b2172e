"""flowseam's accel backend: ``torch.compile`` on the best torch device of the host.

The worked example for third-party backend authors. flowseam finds it only through its entry
point (``accel = "flowseam_accel.plugin"`` in the ``flowseam.plugins`` group, ``pyproject.toml``);
core never imports it. One concept per module: ``plugin`` (the hooks), ``device`` (which torch
device, the arch chain, whether torch.compile runs here), ``kernels`` (solver ops fused by
inductor), ``components`` (the ``dit`` and ``vae`` compiled in place), ``compiled`` (compile
seconds booked apart from run seconds). It leaves ``text_encoder``, every other kind and the
attention ops to cpu on purpose, so the fallback path runs wherever accel does; where its torch
device is the CPU its priority is below cpu's, so nothing compiles unless asked
(``--backend accel``). Compilation is lazy, once per function and input signature, and
torch.compile's own caches (``TORCHINDUCTOR_CACHE_DIR``) serve later processes.
plugins/accel/README.md lists what it provides and why; docs/writing-a-backend.md walks through
every hook with accel's answer.
"""

from .compiled import compile_report, reset_compile_report
from .device import arch_chain, torch_device

__version__ = "0.1.0"

__all__ = ["arch_chain", "compile_report", "reset_compile_report", "torch_device"]
