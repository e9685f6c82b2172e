"""The rewards flowseam ships, and how a training method builds and checks the one its config names.

* :mod:`flowseam.rewards.spec`: a config's ``reward`` built into a checked ``Reward`` (weighted
  sums, timeouts, faults); :mod:`flowseam.rewards.simple`: the toy rewards (``brightness``, ...).
* The real reward models, a plugin like any third party's (:mod:`flowseam.rewards.plugin`, core's
  entry point ``rewards``): ``ocr`` (:mod:`flowseam.rewards.ocr`, extra ``flowseam[ocr]``) and
  ``clip_score``, ``pickscore``, ``aesthetic`` (:mod:`flowseam.rewards.clip`); each model loads
  only when its reward is built.
* A reward server and its client (:mod:`flowseam.rewards.reward_server`,
  :mod:`flowseam.rewards.remote`, in the wire format of :mod:`flowseam.rewards.wire`):
  ``flowseam reward-serve --reward NAME`` and ``reward = "http://127.0.0.1:PORT/NAME"``.

Every reward follows :class:`flowseam.seam.RewardFunction`; docs/rewards.md is the users' guide.
"""
