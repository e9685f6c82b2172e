"""flowseam vs diffusers: the same LTX-2 two-stage generation (video + audio), alternating in one
process.

A small but non-trivial LTX-2 config, random weights written by
``flowseam.testing.tiny.write_tiny_checkpoint("ltx2-t2v", ...)`` with a bigger DiT (4 layers,
video 4 heads x 32 = width 128, audio 4 heads x 16 = width 64) and text connectors
(2 layers each); 17 frames at 64x64 (stage 1 at 32x32), 25 fps; stage 1: 8 steps with video
CFG 3 and audio CFG 4; the latent upsampler; stage 2: the 3 distilled refine sigmas at guidance 1;
the pipeline's default 1024 text tokens. diffusers runs its documented two-stage recipe:
``LTX2Pipeline`` (``output_type="latent"``), ``LTX2LatentUpsamplePipeline``, ``LTX2Pipeline`` with
``latents``, ``audio_latents``, ``noise_scale`` and a scheduler without dynamic or terminal shift
(STG, modality guidance and guidance rescale off, as flowseam has only CFG). After one warm-up run
each, they alternate ``--repeats`` times (who goes first alternates too). Reports the median
wall and CPU seconds of each, the ratios flowseam/diffusers (goal <= 0.9; at one torch thread,
``OMP_NUM_THREADS=1``, CPU seconds measure the work and wall seconds the wait on a shared machine),
the peak resident-memory growth of each run (the kernel's peak RSS, reset before each run), and
the max-abs difference of their frames and waveforms.
``--profile N`` then runs each side once more under ``torch.profiler`` and prints its N top ops.

Run: .venv/bin/python bench/ltx2_vs_diffusers.py [--repeats 5] [--backend cpu] [--profile 12]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from generate_vs_diffusers import alternate_timed, bench_parser, profile, report  # Wan bench's

REFINE = [0.909375, 0.725, 0.421875]
PEER_OFF = dict(stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_stg_scale=0.0,
                audio_modality_scale=1.0, audio_guidance_rescale=0.0)


def main() -> None:
    ap = bench_parser(__doc__, steps=8)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then print each side's N top ops by self CPU time (torch.profiler)")
    args = ap.parse_args()

    import diffusers
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel, LTX2LatentUpsamplePipeline

    import flowseam
    from flowseam.testing.tiny import write_tiny_checkpoint

    diffusers.utils.logging.set_verbosity_error()
    root = Path(tempfile.mkdtemp(prefix="fs-bench-ltx2-"))
    ckpt = write_tiny_checkpoint(
        "ltx2-t2v", root / "ltx2",
        transformer=dict(num_layers=4, num_attention_heads=4, attention_head_dim=32,
                         cross_attention_dim=128, audio_num_attention_heads=4,
                         audio_attention_head_dim=16, audio_cross_attention_dim=64),
        connectors=dict(video_connector_num_layers=2, audio_connector_num_layers=2))
    H = W = 64
    F, fps, g_video, g_audio = 17, 25.0, 3.0, 4.0
    prompt, negative = "a dog barking at a red ball in the garden", "blurry, low quality"

    model = flowseam.load(ckpt, platform=flowseam.Platform(args.backend))
    params = flowseam.DiffusionParams(num_steps=args.steps, guidance_scale=g_video,
                                      audio_guidance_scale=g_audio, height=H, width=W,
                                      num_frames=F, frame_rate=fps, seed=0,
                                      negative_prompt=negative, stages=2)
    pipe = diffusers.LTX2Pipeline.from_pretrained(ckpt)
    pipe.set_progress_bar_config(disable=True)
    stage1_config = dict(pipe.scheduler.config)
    upsampler = LTX2LatentUpsamplerModel.from_pretrained(ckpt, subfolder="latent_upsampler")
    upsample = LTX2LatentUpsamplePipeline(vae=pipe.vae, latent_upsampler=upsampler)
    upsample.set_progress_bar_config(disable=True)

    def run_flowseam():
        out = model.generate(prompt, params=params)
        return out.frames, out.audio

    def run_diffusers():
        g = torch.Generator().manual_seed(0)
        common = dict(prompt=prompt, negative_prompt=negative, num_frames=F, frame_rate=fps,
                      generator=g, return_dict=False, **PEER_OFF)
        pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(stage1_config)
        video, audio = pipe(height=H // 2, width=W // 2, num_inference_steps=args.steps,
                            guidance_scale=g_video, audio_guidance_scale=g_audio,
                            output_type="latent", **common)
        video = upsample(latents=video, output_type="latent", return_dict=False)[0]
        pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(
            stage1_config, use_dynamic_shifting=False, shift_terminal=None)
        frames, audio = pipe(latents=video, audio_latents=audio, height=H, width=W,
                             num_inference_steps=len(REFINE), sigmas=REFINE, noise_scale=REFINE[0],
                             guidance_scale=1.0, audio_guidance_scale=1.0, output_type="np",
                             **common)
        return frames, audio.float().numpy()

    ours, theirs = run_flowseam(), run_diffusers()  # warm-up (and parity)
    times, cpu, peaks = alternate_timed({"flowseam": run_flowseam, "diffusers": run_diffusers},
                                        args.repeats)
    print(f"LTX-2 two-stage T2V+audio, DiT 4 layers x width 128 (audio 64), {F} frames {H}x{W} "
          f"(stage 1 {H // 2}x{W // 2}) at {fps:g} fps, {args.steps} + {len(REFINE)} steps, CFG "
          f"{g_video:g}/{g_audio:g} then 1; backend {args.backend}; torch threads "
          f"{torch.get_num_threads()}")
    report(times, peaks, goal=0.9, cpu=cpu)
    print(f"  max |flowseam - diffusers|: frames {np.abs(ours[0] - theirs[0]).max():.2e}, "
          f"waveform {np.abs(ours[1] - theirs[1]).max():.2e}")
    profile({"flowseam": run_flowseam, "diffusers": run_diffusers}, args.profile)


if __name__ == "__main__":
    main()
