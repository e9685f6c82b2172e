"""The real reward models flowseam ships, as a plugin like any third party's.

Registered through the ``flowseam_rewards`` hook by :mod:`flowseam.rewards.plugin` (core's entry
point ``rewards`` in the ``flowseam.plugins`` group); importing that module is cheap, each reward's
model loads when the reward is built. Every reward follows the contract of
:mod:`flowseam.rewards.spec`: ``reward(prompts: list[str], outputs: np.ndarray (B, F, H, W, 3)
float in [0, 1]) -> torch.Tensor (B,) float32``; a video is scored per frame and averaged.

* ``ocr`` (:mod:`flowseam.rewards.ocr`): Flow-GRPO's text-rendering reward, read by PaddleOCR's
  PP-OCRv4 recognizer through ``rapidocr-onnxruntime`` (extra ``flowseam[ocr]``).
* ``clip_score``, ``pickscore``, ``aesthetic`` (:mod:`flowseam.rewards.clip`): CLIP-family scorers
  loaded from a local directory in the model's published layout (transformers' ``CLIPModel``).
* a reward server and its client (:mod:`flowseam.rewards.reward_server`, :mod:`flowseam.rewards.remote`):
  ``flowseam reward-serve --reward NAME`` and ``reward = "http://127.0.0.1:PORT/NAME"`` in a config.
"""
