"""The digits world's prompt refiner: a tiny language model that maps a user's loose request
(``"draw me a 7 sliding to the left"``) to the prompt the demo's generators were trained on
(``"a handwritten digit seven moving left"``) — the LM side of the ``unified_rl`` demo
(``bench/unified_rl_control.py``).

The requests come from a small grammar (:func:`requests`); a fixed seeded fifth of them is held
out (:func:`request_split`): neither pretraining nor RL ever sees those, the evaluation uses only
them. The refiner is a word-level GPT-2 trained from scratch (:func:`build_refiner`) on
deliberately noisy (request, prompt) pairs (:func:`noisy_pairs`), so that it samples the right
prompt only part of the time: the headroom RL with the final-video reward is meant to close.
"""

from __future__ import annotations

import random
from pathlib import Path

from .data import DIRECTIONS, NUMBER_WORDS, i2v_prompt, parse_prompt
from ..errors import InvalidInputError

#: loose request phrasings (``{d}``: the digit, ``{dir}``: the direction)
REQUEST_TEMPLATES = (
    "draw me a {d} sliding to the {dir}",
    "a {d} that moves {dir}",
    "show the number {d} going {dir}",
    "{d} heading {dir} please",
    "i want a {d} drifting {dir}",
    "make the {d} travel {dir}",
)
#: the LM's input (the refiner's template)
TEMPLATE = "{request} =>"
#: what fraction of the requests is held out (seeded, fixed)
HELD_OUT_FRACTION = 0.2
SPLIT_SEED = 0
SPECIAL = ("<pad>", "<eos>", "<unk>", "=>")


def requests() -> list[tuple[str, int, str]]:
    """Every request of the grammar: ``(request, digit, direction)``, in a fixed order.

    :data:`REQUEST_TEMPLATES` × the digit as a numeral or a number word × the four directions
    (480 requests)."""
    out = []
    for template in REQUEST_TEMPLATES:
        for digit in range(10):
            for form in (str(digit), NUMBER_WORDS[digit]):
                for direction in sorted(DIRECTIONS):
                    out.append((template.format(d=form, dir=direction), digit, direction))
    return out


def request_split() -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]]]:
    """``(train, held_out)``: the requests split once with a fixed seed."""
    pool = requests()
    random.Random(SPLIT_SEED).shuffle(pool)
    n = round(len(pool) * HELD_OUT_FRACTION)
    return pool[n:], pool[:n]


def vocabulary() -> list[str]:
    """The tokenizer's words: the specials, then every word of the requests and prompts."""
    words = {w for r, d, direction in requests() for w in (r + " " + i2v_prompt(d, direction)).split()}
    return list(SPECIAL) + sorted(words)


def tokenizer():
    """The word-level tokenizer: ``tokenizers``' ``WordLevel`` with whitespace splitting over
    :func:`vocabulary` (the grammar's words, ``<pad>``, ``<eos>``, ``<unk>`` and the separator
    ``=>``), wrapped as a transformers ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", model_max_length=32)


def noisy_pairs(n: int, noise: float, seed: int) -> list[tuple[str, str]]:
    """``n`` (request, target prompt) pairs drawn from the training requests; with probability
    ``noise`` the target's digit is a random one, and independently its direction. A refiner
    trained on them samples the right prompt in about ``(1 - 0.9 noise)(1 - 0.75 noise)`` of its
    rewrites (a random digit is right one time in ten, a random direction one in four)."""
    train, _ = request_split()
    rng = random.Random(seed)
    names = sorted(DIRECTIONS)
    out = []
    for _ in range(n):
        request, digit, direction = rng.choice(train)
        if rng.random() < noise:
            digit = rng.randrange(10)
        if rng.random() < noise:
            direction = rng.choice(names)
        out.append((request, i2v_prompt(digit, direction)))
    return out


def build_refiner(path: str | Path, steps: int = 400, noise: float = 0.5, seed: int = 0,
                  lr: float = 3e-3, batch_size: int = 32, verbose: bool = False) -> Path:
    """Pretrain the digits refiner and save it, with its template and sampling settings, into
    ``path`` (``flowseam.prompt_refiner.PromptRefiner.load`` reads it).

    The model is a GPT-2 (``GPT2LMHeadModel``: 2 layers, 2 heads, width 64, 32 positions, no
    dropout) trained from scratch with the causal-LM loss by transformers' ``Trainer`` on
    ``"<request> => <prompt><eos>"`` texts of :func:`noisy_pairs`, with :func:`tokenizer`.

    :param steps: optimizer steps of the causal-LM loss (AdamW, linear decay, batch
        ``batch_size``).
    :param noise: the label noise of the supervision, in [0, 1].
    :raises ValueError: for ``noise`` outside [0, 1].
    """
    import torch
    from transformers import (DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel, Trainer,
                              TrainingArguments)
    from transformers.trainer_callback import PrinterCallback

    from ..prompt_refiner import PromptRefiner, RefinerSampling

    if not 0.0 <= noise <= 1.0:
        raise InvalidInputError(f"noise={noise} must be in [0, 1]")
    tok = tokenizer()
    pairs = noisy_pairs(steps * batch_size, noise, seed)
    texts = [f"{TEMPLATE.format(request=r)} {p} {tok.eos_token}" for r, p in pairs]
    data = [{"input_ids": ids} for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    config = GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
        path = Path(path)
        args = TrainingArguments(
            output_dir=str(path.parent / f".{path.name}.trainer"), max_steps=steps,
            per_device_train_batch_size=batch_size, learning_rate=lr, weight_decay=0.0,
            lr_scheduler_type="linear", warmup_steps=steps // 20, seed=seed, data_seed=seed,
            use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
            disable_tqdm=not verbose, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=data,
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
        if not verbose:  # with the bar off, transformers prints the final log line instead
            trainer.remove_callback(PrinterCallback)
        trainer.train()
    import shutil

    shutil.rmtree(path.parent / f".{path.name}.trainer", ignore_errors=True)
    refiner = PromptRefiner(model.eval(), tok, TEMPLATE, RefinerSampling(max_new_tokens=8))
    return refiner.save(path)


def rewrite_accuracy(refiner, held: list[tuple[str, int, str]], seeds: list[int]) -> dict[str, float]:
    """How often the refiner's sampled rewrites of ``held`` requests name the requested digit,
    the requested direction, and both (parsed with :func:`~flowseam.demo.data.parse_prompt`);
    one rewrite per (request, seed)."""
    prompts = [r for r, _, _ in held for _ in seeds]
    rewrites = refiner.sample(prompts, [s for _ in held for s in seeds]).rewrites
    truth = [(d, direction) for _, d, direction in held for _ in seeds]
    parsed = [parse_prompt(r) for r in rewrites]
    n = len(truth)
    return {"digit": sum(p[0] == t[0] for p, t in zip(parsed, truth)) / n,
            "direction": sum(p[1] == t[1] for p, t in zip(parsed, truth)) / n,
            "both": sum(p == t for p, t in zip(parsed, truth)) / n}
