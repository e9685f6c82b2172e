"""flowseam's CUDA backend: GPU components, fast attention, cupy fused solver kernels.

Loaded through the ``flowseam.plugins`` entry point ``cuda = flowseam_cuda.plugin``; core never
imports it. Without a CUDA device or without cupy it imports cleanly and reports itself
``unavailable`` with the reason (``flowseam backends`` shows it).
``plugins/cuda/gpu_check.sh`` runs its tests and kernel benchmarks on a GPU machine.

================  ===============================================================================
``plugin``        the hook implementations (device ``cuda``, priority 100)
``device``        availability, torch device, arch chain from the compute capability
``cupy_kernels``  ``flow_match_step`` / ``flow_sde_step`` as cupy kernels over DLPack (arch sm80)
``torch_kernels`` torch fallbacks (arch generic) and the attention op (flash-attn / fused SDPA)
``components``    dit (bf16), vae, text_encoder, image_encoder (float32) on the GPU
================  ===============================================================================
"""

__version__ = "0.1.0"
