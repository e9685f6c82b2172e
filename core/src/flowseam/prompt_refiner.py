"""A prompt refiner: a causal language model that rewrites a user's prompt before a generator
renders it, sampled so that RL can recompute every token's log-prob exactly.

The LM is any transformers ``AutoModelForCausalLM`` with its ``AutoTokenizer``, saved with
``save_pretrained`` in one directory and built through ``platform.build_component`` (kinds
``"language_model"`` and ``"tokenizer"``: a backend may place it, ``platform.explain()`` shows
where); ``unified_rl`` trains it with the generator (:mod:`flowseam.training.unified_rl`).
Key decision: no KV cache. Each sampling step runs the LM over the whole fixed-shape token buffer
that :meth:`PromptRefiner.token_log_probs` later reads with the same forward, so on the first PPO
epoch the recomputed log-probs equal the stored ones bit for bit (C2 for tokens); a KV cache's
logits differ from a full forward in the last bits, which biases the PPO ratio. The price,
``max_new_tokens`` forwards of the whole buffer, suits short prompts and completions of tens of
tokens. :meth:`PromptRefiner.sample` states the sampling contract.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .seam.components import ComponentSpec
from .errors import FlowseamError, InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    from .seam.platform import Platform

#: the component kind of the language model (built through ``platform.build_component``)
LANGUAGE_MODEL = "language_model"
#: the refiner's settings saved next to the LM (template and sampling defaults)
REFINER_FILE = "flowseam_refiner.json"


@dataclass(frozen=True)
class RefinerSampling:
    """How the refiner samples a rewrite.

    :param temperature: ``T``: the logits are divided by it (> 0).
    :param top_k: keep the ``top_k`` most likely tokens (0: no top-k truncation).
    :param top_p: nucleus sampling: keep the most likely tokens whose probability adds up to
        ``top_p`` (1.0: no truncation). Truncation changes what is sampled, never the stored
        log-prob (that is of the untruncated ``log_softmax(logits / T)``).
    :param max_new_tokens: the most tokens a rewrite has (EOS included).
    :raises FlowseamError: naming the bad field and what is allowed.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 24

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str):
            return FlowseamError(f"[lm_sampling] {name}={getattr(self, name)!r}: {allowed}")

        number = (int, float)
        if not isinstance(self.temperature, number) or isinstance(self.temperature, bool) \
                or not self.temperature > 0:
            raise bad("temperature", "must be a number > 0")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0: no top-k truncation)")
        if not isinstance(self.top_p, number) or isinstance(self.top_p, bool) \
                or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1] (1: no nucleus truncation)")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be an integer >= 1")


@dataclass
class RefinerRollout:
    """What sampling a batch of rewrites captures: the token buffer the LM read and the
    behaviour log-prob of every sampled token.

    :ivar prompts: the ``B`` user prompts.
    :ivar rewrites: the ``B`` decoded completions (special tokens skipped, stripped).
    :ivar input_ids: ``(B, L + G)`` int64: the left-padded LM inputs (``L`` tokens), then the
        ``G = max_new_tokens`` completion slots (pad after a row's EOS).
    :ivar attention_mask: ``(B, L + G)`` int64: 0 on the left padding, 1 elsewhere.
    :ivar position_ids: ``(B, L + G)`` int64: ``cumsum(attention_mask) - 1`` clamped at 0.
    :ivar completion_mask: ``(B, G)`` bool: the slots holding a sampled token (EOS included).
    :ivar log_probs: ``(B, G)`` float32: behaviour log-prob of each sampled token (0 elsewhere).
    :ivar seeds: the per-row sampling seeds.
    :ivar sampling: the settings it was sampled with.
    """

    prompts: list[str]
    rewrites: list[str]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    completion_mask: torch.Tensor
    log_probs: torch.Tensor
    seeds: list[int]
    sampling: RefinerSampling

    @property
    def prompt_length(self) -> int:
        """``L``: the padded length of the LM inputs."""
        return self.input_ids.shape[1] - self.completion_mask.shape[1]

    @property
    def completion_ids(self) -> torch.Tensor:
        """``(B, G)`` int64: the completion slots of :attr:`input_ids`."""
        return self.input_ids[:, self.prompt_length:]


class PromptRefiner:
    """A causal LM that rewrites prompts (the sampling contract: :meth:`sample`).

    Built with :meth:`load`. It is also what a :class:`~flowseam.training.weight_sync.
    WeightSyncPlan` hands trained weights to: ``components["lm"]`` is the LM, ``versions`` its
    weights version.

    :param lm: a transformers causal LM (in eval mode: no dropout, in rollouts and updates alike).
    :param tokenizer: its tokenizer; it needs an EOS token (a missing pad token becomes EOS).
    :param template: the LM input, with ``{request}`` where the user's prompt goes.
    :param sampling: the default :class:`RefinerSampling`.
    :raises FlowseamError: for a template without ``{request}`` or a tokenizer without EOS.
    """

    COMPONENT = "lm"

    def __init__(self, lm: torch.nn.Module, tokenizer: Any, template: str = "{request}",
                 sampling: RefinerSampling | None = None, path: Path | None = None,
                 platform: "Platform | None" = None) -> None:
        check_template(template)
        if tokenizer.eos_token_id is None:
            raise FlowseamError(f"the refiner's tokenizer ({type(tokenizer).__name__}) has no EOS "
                                "token: a rewrite could never end; set eos_token in its config")
        if tokenizer.pad_token_id is None:  # GPT-2's case: pad with EOS (masked out anyway)
            tokenizer.pad_token = tokenizer.eos_token
        self.components: dict[str, Any] = {self.COMPONENT: lm.eval(), "tokenizer": tokenizer}
        self.versions = {self.COMPONENT: 0}
        self.template = template
        self.sampling = sampling or RefinerSampling()
        self.path = path
        self.platform = platform

    # -- loading and saving ----------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, platform: "Platform | None" = None, template: str | None = None,
             sampling: RefinerSampling | None = None) -> "PromptRefiner":
        """Load the LM and tokenizer saved in ``path`` through ``platform`` (default
        ``Platform.detect()``). ``template`` and ``sampling`` default to the directory's
        ``flowseam_refiner.json`` (written by :meth:`save`), else ``"{request}"`` and
        :class:`RefinerSampling`'s defaults.

        :raises FlowseamError: for a missing directory or one without a ``config.json``.
        """
        from .seam.platform import Platform

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FlowseamError(f"lm_model={str(path)!r} is not a transformers model directory "
                                "(no config.json): save one with save_pretrained")
        saved: dict[str, Any] = {}
        if (path / REFINER_FILE).is_file():
            saved = json.loads((path / REFINER_FILE).read_text())
        platform = platform or Platform.detect()
        lm = platform.build_component(LANGUAGE_MODEL, ComponentSpec(
            cls.COMPONENT, "transformers.AutoModelForCausalLM", path=str(path)))
        tokenizer = platform.build_component("tokenizer", ComponentSpec(
            "tokenizer", "transformers.AutoTokenizer", path=str(path)))
        return cls(lm, tokenizer, template if template is not None else saved.get("template", "{request}"),
                   sampling or RefinerSampling(**saved.get("sampling", {})), path, platform)

    def save(self, path: str | Path) -> Path:
        """Write the LM and tokenizer (``save_pretrained``) and ``flowseam_refiner.json``
        (template, sampling) into ``path``, through a temporary sibling directory renamed into
        place: :meth:`load` reads it back."""
        import os
        import shutil
        import tempfile

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            self.lm.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            (tmp / REFINER_FILE).write_text(json.dumps(
                {"template": self.template, "sampling": asdict(self.sampling)}, indent=1) + "\n")
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    @property
    def lm(self) -> torch.nn.Module:
        return self.components[self.COMPONENT]

    @property
    def tokenizer(self) -> Any:
        return self.components["tokenizer"]

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device

    def bump_version(self, name: str) -> int:
        """Mark ``name``'s weights as changed (a WeightSyncPlan calls it)."""
        self.versions[name] = self.versions.get(name, 0) + 1
        return self.versions[name]

    def __repr__(self) -> str:
        return f"<PromptRefiner {type(self.lm).__name__} template={self.template!r}>"

    # -- sampling --------------------------------------------------------------------------
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The left-padded LM inputs of ``prompts``: ``(input_ids, attention_mask)``, each
        ``(B, L)`` int64 (no special tokens added, no ``token_type_ids``).

        :raises FlowseamError: for a prompt that tokenizes to nothing.
        """
        texts = [self.template.format(request=p) for p in prompts]
        enc = self.tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left",
                             return_tensors="pt", return_token_type_ids=False)
        empty = [p for p, m in zip(prompts, enc["attention_mask"]) if not int(m.sum())]
        if empty:
            raise FlowseamError(f"prompt {empty[0]!r} gives the refiner no input tokens")
        return enc["input_ids"].long(), enc["attention_mask"].long()

    @torch.no_grad()
    def sample(self, prompts: list[str], seeds: list[int],
               sampling: RefinerSampling | None = None) -> RefinerRollout:
        """Sample one rewrite per prompt (row ``b`` from ``torch.Generator().manual_seed(seeds[b])``)
        and capture the behaviour log-prob of every sampled token.

        The contract, which :meth:`token_log_probs` reads back on the same token buffer:

        * the LM input is ``template.format(request=prompt)``, tokenized without special tokens
          added and **left-padded** to the batch's longest (``attention_mask`` 0 on the padding);
        * ``max_new_tokens`` completion slots follow; ``position_ids = cumsum(attention_mask) -
          1`` (clamped at 0: the padding takes position 0), as transformers' ``generate``
          computes them; ``token_type_ids`` are never passed (a GPT-2 would add their embedding);
        * the token at slot ``t`` is drawn from ``softmax(warp(logits / T))`` (``warp``:
          transformers' ``TopKLogitsWarper`` then ``TopPLogitsWarper``), each row with its own
          ``torch.Generator``; its **behaviour log-prob** is ``log_softmax(logits / T)[token]``,
          before the top-k/top-p truncation, and is stored in the rollout;
        * a row ends at the tokenizer's EOS (which belongs to the completion); later slots hold
          the pad token and are masked out;
        * each step runs the LM over the whole buffer (no KV cache: module docstring); the logits
          of slot ``t`` depend only on the tokens before it (causal attention).

        :param prompts: ``B`` user prompts.
        :param seeds: ``B`` seeds.
        :raises ValueError: if ``seeds`` does not have one seed per prompt.
        """
        from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

        if len(seeds) != len(prompts):
            raise InvalidInputError(
                f"seeds has {len(seeds)} entries for {len(prompts)} prompts; give one each")
        s = sampling or self.sampling
        tok = self.tokenizer
        ids, mask = self.encode(prompts)
        B, L, G = ids.shape[0], ids.shape[1], s.max_new_tokens
        device = self.device
        input_ids = torch.cat([ids, torch.full((B, G), tok.pad_token_id, dtype=torch.long)], 1).to(device)
        attention_mask = torch.cat([mask, torch.ones(B, G, dtype=torch.long)], 1).to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        completion_mask = torch.zeros(B, G, dtype=torch.bool)
        log_probs = torch.zeros(B, G, dtype=torch.float32)
        warpers = ([TopKLogitsWarper(s.top_k)] if s.top_k else []) + \
                  ([TopPLogitsWarper(s.top_p)] if s.top_p < 1.0 else [])
        generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
        active = torch.ones(B, dtype=torch.bool)
        for t in range(G):
            logits = self.lm(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids).logits[:, L + t - 1].float() / s.temperature
            logp = torch.log_softmax(logits, dim=-1).cpu()
            warped = logits
            for warp in warpers:
                warped = warp(input_ids[:, :L + t], warped)
            probs = torch.softmax(warped, dim=-1).cpu()
            for b in torch.nonzero(active).flatten().tolist():
                token = int(torch.multinomial(probs[b], 1, generator=generators[b]))
                input_ids[b, L + t] = token
                completion_mask[b, t] = True
                log_probs[b, t] = logp[b, token]
                if token == tok.eos_token_id:
                    active[b] = False
            if not active.any():
                break
        rewrites = [tok.decode(row[m.to(row.device)], skip_special_tokens=True).strip()
                    for row, m in zip(input_ids[:, L:], completion_mask)]
        return RefinerRollout(list(prompts), rewrites, input_ids, attention_mask, position_ids,
                              completion_mask, log_probs, [int(x) for x in seeds], s)

    def token_log_probs(self, rollout: RefinerRollout, lm: torch.nn.Module | None = None) -> torch.Tensor:
        """``log_softmax(logits / T)`` of every completion slot's token, recomputed by ``lm``
        (default the refiner's; a trainer's copy, with gradients if enabled) on the rollout's
        own buffer, mask and position ids: ``(B, G)`` float32. With the rollout's weights it
        equals ``rollout.log_probs`` on the completion mask bit for bit."""
        lm = self.lm if lm is None else lm
        L = rollout.prompt_length
        logits = lm(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask,
                    position_ids=rollout.position_ids).logits[:, L - 1:-1].float()
        logp = torch.log_softmax(logits / rollout.sampling.temperature, dim=-1)
        return logp.gather(-1, rollout.completion_ids[..., None].to(logp.device))[..., 0].cpu()

    def refine(self, prompts: str | list[str], seeds: list[int] | None = None,
               sampling: RefinerSampling | None = None) -> list[str]:
        """Rewrite ``prompts`` (seeds default ``0, 1, ...``): the decoded rewrites."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        return self.sample(prompts, seeds if seeds is not None else list(range(len(prompts))),
                           sampling).rewrites


def check_template(template: Any) -> None:
    """:raises FlowseamError: unless ``template`` is a string with one ``{request}`` field."""
    import string

    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None] \
            if isinstance(template, str) else None
    except ValueError:
        fields = None
    if fields != ["request"]:
        raise FlowseamError(f"lm_template={template!r} must be a string with exactly one "
                            "'{request}' field (where the user's prompt goes), e.g. '{request} =>'")


__all__ = ["LANGUAGE_MODEL", "PromptRefiner", "RefinerRollout", "RefinerSampling", "check_template"]
