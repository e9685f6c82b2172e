"""``flowseam.load``: a diffusers-format checkpoint → a model instance built through the seam."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from .seam.components import ComponentSpec, check_component_class
from .quiet import hub_output, library_output
from .checkpoint_defaults import read_checkpoint_defaults
from .seam.dtypes import for_kinds, parse_dtypes
from .errors import CheckpointError, FlowseamError, NotEnoughMemoryError
from .seam.faults import is_out_of_memory
from .memory import MemoryOptions, advice, weight_bytes
from .models import card_for_index, declared
from .models.card import ModelCard
from .models.instance import ModelInstance
from .models.split import ModelSplit
from .parallel import check_environment, takes_any_heads
from .seam.platform import Platform
from .request import DiffusionParams, TaskType
from .schedulers import SERVING_DEFAULTS

if TYPE_CHECKING:  # pragma: no cover
    from .parallel import Parallel


def looks_like_path(text: str) -> bool:
    """Whether ``text`` is meant as a local path rather than a hub id (``org/name``): it starts
    with ``.``, ``/`` or ``~``, uses a backslash, has more or fewer than one ``/``, ends in ``/``,
    or its first component is an existing local directory (``outputs/ckpt`` when ``outputs/``
    exists)."""
    if text.startswith((".", "/", "~")) or "\\" in text or text.count("/") != 1 or text.endswith("/"):
        return True
    return Path(text.split("/")[0]).is_dir()


def resolve_checkpoint(path_or_hub_id: str | os.PathLike) -> Path:
    """A local directory, or a hub id (``org/name``) fetched with huggingface_hub.

    A name that :func:`looks_like_path` is never sent to the hub: a missing directory is
    reported as missing.

    :raises FlowseamError: if the directory does not exist, or the hub cannot be reached (the
        message says how to pass a local directory instead).
    """
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_hub_id)
    if path.exists():
        raise FlowseamError(f"checkpoint {text!r} is a file, not a directory (expected a "
                            "diffusers-format folder with model_index.json)")
    if looks_like_path(text):
        raise FlowseamError(f"checkpoint directory {text!r} does not exist (looked in "
                            f"{path.absolute().parent}); expected a diffusers-format folder with "
                            "model_index.json, or a hub id like 'org/name'")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text))
    except Exception as exc:  # offline, unknown repo, auth...
        raise FlowseamError(
            f"{text!r} is not a local directory, and fetching it from the Hugging Face hub failed "
            f"({type(exc).__name__}: {exc}). If this machine is offline, download the checkpoint "
            "elsewhere and pass its local directory instead (flowseam.load('/path/to/checkpoint'), "
            "--model /path/to/checkpoint)") from exc


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file. :raises FlowseamError: naming the missing or corrupt file."""
    if not path.is_file():
        raise FlowseamError(f"missing checkpoint file {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"corrupt checkpoint file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"corrupt checkpoint file {path}: expected a JSON object, got "
                              f"{type(data).__name__}")
    return data


def read_card(path_or_hub_id: str | os.PathLike) -> ModelCard:
    """The card of a checkpoint, from its ``model_index.json`` alone (no weights are read): what
    the CLI checks a request against before any model loads.

    :raises FlowseamError: for a missing directory or a missing or corrupt ``model_index.json``.
    :raises ValueError: if no card matches the checkpoint's pipeline class.
    """
    root = resolve_checkpoint(path_or_hub_id)
    return card_for_index(read_json(root / "model_index.json"), str(root / "model_index.json"))


def load(path_or_hub_id: str | os.PathLike, platform: Platform | None = None, *,
         ignore_scheduler_options: Iterable[str] = (), quiet: bool = False,
         verbose: bool = False, parallel: "Parallel | None" = None, dtype: Any = None,
         offload: str | None = None, vae_tiling: bool | dict[str, Any] = False,
         vae_slicing: bool = False) -> ModelInstance:
    """Load a diffusers-format checkpoint (WanPipeline, WanImageToVideoPipeline, Wan2.2's
    two-expert layouts of both, FluxPipeline, LTX2Pipeline, LTX2ImageToVideoPipeline, or
    flowseam's causal Wan layout) into a flowseam model instance.

    The card is chosen from ``model_index.json``; the solver from
    ``scheduler/scheduler_config.json`` (:mod:`flowseam.schedulers`: the checkpoint's settings
    are the default, refused options are named) before any weights load; the checkpoint's own
    serving defaults from ``flowseam.json`` when it has one (:mod:`flowseam.checkpoint_defaults`: they fill
    a request's unset parameters before the scheduler config and the card do); every component is
    built with ``platform.build_component(kind, spec)`` (so a backend may override it and
    anything it leaves out falls back to cpu); every DiT expert's attention is routed through
    ``platform.kernels``' ``attention`` op (and ``cached_attention`` for a causal checkpoint).
    Components the layout declares that the card does not use are reported (a warning,
    ``model.unused_components``, ``provenance()``); a layout the card cannot serve as diffusers
    does is refused naming the component.

    Prints one line to stderr (unless ``quiet``): the card, and the solver with its schedule
    settings and where each came from (checkpoint / card default / diffusers default).

    :param platform: default ``Platform.detect()``.
    :param ignore_scheduler_options: scheduler_config.json keys (or ``"_class_name"``) that
        flowseam does not implement, to ignore with a warning instead of refusing them.
    :param quiet: do not print flowseam's load line.
    :param parallel: split every generation over several processes
        (:class:`flowseam.Parallel`: sequence and CFG parallelism, :mod:`flowseam.parallel`);
        this process must be one of ``parallel.world_size`` ranks started by torchrun or
        ``flowseam generate --nproc``, and every rank loads and then runs the same requests. A
        layout the card cannot run (a loop that cannot be split, heads ``sp`` does not divide, no
        CFG branch) is refused before any weights load.
    :param verbose: let diffusers and transformers print their loading progress bars and
        notices (off by default: :func:`flowseam.quiet.library_output`).
    :param dtype: the dtype of the torch components (:mod:`flowseam.seam.dtypes`): one for all
        (``"bfloat16"``, ``torch.float16``), or per kind (``"dit=bfloat16,vae=float32"``,
        ``{"dit": "bfloat16"}``); None: each backend's own (cpu: float32). Weights are loaded in
        it (keep-in-float32 modules honoured), never in float32 first; a dtype the building
        backend does not declare is refused before any weights load.
    :param offload: ``"model"``: each component on the compute device only while it runs
        (diffusers' ``enable_model_cpu_offload``; needs an accelerator: refused on a platform
        whose components all live on the CPU); ``"text_encoder"``: the text encoders are freed
        once a request's prompts are encoded (loaded again for a prompt not in the cache).
        None: everything stays where it was built.
    :param vae_tiling: decode (and encode) in overlapping tiles: diffusers'
        ``vae.enable_tiling()``, or a dict of its arguments (tile sizes); refused for a VAE
        without tiling and for the causal loop, whose streaming decode is chunked already.
    :param vae_slicing: decode one sample of a batch at a time (``vae.enable_slicing()``).
    :raises FlowseamError: for a missing directory, an unreachable hub, a missing or corrupt
        checkpoint file (``flowseam.json`` included), a checkpoint without a component its card
        needs (naming what is missing and what the card needs), a layout or scheduler option
        flowseam refuses (named in the message); all before any weights load.
    :raises ValueError: if no card matches the checkpoint's pipeline class.
    """
    memory = MemoryOptions.check(offload, vae_tiling, vae_slicing)
    requested = parse_dtypes(dtype)
    return _load(path_or_hub_id, platform, ignore_scheduler_options, quiet, parallel,
                 requested, memory, verbose)


def _load(path_or_hub_id: str | os.PathLike, platform: Platform | None,
          ignore_scheduler_options: Iterable[str], quiet: bool,
          parallel: "Parallel | None" = None, requested: dict[str, str] | None = None,
          memory: "MemoryOptions | None" = None, verbose: bool = False) -> ModelInstance:
    with hub_output(verbose):  # a hub id is downloaded here
        root = resolve_checkpoint(path_or_hub_id)
    index_file = root / "model_index.json"
    platform = platform if platform is not None else Platform.detect()
    memory = memory or MemoryOptions()
    index, card, plan, dtypes = _plan(root, platform, requested or {}, memory)
    configs = check_layout(card, index, root)
    if parallel is not None and parallel.enabled:
        card.split.check_layout(parallel, {n: c.get("num_attention_heads", 0)
                                           for n, c in configs.items()}, card.name,
                                takes_any_heads(platform))
        check_environment(parallel, platform)  # a rank of the layout, on its own GPU
    scheduler_file = root / "scheduler" / "scheduler_config.json"
    raw = read_json(scheduler_file) if (root / "scheduler").is_dir() else None
    serve_defaults = read_checkpoint_defaults(root)  # a bad flowseam.json fails before any build
    unused = unused_components(card, index, configs)
    # the checks above import no model library; library_output imports diffusers and
    # transformers (seconds), so a refusal above comes at once
    with library_output(verbose):
        solver = None  # a card whose loop has its own sampler (the causal one) reads no scheduler
        if card.solver_from_scheduler:
            solver = card.resolve_solver(raw, file=str(scheduler_file),
                                         ignore=ignore_scheduler_options,
                                         index_class=index["scheduler"][1]
                                         if declared(index, "scheduler") else None)
        if solver is not None and "flow_shift" in serve_defaults:
            # the checkpoint's own shift is a solver setting: the load line shows it, with its
            # source
            serve_defaults = dict(serve_defaults)
            solver = solver.for_request(
                DiffusionParams(flow_shift=serve_defaults.pop("flow_shift")),
                source=SERVING_DEFAULTS)
        for name, why in unused.items():
            warnings.warn(f"{index_file}: {name} {index.get(name)!r} is not loaded: {why}",
                          UserWarning, stacklevel=2)
        components, records, specs = _build_components(root, plan, unused, dtypes, platform,
                                                       memory)
        instance = _assemble(card, platform, components, root, solver, raw, index, records, specs,
                             memory, unused, serve_defaults, parallel)
    if not quiet:
        boundary = instance.experts.boundary_timestep
        experts = f" (experts {', '.join(instance.experts)}, boundary timestep " \
                  f"{boundary:g})" if boundary is not None else ""
        print(f"flowseam: loaded {card.name}{experts} from {root}: {instance.solver_line()}",
              file=sys.stderr)
    return instance


def _assemble(card: ModelCard, platform: Platform, components: dict[str, Any], root: Path,
              solver: Any, scheduler_config: dict[str, Any] | None, index: dict[str, Any],
              records: dict[str, Any], specs: dict[str, Any], memory: MemoryOptions,
              unused: dict[str, str], serve_defaults: dict[str, Any],
              parallel: "Parallel | None") -> ModelInstance:
    """The card's instance over the built components, set up to run: its ``model_index.json``
    settings read, attention routed through the platform, text-only values reused across steps,
    the memory options applied and, with ``parallel``, the split over the ranks installed."""
    instance = card.instance(card, platform, components, root, solver,
                             scheduler_config=scheduler_config, pipeline_config=index,
                             records=records, specs=specs, memory=memory)
    instance.unused_components = unused
    instance.serve_defaults = serve_defaults
    instance.read_index(index, str(root / "model_index.json"))
    instance.route_attention()
    instance.install_step_constants()
    instance.placement.apply(instance.dit)
    if parallel is not None and parallel.enabled:
        instance.parallel = ModelSplit.install(
            parallel, card.split, instance.experts, platform, card.name,
            {name: instance.components[name].config for name in (instance.DIT, "vae")})
    return instance


def _build_components(root: Path, plan: list[tuple[Any, str]], unused: dict[str, str],
                      dtypes: dict[str, str], platform: Platform, memory: MemoryOptions):
    """Build every used component of ``plan`` with ``platform``: name → component, → its
    platform record, → (kind, spec). A library's loading error is a CheckpointError naming the
    files; running out of memory says how much the weights take and what would lower it."""
    components: dict[str, Any] = {}
    records, specs = {}, {}
    for entry, cls in plan:
        if entry.name in unused:
            continue
        spec = ComponentSpec(name=entry.name, cls=cls, path=str(root), subfolder=entry.name,
                             dtype=dtypes.get(entry.name))
        try:
            components[entry.name] = platform.build_component(entry.kind, spec)
        except Exception as exc:  # out of memory: say how much the weights take, and what helps
            if not is_out_of_memory(exc) or isinstance(exc, NotEnoughMemoryError):
                raise
            need = weight_bytes(root / entry.name, spec.dtype)
            raise NotEnoughMemoryError(
                f"out of memory loading {entry.name} ({entry.kind}): its weights take "
                f"{need / 2**30:.2f} GiB in {spec.dtype or 'their stored dtype'} ({exc}); "
                f"{advice((entry.kind,), memory, dtypes)}") from exc
        specs[entry.name] = (entry.kind, spec)
        records[entry.name] = platform.components[-1]
    return components, records, specs


def check_load_options(path_or_hub_id: str | os.PathLike, platform: Platform, *,
                       dtype: Any = None, offload: str | None = None,
                       vae_tiling: bool | dict[str, Any] = False, vae_slicing: bool = False) -> None:
    """What :func:`load` checks of its ``dtype`` and memory options before any weights load,
    alone (``flowseam generate --nproc`` checks them before it starts the ranks).

    :raises InvalidInputError: as :func:`load`.
    """
    _plan(resolve_checkpoint(path_or_hub_id), platform, parse_dtypes(dtype),
          MemoryOptions.check(offload, vae_tiling, vae_slicing))


def _plan(root: Path, platform: Platform, requested: dict[str, str], memory: MemoryOptions):
    """``(index, card, plan, dtypes)`` of the checkpoint at ``root``: its card, the components to
    build (:func:`component_plan`: an incomplete checkpoint and a class outside the allow-list
    are refused, nothing imported) and the dtype asked for each, with the memory options
    checked against them."""
    index_file = root / "model_index.json"
    index = read_json(index_file)
    card = card_for_index(index, str(index_file))
    card.instance.check_index(index, str(index_file))
    plan = component_plan(root, index, card, platform.declared_component_classes())
    dtypes = component_dtypes(plan, requested, platform, card.name)
    memory.check_against(card, plan, platform)
    return index, card, plan, dtypes


#: component kinds that are not torch modules (no dtype, nothing to offload)
NOT_MODULES = ("tokenizer", "image_processor")


def component_dtypes(plan: list[tuple[Any, str]], requested: dict[str, str], platform: Platform,
                     card: str) -> dict[str, str]:
    """component name → the dtype asked for it (:func:`flowseam.seam.dtypes.parse_dtypes`'s request
    spread over the card's kinds), each checked with the plugin that will build it.

    :raises InvalidInputError: a kind the card lacks, or a dtype its backend does not build.
    """
    if not requested:
        return {}
    kinds = list(dict.fromkeys(e.kind for e, _ in plan if e.kind not in NOT_MODULES))
    per_kind = for_kinds(requested, kinds, card)
    out = {}
    for entry, _ in plan:
        if entry.kind in per_kind:
            platform.check_dtype(entry.kind, entry.name, per_kind[entry.kind])
            out[entry.name] = per_kind[entry.kind]
    return out


def check_parallel_checkpoint(path_or_hub_id: str | os.PathLike, parallel: "Parallel",
                              params: DiffusionParams, platform: Platform | None = None) -> None:
    """Refuse, before any weights load, a :class:`~flowseam.Parallel` layout the checkpoint's
    card cannot run, or a request (``params``; unset fields take the checkpoint's and the card's
    defaults) it cannot split: a loop that cannot be split, heads or tokens after patching that
    ``sp`` does not divide, CFG parallelism without CFG (what ``flowseam generate --nproc``
    checks before it starts the ranks). Reads ``model_index.json`` and the DiT's and the VAE's
    ``config.json`` (with the diffusers class's defaults for keys a config leaves out).

    :param platform: the platform the ranks will build (its ``sequence_parallel_attention``
        may take any heads: :func:`flowseam.parallel.takes_any_heads`); default
        ``Platform.detect()``.
    :raises InvalidInputError: naming the numbers.
    :raises FlowseamError: for a checkpoint that cannot be read.
    """
    import inspect

    import diffusers

    any_heads = takes_any_heads(platform if platform is not None else Platform.detect())

    root = resolve_checkpoint(path_or_hub_id)
    index = read_json(root / "model_index.json")
    card = card_for_index(index, str(root / "model_index.json"))
    configs = check_layout(card, index, root)
    card.split.check_layout(parallel, {n: c.get("num_attention_heads", 0)
                                       for n, c in configs.items()}, card.name, any_heads)
    params = params.with_defaults({**card.defaults, **read_checkpoint_defaults(root)})
    full = {}
    for name in (card.instance.DIT, "vae"):
        cls = getattr(diffusers, str(index[name][1]), None)
        defaults = {} if cls is None else {
            k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}
        full[name] = {**defaults, **read_json(root / name / "config.json")}
    card.split.check_request(parallel, params, full, card.name, any_heads)


def check_layout(card: ModelCard, index: dict[str, Any], root: Path) -> dict[str, dict[str, Any]]:
    """Refuse, before any weights load, a layout the card cannot serve as diffusers does
    (:func:`component_plan` has refused a missing component): Wan2.2's ``transformer_2`` without ``boundary_ratio`` (diffusers
    would never run it) or the reverse, ``expand_timesteps=True`` (Wan2.2 TI2V-5B), a DiT whose
    ``image_dim`` needs an image encoder the checkpoint lacks.

    :returns: component name → its ``config.json`` for the DiT experts (read, not loaded).
    :raises FlowseamError: naming the component or option and what to do.
    """
    where = root / "model_index.json"
    if index.get("expand_timesteps"):
        raise FlowseamError(f"{where}: expand_timesteps=True (Wan2.2 TI2V-5B's per-token "
                            f"timesteps) is not implemented by flowseam's {card.name} card")
    ratio = index.get("boundary_ratio")
    if len(card.experts) > 1:
        if ratio is None:
            raise FlowseamError(
                f"{where} declares transformer_2 but boundary_ratio is null: diffusers' "
                f"{card.pipeline_class} would never run transformer_2. Set boundary_ratio (Wan2.2 "
                "A14B: 0.875 for T2V, 0.9 for I2V) or remove transformer_2")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise FlowseamError(f"{where}: boundary_ratio={ratio!r} must be a number in (0, 1] "
                                "(the fraction of num_train_timesteps where transformer_2 takes over)")
    configs = {name: read_json(root / name / "config.json") for name in card.experts
               if declared(index, name)}
    first = configs.get(card.experts[0], {})
    if (card.task == TaskType.I2V and first.get("image_dim") is not None
            and not (declared(index, "image_encoder") and declared(index, "image_processor"))):
        raise FlowseamError(
            f"{where}: transformer has image_dim={first['image_dim']} (it takes CLIP image "
            "embeddings, as Wan2.1 I2V does) but the checkpoint declares no image_encoder and "
            "image_processor to compute them")
    return configs


def unused_components(card: ModelCard, index: dict[str, Any],
                      configs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Components (and unknown pipeline options) ``model_index.json`` declares that the card
    does not load, with the reason: reported, never silently dropped."""
    known = {e.name for e in card.components} | set(card.pipeline_options) | {"scheduler"}
    unused = {}
    for key, value in index.items():
        if key.startswith("_") or value is None or (isinstance(value, list) and None in value):
            continue
        if key in known:
            continue
        if declared(index, key):
            unused[key] = f"an unknown component for flowseam's {card.name} card"
        elif value is not False:  # a pipeline option left at false changes nothing
            unused[key] = f"an unknown pipeline option for flowseam's {card.name} card"
    if not card.solver_from_scheduler and declared(index, "scheduler"):
        unused["scheduler"] = (f"the {card.loops[0]} loop samples with the card's own schedule "
                               "(see the solver line)")
    if card.task == TaskType.I2V and configs.get(card.experts[0], {}).get("image_dim") is None:
        for name in ("image_encoder", "image_processor"):
            if declared(index, name):
                unused[name] = ("the transformer takes no image embeddings (image_dim is null); "
                                "diffusers does not use it either")
    return unused


def component_plan(root: Path, index: dict[str, Any], card: ModelCard,
                   allowed: Iterable[str] = ()) -> list[tuple[Any, str]]:
    """``(ComponentEntry, dotted class)`` for every component of ``card`` the checkpoint has:
    those ``model_index.json`` declares (as ``[library, class]``; ``library`` is a package or a
    diffusers pipeline module such as ``"ltx2"``) with their folder present, and the card's extra
    folders (LTX-2's ``latent_upsampler/``). Every declared class is checked against the
    allow-list (:func:`flowseam.seam.components.check_component_class`; ``allowed``: what installed
    plugins declare) before anything is imported.

    :raises FlowseamError: naming every required component the checkpoint lacks and listing what
        the card needs (required components, then optional ones with what needs them).
    :raises UntrustedComponentError: for a class outside the allow-list, naming its module.
    """
    plan, missing = [], []
    for entry in card.components:
        folder = root / entry.name
        if declared(index, entry.name):
            library, name = index[entry.name]
            cls = check_component_class(library, name, allowed,
                                        f"{root / 'model_index.json'}: {entry.name!r}")
            if not folder.is_dir():
                missing.append(f"{entry.name!r} (model_index.json declares {name}, but "
                               f"there is no {entry.name}/ folder)")
                continue
        elif entry.cls is not None and folder.is_dir():
            cls = entry.cls
        else:
            if entry.required:
                missing.append(f"{entry.name!r} (model_index.json declares none)")
            continue
        plan.append((entry, cls))
    if missing:
        needs = ", ".join(f"{e.name} ({e.kind})" for e in card.components if e.required)
        optional = "; ".join(f"{e.name} ({e.kind}) for {e.purpose or 'optional features'}"
                             for e in card.components if not e.required)
        raise FlowseamError(
            f"{root} is not a complete {card.name} checkpoint: missing {', '.join(missing)}. "
            f"{card.name} needs {needs}" + (f"; optionally {optional}" if optional else ""))
    return plan

