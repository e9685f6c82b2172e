"""Build the demo's models from their recipes, and find them again without retraining.

A recipe (``recipes/<name>.toml``, read with :func:`flowseam.training.config.load_config`; the
worlds and their recipes: :data:`WORLDS`) names a card, the sizes of its real diffusers
architecture, how its VAE is trained and the ``finetune`` config of its transformer.
:func:`build_model` assembles the card's real pipeline with random weights
(:func:`flowseam.testing.tiny.write_tiny_checkpoint`), trains the VAE and then the transformer
through the public API, checks the result (:mod:`flowseam.demo.evaluate`) and records it in the
cache's ``manifest.json`` under the SHA-256 of the recipe's settings. :func:`ensure_models` finds
each model by that hash (the cache, then the weights shipped in the package, else it builds);
:func:`ship` copies a build into the shipped weights. The held-out split of
:mod:`flowseam.demo.data` is never used here. For users: docs/demo.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..errors import FlowseamError, InvalidInputError

#: the demo's worlds and their recipes (``flowseam demo --world NAME``; ``digits`` is the default)
WORLDS = {"digits": ("digits-t2i", "digits-i2v"), "text": ("text-t2i",)}
DEFAULT_WORLD = "digits"
RECIPE_NAMES = WORLDS[DEFAULT_WORLD]
MANIFEST = "manifest.json"
RECIPE_COPY = "flowseam_recipe.toml"  # the recipe, saved inside each model directory
UNHASHED = ("serve", "eval")  # recipe tables that do not change the weights
#: what a ``quick`` build keeps of a recipe (for smoke tests: seconds, not a usable model)
QUICK = dict(data_limit=16, vae_steps=2, finetune_steps=2, eval_samples=1)


@dataclass(frozen=True)
class Recipe:
    """One recipe file: its name (the file stem), text and parsed config."""

    name: str
    path: Path
    text: str
    config: dict[str, Any]

    def key(self, quick: bool = False) -> str:
        """What a cached build must match: the SHA-256 of the settings that make the weights
        (the parsed config as canonical JSON, without ``[serve]`` and ``[eval]``, so comments,
        formatting and sampling settings do not count), ``+quick`` for a quick build."""
        weights = {k: v for k, v in self.config.items() if k not in UNHASHED}
        canonical = json.dumps(weights, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        return f"{digest}+quick" if quick else digest

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Recipe":
        """:raises FlowseamError: for a missing or unparsable file (from ``load_config``)."""
        from ..training.config import load_config

        path = Path(path)
        return cls(path.stem, path, path.read_text() if path.is_file() else "", load_config(path))


def shipped_dir() -> Path:
    """The directory of the weights shipped inside the package (may be absent)."""
    return Path(__file__).resolve().parent / "weights"


def default_cache_dir() -> Path:
    """``$FLOWSEAM_DEMO_CACHE``, else ``outputs/models`` under the current directory."""
    return Path(os.environ.get("FLOWSEAM_DEMO_CACHE") or Path.cwd() / "outputs" / "models")


def check_world(world: str) -> tuple[str, ...]:
    """The recipe names of ``world``.

    :raises InvalidInputError: for a world the demo does not have, naming the allowed ones.
    """
    if world not in WORLDS:
        raise InvalidInputError(f"world={world!r} is not a demo world; allowed: "
                                f"{', '.join(sorted(WORLDS))}")
    return WORLDS[world]


def default_recipe_dir(world: str = DEFAULT_WORLD) -> Path:
    """``recipes/`` of the checkout this package runs from, else the recipe copies shipped
    with the weights (so an installed package can still check and rebuild them), for the
    recipes of ``world`` (:data:`WORLDS`).

    :raises FlowseamError: if neither exists, saying how to pass ``--recipes``.
    """
    names = check_world(world)
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "recipes"
        if all((candidate / f"{n}.toml").is_file() for n in names):
            return candidate
    shipped = shipped_dir()
    if all((shipped / n / RECIPE_COPY).is_file() for n in names):
        return shipped
    raise FlowseamError("cannot find the demo recipes ("
                        + " and ".join(f"recipes/{n}.toml" for n in names)
                        + "); pass --recipes DIR")


def read_recipes(directory: str | os.PathLike | None = None,
                 world: str = DEFAULT_WORLD) -> dict[str, Recipe]:
    """Every recipe of ``world`` in ``directory`` (``NAME.toml`` or
    ``NAME/flowseam_recipe.toml``; default :func:`default_recipe_dir`)."""
    names = check_world(world)
    directory = Path(directory) if directory is not None else default_recipe_dir(world)
    out = {}
    for name in names:
        path = directory / f"{name}.toml"
        if not path.is_file():
            path = directory / name / RECIPE_COPY
        if not path.is_file():
            raise FlowseamError(f"recipe {name!r} not found in {directory} (expected {name}.toml)")
        recipe = Recipe.read(path)
        out[name] = Recipe(name, recipe.path, recipe.text, recipe.config)
    return out


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}  # a corrupt manifest is a cache miss, never an error


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    from ..media import atomic_path

    with atomic_path(directory / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def lookup(directory: Path, recipe: Recipe, quick: bool = False) -> Path | None:
    """The model directory built from exactly this recipe in ``directory``, or None."""
    entry = read_manifest(directory).get(recipe.name)
    model = directory / recipe.name
    matches = entry and entry.get("recipe_sha256") == recipe.key(quick)
    return model if matches and (model / "model_index.json").is_file() else None


def ensure_models(cache_dir: str | os.PathLike | None = None,
                  recipes: dict[str, Recipe] | None = None, *, rebuild: bool = False,
                  quick: bool = False, use_shipped: bool = True, progress: bool = True,
                  log: Callable[[str], None] = print) -> dict[str, Path]:
    """The directory of every demo model, building only what no cache holds.

    :param cache_dir: where built models go (default :func:`default_cache_dir`).
    :param rebuild: build even when a matching model exists.
    :param quick: build with :data:`QUICK` sizes (smoke tests); never mixed up with a full
        build (its manifest key differs).
    :param use_shipped: look in the package's shipped weights too.
    :returns: recipe name → model directory.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    recipes = recipes if recipes is not None else read_recipes()
    out = {}
    for name, recipe in recipes.items():
        found = None
        if not rebuild:
            found = lookup(cache, recipe, quick)
            if found is None and use_shipped and not quick:
                found = lookup(shipped_dir(), recipe)
        if found is not None:
            log(f"{name}: using {found} (recipe sha256 {recipe.key(quick)[:12]} matches)")
            if found.parent == cache:  # [serve] is not hashed: it may have changed since the build
                write_serve_defaults(found, recipe)
            out[name] = found
            continue
        log(f"{name}: building from {recipe.path}{' (quick)' if quick else ''} into {cache / name}")
        out[name] = build_model(recipe, cache, quick=quick, progress=progress, log=log)
    return out


def write_serve_defaults(model_dir: Path, recipe: Recipe) -> None:
    """Write the recipe's ``[serve]`` table as the model's own serving defaults
    (``flowseam.json``, :mod:`flowseam.checkpoint_defaults`), so that ``flowseam generate`` samples it as the
    demo does; unchanged files are left alone."""
    from ..checkpoint_defaults import (
        FILENAME, check_checkpoint_defaults, read_checkpoint_defaults, write_checkpoint_defaults,
    )

    serve = dict(recipe.config.get("serve", {}))
    wanted = check_checkpoint_defaults({"serve": serve}, recipe.path)["serve"]
    if (model_dir / FILENAME).is_file() and read_checkpoint_defaults(model_dir) == wanted:
        return
    write_checkpoint_defaults(model_dir, serve)


def demo_models(cache_dir: str | os.PathLike | None = None,
                recipes: dict[str, Recipe] | None = None) -> list[dict[str, Any]]:
    """Where each demo model is installed: one row per recipe (default: every world's, in
    :data:`WORLDS` order) and place (the cache directory, then the weights shipped in the
    package), with its card, whether it matches the current recipe, and its serving defaults. A
    place that holds no model of the recipe is left out.

    :returns: ``[{"name", "path", "source" ("cache" | "shipped"), "card", "matches_recipe",
        "serve"}]``, in the order :func:`ensure_models` looks.
    """
    from ..checkpoint_defaults import read_checkpoint_defaults

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if recipes is None:
        recipes = {name: r for world in WORLDS for name, r in read_recipes(world=world).items()}
    rows = []
    for name, recipe in recipes.items():
        for source, place in (("cache", cache), ("shipped", shipped_dir())):
            model = place / name
            if not (model / "model_index.json").is_file():
                continue
            entry = read_manifest(place).get(name, {})
            rows.append({"name": name, "path": str(model), "source": source,
                         "card": entry.get("card") or recipe.config.get("card"),
                         "matches_recipe": lookup(place, recipe) is not None,
                         "serve": read_checkpoint_defaults(model)})
    return rows


# -- building -----------------------------------------------------------------------------------
def build_model(recipe: Recipe, cache_dir: str | os.PathLike, *, quick: bool = False,
                progress: bool = True, log: Callable[[str], None] = print) -> Path:
    """Build ``recipe`` into ``cache_dir/<name>`` (replaced atomically) and record it in the
    cache's manifest. Returns the model directory.

    The stages, on the ``cpu`` backend in float32: (1) the card's pipeline with random weights
    (``write_tiny_checkpoint``: the real ``FluxPipeline`` / ``WanImageToVideoPipeline`` classes,
    saved with ``save_pretrained``); (2) its VAE trained on the recipe's data with the latent
    statistics the pipeline normalises with (:func:`train_and_save_vae`); (3) the transformer
    trained with the ``finetune`` method (flow matching); (4) the diffusers-format directory
    (loadable with ``flowseam.load`` and ``DiffusionPipeline.from_pretrained``) checked and
    recorded. The text and image encoders stay as ``write_tiny_checkpoint`` initialised them
    (frozen, random, seeded): distinct prompts still give distinct embeddings, which is all the
    DiT needs to learn.

    :raises FlowseamError: for a recipe naming an unknown card or data kind.
    """
    from ..seam.platform import Platform
    from ..testing.tiny import write_tiny_checkpoint
    from ..training.finetune import Finetune
    from .evaluate import evaluate_model

    cfg = recipe.config
    card = cfg.get("card")
    if card not in ("flux.1-t2i", "wan2.1-i2v"):
        raise FlowseamError(f"recipe {recipe.path}: card={card!r}; the demo builds 'flux.1-t2i' "
                            "or 'wan2.1-i2v'")
    cache = Path(cache_dir)
    work = cache / f".{recipe.name}.build"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    seed = int(cfg.get("seed", 0))
    dataset = recipe_dataset(recipe, quick)
    kind = cfg.get("data", {}).get("kind")
    log(f"{recipe.name}: {len(dataset)} examples ("
        + ("rendered text" if kind == "text" else "the digits' generator split") + ")")

    # 1. The real pipeline classes with random weights, saved with save_pretrained.
    pipe_dir = write_tiny_checkpoint(card, work / "pipeline", seed=seed,
                                     **{k: dict(v) for k, v in cfg.get("architecture", {}).items()})

    # 2. The VAE, trained on the data, with the latent statistics the pipeline normalises with.
    t0 = time.perf_counter()
    vae_metrics = train_and_save_vae(card, pipe_dir / "vae", dataset, dict(cfg.get("vae", {})),
                                     seed=seed, quick=quick, progress=progress)
    vae_seconds = time.perf_counter() - t0
    log(f"{recipe.name}: VAE trained in {vae_seconds:.0f} s (reconstruction MSE "
        f"{vae_metrics['recon_mse']:.4f} in [-1, 1] units)")

    # 3. The transformer, with the finetune method.
    t0 = time.perf_counter()
    model = _load(pipe_dir, Platform("cpu"))
    ft_cfg = dict(cfg.get("finetune", {}))
    ft_cfg["seed"] = ft_cfg.get("seed", seed)
    ft_cfg["output_dir"] = str(work / "finetune")
    if quick:
        ft_cfg["steps"] = min(ft_cfg.get("steps", 1), QUICK["finetune_steps"])
        ft_cfg["batch_size"] = min(ft_cfg.get("batch_size", 4), 4)
    ft = Finetune(ft_cfg, model=model, dataset=dataset)
    summary = ft.run(progress=progress)
    ft_seconds = time.perf_counter() - t0
    losses = [r["loss"] for r in summary["records"]]
    log(f"{recipe.name}: transformer trained in {ft_seconds:.0f} s ({len(losses)} steps, loss "
        f"{np.mean(losses[:10]):.3f} → {np.mean(losses[-10:]):.3f})")

    # 4. The run saved it in diffusers format; add the recipe and its serving defaults, check,
    # and record.
    final = Path(summary["model"])
    shutil.copyfile(recipe.path, final / RECIPE_COPY)
    write_serve_defaults(final, recipe)
    metrics = evaluate_model(recipe, _load(final, Platform("cpu")),
                             samples=QUICK["eval_samples"] if quick else None)
    log(f"{recipe.name}: {metrics['summary']}")
    target = cache / recipe.name
    if target.exists():
        shutil.rmtree(target)
    os.replace(final, target)
    manifest = read_manifest(cache)
    manifest[recipe.name] = {
        "recipe": recipe.path.name, "recipe_sha256": recipe.key(quick), "quick": quick,
        "card": card, "built_seconds": round(time.perf_counter() - started, 1),
        "vae_seconds": round(vae_seconds, 1), "finetune_seconds": round(ft_seconds, 1),
        "examples": len(dataset), "vae": vae_metrics,
        "finetune_loss_first10": float(np.mean(losses[:10])) if losses else None,
        "finetune_loss_last10": float(np.mean(losses[-10:])) if losses else None,
        "eval": {k: v for k, v in metrics.items() if k != "summary"},
        "eval_serve": dict(cfg.get("serve", {})),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    write_manifest(cache, manifest)
    shutil.rmtree(work, ignore_errors=True)
    return target


def _load(path: Path, platform):
    from ..quiet import quiet_libraries
    from ..loading import load

    quiet_libraries()
    return load(path, platform=platform)


def recipe_dataset(recipe: Recipe, quick: bool = False) -> list[tuple[str, np.ndarray]]:
    """The recipe's ``[data]``: ``kind = "t2i"`` (digit images) or ``"i2v"`` (moving digits),
    from the generator split only, or ``"text"`` (rendered strings,
    :func:`flowseam.demo.text.text_dataset`)."""
    from .data import i2v_dataset, t2i_dataset
    from .text import text_dataset

    data = dict(recipe.config.get("data", {}))
    kind = data.pop("kind", None)
    limit = data.pop("limit", None)
    if quick:
        limit = QUICK["data_limit"]
    if kind == "t2i":
        return t2i_dataset(limit=limit, **data)
    if kind == "i2v":
        return i2v_dataset(limit=limit, **data)
    if kind == "text":
        return text_dataset(limit=limit, **data)
    raise FlowseamError(f"recipe {recipe.path}: [data] kind={kind!r}; allowed: 't2i', 'i2v', "
                        "'text'")


def ship(name: str, cache_dir: str | os.PathLike | None = None,
         target: str | os.PathLike | None = None) -> Path:
    """Copy the model ``name`` built into ``cache_dir`` (default :func:`default_cache_dir`)
    into the shipped weights (``target``, default :func:`shipped_dir`), replacing any older
    copy, and record its cache manifest entry in the shipped ``manifest.json``. Returns the
    shipped directory.

    :raises FlowseamError: if the cache holds no full (non-quick) build of ``name``.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = Path(target) if target is not None else shipped_dir()
    entry = read_manifest(cache).get(name)
    if not entry or entry.get("quick") or not (cache / name / "model_index.json").is_file():
        raise FlowseamError(f"{cache} holds no full build of {name!r} to ship (build it with "
                            f"flowseam demo --build-only --rebuild --cache {cache})")
    tmp = target / f".{name}.ship"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(cache / name, tmp)
    if (target / name).exists():
        shutil.rmtree(target / name)
    os.replace(tmp, target / name)
    manifest = read_manifest(target)
    manifest[name] = entry
    write_manifest(target, manifest)
    return target / name


# -- the VAE --------------------------------------------------------------------------------------
VAE_DEFAULTS = dict(steps=300, batch_size=32, lr=2e-3, weight_decay=0.0, kl_weight=1e-4,
                    warmup_fraction=0.1)


def train_and_save_vae(card: str, folder: Path, dataset: list[tuple[str, np.ndarray]],
                       config: dict[str, Any], seed: int = 0, quick: bool = False,
                       progress: bool = True) -> dict[str, float]:
    """Load the VAE saved in ``folder``, train it on the dataset's frames, set its latent
    statistics, and save it back there (``save_pretrained``). Returns its metrics."""
    import diffusers

    from ..training.config import section

    cfg = section({"vae": config}, "vae", VAE_DEFAULTS)
    if quick:
        cfg["steps"] = min(cfg["steps"], QUICK["vae_steps"])
    cls = diffusers.AutoencoderKL if card == "flux.1-t2i" else diffusers.AutoencoderKLWan
    vae = cls.from_pretrained(folder)
    # (N, F, H, W, 3) in [0, 1] → pixels (N, 3, F, H, W) in [-1, 1]; images drop the F axis.
    frames = np.stack([f for _, f in dataset])
    pixels = torch.from_numpy(frames).permute(0, 4, 1, 2, 3) * 2.0 - 1.0
    if card == "flux.1-t2i":
        pixels = pixels[:, :, 0]
    metrics = train_vae(vae, pixels, **cfg, seed=seed, progress=progress)
    set_latent_statistics(vae, pixels)
    shutil.rmtree(folder)
    vae.save_pretrained(folder, safe_serialization=True)
    return metrics


def vae_reconstruct(vae: torch.nn.Module, pixels: torch.Tensor,
                    generator: torch.Generator | None = None, sample: bool = True):
    """``(reconstruction, posterior)`` of ``pixels`` in [-1, 1] — ``(B, 3, H, W)`` for an
    ``AutoencoderKL``, ``(B, 3, F, H, W)`` for an ``AutoencoderKLWan`` — differentiable.

    ``AutoencoderKLWan.decode`` clamps its output to [-1, 1]; a pixel whose output overshoots
    then gets no gradient and can stay stuck (the background is at -1, so most outputs sit at the
    edge). The reconstruction is therefore taken before the clamp: a forward hook on
    ``vae.decoder`` collects each decoded chunk of frames, which are concatenated in time.
    """
    posterior = vae.encode(pixels).latent_dist
    z = posterior.sample(generator=generator) if sample else posterior.mode()
    if pixels.ndim == 4:
        return vae.decode(z).sample, posterior
    chunks: list[torch.Tensor] = []
    handle = vae.decoder.register_forward_hook(lambda module, args, out: chunks.append(out))
    try:
        vae.decode(z)
    finally:
        handle.remove()
    return torch.cat(chunks, dim=2), posterior


def train_vae(vae: torch.nn.Module, pixels: torch.Tensor, *, steps: int, batch_size: int,
              lr: float, weight_decay: float, kl_weight: float, warmup_fraction: float,
              seed: int = 0, progress: bool = True) -> dict[str, float]:
    """Train ``vae`` on ``pixels`` (``(N, 3, [F,] H, W)`` in [-1, 1]) with
    ``MSE(x̂, x) + kl_weight * KL(q(z|x) || N(0, I)) / (elements per sample)`` (the β-VAE
    objective with a small β, as latent-diffusion autoencoders use; Rombach et al. 2022, §3),
    AdamW and a one-cycle learning rate (``warmup_fraction`` warm-up, cosine decay).

    :returns: ``{"recon_mse": final MSE of the posterior means on up to 256 examples, "kl"}``.
    """
    vae.train()
    vae.requires_grad_(True)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=max(steps, 2), pct_start=warmup_fraction)
    g = torch.Generator().manual_seed(seed)
    per_sample = pixels[0].numel()
    steps_iter = range(steps)
    if progress:
        from tqdm.auto import tqdm
        steps_iter = tqdm(steps_iter, desc=f"train {type(vae).__name__}", unit="step", leave=False)
    for _ in steps_iter:
        x = pixels[torch.randint(len(pixels), (batch_size,), generator=g)]
        recon, post = vae_reconstruct(vae, x, generator=g)
        mse = torch.nn.functional.mse_loss(recon, x)
        kl = 0.5 * (post.mean ** 2 + post.var - 1.0 - post.logvar).flatten(1).sum(1).mean()
        loss = mse + kl_weight * kl / per_sample
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if progress:
            steps_iter.set_postfix(mse=f"{float(mse.detach()):.4f}")
    vae.eval()
    vae.requires_grad_(False)
    with torch.no_grad():
        x = pixels[:256]
        recon = torch.cat([vae_reconstruct(vae, part, sample=False)[0] for part in x.split(32)])
        mse = float(torch.nn.functional.mse_loss(recon.clamp(-1, 1), x))
    return {"recon_mse": mse, "kl": float(kl.detach())}


@torch.no_grad()
def set_latent_statistics(vae: torch.nn.Module, pixels: torch.Tensor, limit: int = 512) -> None:
    """Record the statistics of the posterior means over (up to ``limit``) examples in the VAE's
    config, as the real checkpoints do: ``AutoencoderKL`` → global ``shift_factor`` (mean) and
    ``scaling_factor`` (1 / std), so ``(z - shift) * scale`` is about unit variance (FLUX.1);
    ``AutoencoderKLWan`` → per-channel ``latents_mean`` / ``latents_std`` (Wan 2.1)."""
    z = torch.cat([vae.encode(part).latent_dist.mode() for part in pixels[:limit].split(32)])
    if z.ndim == 4:
        vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1.0 / z.std()))
    else:
        per_channel = z.transpose(0, 1).flatten(1)
        vae.register_to_config(latents_mean=[float(v) for v in per_channel.mean(1)],
                               latents_std=[float(v) for v in per_channel.std(1)])
