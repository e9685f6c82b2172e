"""Workflows: cross-model pipelines whose stages are different models.

The built-in ``t2i-i2v`` workflow runs a text-to-image model (``flux.1-t2i``), then feeds the
generated image to an image-to-video model (``wan2.1-i2v``) as its first frame. Each stage is its
own model instance with its own platform resolution (the two may run on different backends).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidInputError
from .loops import ExecutionProfile, LoopResult, StepCallback, run_loop
from .models.instance import ModelInstance
from .request import CARD_SPECIFIC, DiffusionParams, GenerationRequest, TaskType


@dataclass
class WorkflowResult:
    """The artifact of every stage, in order (``stages[-1].frames`` is the final output)."""

    stages: list[LoopResult] = field(default_factory=list)

    @property
    def frames(self):
        return self.stages[-1].frames

    @property
    def seconds(self) -> float:
        return sum(s.seconds["total"] for s in self.stages)


class Workflow:
    """A T2I → I2V workflow over two model instances.

    :param t2i: an instance of a text-to-image card (``flux.1-t2i``).
    :param i2v: an instance of an image-to-video card (``wan2.1-i2v``).
    :raises ValueError: if a stage's card does not serve the task it is used for.
    """

    name = "t2i-i2v"

    def __init__(self, t2i: ModelInstance, i2v: ModelInstance) -> None:
        if TaskType.T2I not in t2i.card.tasks:
            raise InvalidInputError(
                f"stage 1 of {self.name} must be text-to-image; got {t2i.card.name}")
        if TaskType.I2V not in i2v.card.tasks:
            raise InvalidInputError(
                f"stage 2 of {self.name} must be image-to-video; got {i2v.card.name}")
        self.t2i, self.i2v = t2i, i2v

    @staticmethod
    def stage_params(params: DiffusionParams) -> tuple[DiffusionParams, DiffusionParams]:
        """One set of parameters (a video's: size, steps, guidance, seed...) → the parameters of
        each stage: the image stage takes the same ones minus ``num_frames``, ``negative_prompt``,
        ``guidance_scale_2`` and LTX-2's video and sound parameters (a text-to-image card has none
        of them); the video stage takes them all but ``max_sequence_length``, the image model's
        text length (the video model keeps its own default). ``flowseam generate --workflow`` and
        ``flowseam serve`` both derive the stages this way."""
        video_only = dict.fromkeys(CARD_SPECIFIC)
        return (params.replace(num_frames=None, negative_prompt=None, guidance_scale_2=None,
                               **video_only),
                params.replace(max_sequence_length=None))

    def requests(self, prompt: str | list[str], t2i_params: DiffusionParams,
                 i2v_params: DiffusionParams, image: Any = None,
                 seed: int = 0) -> tuple[GenerationRequest, GenerationRequest]:
        """The two stage requests; the I2V image is filled in from stage 1 (size: stage 2's).
        One prompt has seed ``seed``; a list of B prompts seeds ``seed + k`` for row ``k``, in
        both stages."""
        seeds = [seed] if isinstance(prompt, str) else [seed + k for k in range(len(prompt))]
        first = GenerationRequest(prompt, TaskType.T2I, t2i_params, seeds=seeds)
        second = GenerationRequest(prompt, TaskType.I2V, i2v_params, image=image, seeds=list(seeds))
        return first, second

    def run(self, prompt: str | list[str], *, t2i_params: DiffusionParams | None = None,
            i2v_params: DiffusionParams | None = None, seed: int = 0,
            profile: ExecutionProfile = ExecutionProfile.SERVE, progress: bool = False,
            step_callback: StepCallback | None = None) -> WorkflowResult:
        """Generate an image from ``prompt``, then a video starting from that image.

        :param prompt: one prompt, or a list of B run as one batch per stage: sample ``k`` has
            seed ``seed + k`` in both stages and starts its video from its own image (equal to
            ``run(prompt[k], seed=seed + k)`` to float rounding).
        :param step_callback: passed to both stages' loops (``index`` and ``num_steps`` count
            each stage's own steps; see :data:`flowseam.loops.StepCallback`).

        :returns: a :class:`WorkflowResult`; ``.stages[0].frames`` is the images
            ``(B, 1, H, W, 3)``, ``.frames`` the videos ``(B, F, H, W, 3)``, both in [0, 1].
        """
        first, second = self.requests(prompt, t2i_params or DiffusionParams(),
                                      i2v_params or DiffusionParams(), seed=seed)
        image = run_loop(self.t2i, first, profile=profile, progress=progress,
                         step_callback=step_callback)
        second.image = image.frames[0, 0] if isinstance(prompt, str) else list(image.frames[:, 0])
        video = run_loop(self.i2v, second, profile=profile, progress=progress,
                         step_callback=step_callback)
        return WorkflowResult([image, video])


WORKFLOWS = {Workflow.name: Workflow}
