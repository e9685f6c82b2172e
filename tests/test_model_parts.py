"""The parts a loaded model holds, each on its own, without loading a model: which DiT expert
denoises a step (:class:`flowseam.models.experts.Experts`), what a card supports of splitting a
generation (:class:`flowseam.models.split.SplitSupport`), and where components run
(:class:`flowseam.models.placement.Placement`)."""

from __future__ import annotations

import pytest
import torch

from flowseam import DiffusionParams, InvalidInputError, Parallel
from flowseam.memory import Components, MemoryOptions
from flowseam.models import WAN22_T2V, WAN_CAUSAL_T2V, WAN_T2V
from flowseam.models.experts import Experts
from flowseam.models.placement import Placement
from flowseam.seam import ComponentSpec

HIGH, LOW = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)


def test_two_experts_split_the_steps_as_diffusers_wan_pipeline_does():
    """diffusers' WanPipeline: ``transformer`` where ``t >= boundary_ratio *
    num_train_timesteps``, else ``transformer_2`` (0.875 * 1000 here), each with its own
    guidance scale (``guidance_scale_2`` defaulting to ``guidance_scale``)."""
    experts = Experts(("transformer", "transformer_2"), {"transformer": HIGH,
                                                         "transformer_2": LOW}, 875.0, "m")
    assert list(experts) == ["transformer", "transformer_2"] and len(experts) == 2
    assert [experts.at(t) for t in (999.0, 875.0, 874.9, 0.0)] == \
        ["transformer", "transformer", "transformer_2", "transformer_2"]
    assert experts.at(torch.tensor([875.0, 1.0])) == "transformer"  # a batch: its first timestep
    params = DiffusionParams(guidance_scale=5.0, guidance_scale_2=3.0)
    assert experts.guidance("transformer", params) == 5.0
    assert experts.guidance("transformer_2", params) == 3.0
    assert experts.guidance("transformer_2", DiffusionParams(guidance_scale=5.0)) == 5.0
    mine = torch.nn.Linear(2, 2)
    assert experts.pick(torch.tensor([10.0]), None, None) == ("transformer_2", LOW)
    assert experts.pick(torch.tensor([10.0]), "transformer", mine) == ("transformer", mine)
    with pytest.raises(InvalidInputError, match=r"expert='transformer_3': m has experts"):
        experts.pick(torch.tensor([10.0]), "transformer_3", None)
    experts.check(params)


def test_one_expert_owns_every_step_and_refuses_a_second_guidance_scale():
    components = {"transformer": HIGH, "vae": LOW}
    experts = Experts(("transformer",), components, 875.0, "wan2.1-t2v")
    assert experts.boundary_timestep is None and dict(experts) == {"transformer": HIGH}
    assert experts.at(0.0) == "transformer" and "vae" not in experts
    with pytest.raises(InvalidInputError, match="guidance_scale_2=3.0 is for two-expert"):
        experts.check(DiffusionParams(guidance_scale_2=3.0))
    components["transformer"] = mine = torch.nn.Linear(2, 2)  # a live view of the components
    assert experts["transformer"] is mine


#: the DiT's and the VAE's configs as a tiny Wan checkpoint's config.json have them
WAN_CONFIGS = {"transformer": {"patch_size": [1, 2, 2], "num_attention_heads": 2},
               "vae": {"scale_factor_temporal": 4, "scale_factor_spatial": 8}}


def test_a_card_refuses_what_it_cannot_split_naming_the_numbers():
    """Wan's tokens after patching: ``((F - 1) / 4 + 1) * (H / 16) * (W / 16)``; 5 frames of
    32x32 are 2 * 2 * 2 = 8 tokens, which sp 2 divides and sp 3 does not."""
    split = WAN_T2V.split
    params = DiffusionParams(num_frames=5, height=32, width=32, guidance_scale=5.0)
    split.check_layout(Parallel(sp=2, cfg=True), {"transformer": 2}, "wan")
    split.check_request(Parallel(sp=2, cfg=True), params, WAN_CONFIGS, "wan")
    assert WAN22_T2V.split is split  # Wan2.2's two experts split as Wan2.1's one
    with pytest.raises(InvalidInputError, match="has 2 attention heads, not a multiple of 4"):
        split.check_layout(Parallel(sp=4), {"transformer": 2}, "wan")
    split.check_layout(Parallel(sp=4), {"transformer": 2}, "wan", any_heads=True)  # ring attention
    with pytest.raises(InvalidInputError, match="makes 18 tokens after patching, not a multiple"):
        split.check_request(Parallel(sp=4), params.replace(height=48, width=48), WAN_CONFIGS,
                            "wan", any_heads=True)  # 2 * 3 * 3
    with pytest.raises(InvalidInputError, match="guidance_scale=1.0 runs no unconditional"):
        split.check_request(Parallel(cfg=True), params.replace(guidance_scale=1.0), WAN_CONFIGS,
                            "wan")
    with pytest.raises(InvalidInputError, match="cannot split its sequence \\(the causal loop"):
        WAN_CAUSAL_T2V.split.check_layout(Parallel(sp=2), {"transformer": 2}, "causal")


def test_placement_frees_the_text_encoder_after_encoding_and_builds_it_again():
    """``offload="text_encoder"``: released once the prompts are encoded, still listed, built
    again (through the platform's builder) when next used; other components stay."""
    built = []

    def build(kind: str, spec: ComponentSpec) -> torch.nn.Module:
        built.append((kind, spec.name))
        return torch.nn.Linear(3, 3)

    encoder, dit = torch.nn.Linear(3, 3), torch.nn.Linear(2, 2)
    components = Components(text_encoder=encoder, transformer=dit)
    specs = {"text_encoder": ("text_encoder", ComponentSpec("text_encoder", "x.Y", "/c")),
             "transformer": ("dit", ComponentSpec("transformer", "x.Z", "/c", dtype="bfloat16"))}
    placement = Placement(components, specs, MemoryOptions.check("text_encoder", False, False),
                          build)
    placement.apply(dit)
    assert placement.device("transformer") == torch.device("cpu")
    placement.release_encoders()
    assert components.is_released("text_encoder") and "text_encoder" in components
    assert components["transformer"] is dit and built == []
    again = components["text_encoder"]
    assert again is not encoder and built == [("text_encoder", "text_encoder")]
    assert "--vae-tiling" in placement.advice(("vae",))
    assert "--dtype bfloat16" not in placement.advice(("dit",))  # the DiT is asked in bfloat16
    kept = Placement(Components(text_encoder=encoder), specs, MemoryOptions(), build)
    kept.release_encoders()  # no offload: nothing is freed
    assert not kept.components.is_released("text_encoder")
