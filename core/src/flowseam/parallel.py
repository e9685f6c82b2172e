"""One generation across several processes: Ulysses sequence parallelism and CFG parallelism.

``Parallel(sp=N, cfg=True)`` asks for ``N`` ranks per sequence and, with ``cfg``, two such
groups, one per CFG branch (``2 * N`` ranks in all): rank ``r`` is CFG branch ``r // N`` (0:
unconditional, 1: conditional) and sequence shard ``r % N``. A card declares where its DiT's token
sequence is split and gathered (:class:`SequenceSplit`: diffusers' ``_cp_plan`` points; Ulysses:
Jacobs et al. 2023, arXiv:2309.14509); in between, the self-attention calls the platform's
``sequence_parallel_attention`` op and everything else runs on the local tokens. The split and
the gather are torch forward hooks: nothing of diffusers is patched. CFG branches exchange their
velocities before the solver step. Key decision: only the DiT's output is gathered; the loop's
latents, solver state, noise, log-probs and BehaviorRecords stay whole on every rank, so a
rollout records exactly what one process would. Forward only: a split forward that requires
grad is refused (``ValueError``). docs/scaling.md has the design, its costs and what is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .errors import FlowseamError, InvalidInputError


#: names that moved to :mod:`flowseam.launch` in 0.2, importable from here until 0.3
_MOVED = ("launch", "first_failure", "EXIT_PEER_LOST")


def __getattr__(name: str) -> Any:
    """The names of :data:`_MOVED`, from :mod:`flowseam.launch`, with a DeprecationWarning."""
    if name in _MOVED:
        import warnings

        from . import launch

        warnings.warn(f"flowseam.parallel.{name} moved to flowseam.launch.{name} (the old path goes "
                      "in flowseam 0.3)", DeprecationWarning, stacklevel=2)
        return getattr(launch, name)
    raise AttributeError(f"module 'flowseam.parallel' has no attribute {name!r}")


def agreed_stop(exc: BaseException) -> bool:
    """Whether ``exc`` ended a split generation on every rank at the same step (a step callback
    that raised: :meth:`ParallelGroups.agreed`), or was refused before any rank communicated
    (bad input): the ranks are still in step and can run the next request."""
    return getattr(exc, "agreed_stop", False) or isinstance(exc, InvalidInputError)


class ParallelStopError(FlowseamError):
    """Another rank of a split generation stopped it (its step callback raised: a cancelled
    request, a client that went away)."""


@dataclass(frozen=True)
class Parallel:
    """How one generation is split over ranks.

    :param sp: sequence-parallel degree: ranks that share one sequence (>= 1).
    :param cfg: run the unconditional and conditional CFG branches on two groups of ``sp``
        ranks.
    :raises ValueError: (``InvalidInputError``) for ``sp`` not a positive int.
    """

    sp: int = 1
    cfg: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sp, bool) or not isinstance(self.sp, int) or self.sp < 1:
            raise InvalidInputError(f"sp={self.sp!r} must be an int >= 1")
        if not isinstance(self.cfg, bool):
            raise InvalidInputError(f"cfg={self.cfg!r} must be True or False")

    @property
    def cfg_degree(self) -> int:
        return 2 if self.cfg else 1

    @property
    def world_size(self) -> int:
        """The number of ranks one generation needs: ``sp * (2 if cfg else 1)``."""
        return self.sp * self.cfg_degree

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def __str__(self) -> str:
        return f"sp={self.sp}" + (" cfg-parallel" if self.cfg else "")


def parallel_from_options(nproc: int | None, sp: int | None, cfg: bool) -> Parallel | None:
    """The layout of ``--nproc N [--sp S] [--cfg-parallel]`` (``flowseam generate`` and
    ``serve``), None for one process. ``N`` ranks are ``S`` sequence shards times one or two
    CFG branches: with ``--nproc`` alone every rank is a shard (``S = N``, or ``N / 2`` with
    ``--cfg-parallel``); with ``--sp`` or ``--cfg-parallel`` alone, ``N = S x branches``.

    :raises InvalidInputError: for a value below 1, or ``N != S x branches``, naming the numbers.
    """
    for flag, value in (("--nproc", nproc), ("--sp", sp)):
        if value is not None and value < 1:
            raise InvalidInputError(f"{flag}={value} must be >= 1")
    branches = 2 if cfg else 1
    if nproc is None:
        layout = Parallel(sp=sp or 1, cfg=cfg)
    elif sp is None:
        if nproc % branches:
            raise InvalidInputError(f"--nproc {nproc} with --cfg-parallel: the two CFG branches "
                                    f"need an even number of ranks (2 x --sp)")
        layout = Parallel(sp=nproc // branches, cfg=cfg)
    else:
        layout = Parallel(sp=sp, cfg=cfg)
        if layout.world_size != nproc:
            raise InvalidInputError(
                f"--nproc {nproc} does not match --sp {sp}" + (" x 2 CFG branches" if cfg else "")
                + f" = {layout.world_size} ranks; give --nproc {layout.world_size}, or leave it out")
    return layout if layout.enabled else None


def uses_gpu(platform: Any) -> bool:
    """Whether ``platform`` runs on the GPUs torch sees (its first device is not the CPU's), so
    that each rank takes one (``cuda:LOCAL_RANK``)."""
    return torch.cuda.is_available() and platform is not None and \
        platform.device_chain[0] != "cpu"


def device_slots(platform: Any = None) -> tuple[int, str]:
    """How many ranks this machine gives a device each: for a platform on the GPU its CUDA GPUs
    (one GPU a rank), else the CPU cores this process may run on (one torch thread a rank)."""
    if uses_gpu(platform):
        return torch.cuda.device_count(), "CUDA GPUs"
    try:
        return len(os.sched_getaffinity(0)), "CPU cores"
    except AttributeError:  # not Linux
        return os.cpu_count() or 1, "CPU cores"


def check_ranks(parallel: Parallel, platform: Any = None) -> None:
    """Refuse a layout that needs more ranks than :func:`device_slots` of ``platform``.

    :raises InvalidInputError: naming both numbers.
    """
    have, what = device_slots(platform)
    if parallel.world_size > have:
        layout = f"--sp {parallel.sp}" + (" x 2 CFG branches" if parallel.cfg else "")
        raise InvalidInputError(
            f"--nproc {parallel.world_size} ({layout}): this machine has {have} {what}, one per "
            f"rank; use {have} ranks or fewer")


def is_rank_of(world_size: int) -> bool:
    """Whether this process is a rank of a ``world_size``-rank job: torch.distributed is up
    with that many ranks, or torchrun started it as one (``WORLD_SIZE`` equal to it, ``RANK``
    and ``MASTER_ADDR`` set). A ``WORLD_SIZE`` the environment merely inherited (1, or another
    job's) is not: ``--nproc`` then starts its own ranks."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() == world_size
    return (os.environ.get("WORLD_SIZE") == str(world_size) and "RANK" in os.environ
            and "MASTER_ADDR" in os.environ)


def check_environment(parallel: Parallel, platform: Any) -> None:
    """Refuse, before any weights load, a process that is not one of ``parallel``'s ranks; on a
    platform on the GPU, make ``cuda:LOCAL_RANK`` this rank's device (one GPU a rank), so that
    a backend building on the current device puts each rank's copy on its own GPU.

    :raises FlowseamError: naming the ranks needed and how to start them.
    """
    if not is_rank_of(parallel.world_size):
        raise FlowseamError(
            f"Parallel({parallel}) needs {parallel.world_size} ranks; this process is not one of "
            f"them (WORLD_SIZE={os.environ.get('WORLD_SIZE', 'unset')}): start it with flowseam "
            f"generate --nproc {parallel.world_size} or torchrun")
    if uses_gpu(platform):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def takes_any_heads(platform: Any) -> bool:
    """Whether the platform's ``sequence_parallel_attention`` runs any number of heads over
    ``sp`` ranks (its function says so: ``any_heads = True``, ring attention), rather than
    needing heads divisible by ``sp`` (Ulysses' all-to-all, the default)."""
    from . import ops

    return bool(getattr(platform.kernels.get(ops.SEQUENCE_PARALLEL_ATTENTION).fn, "any_heads",
                        False))


def check_split(parallel: Parallel, *, heads: int, tokens: int, text_tokens: int | None = None,
                model: str = "the DiT", any_heads: bool = False) -> None:
    """Refuse a split that does not divide: ``heads`` (per attention layer; unless the kernel
    takes ``any_heads``) and ``tokens`` (the DiT's sequence after patching; and ``text_tokens``
    when the text joins the self-attention, as in FLUX) must be multiples of ``parallel.sp``.

    :raises InvalidInputError: naming the numbers.
    """
    n = parallel.sp
    if n == 1:
        return
    if heads % n and not any_heads:
        raise InvalidInputError(
            f"--sp {n}: {model} has {heads} attention heads, not a multiple of {n} (Ulysses "
            f"gives each rank heads/sp heads); use an sp that divides {heads}, or a backend whose "
            "sequence_parallel_attention takes any heads (accel's ring attention)")
    if tokens % n:
        raise InvalidInputError(
            f"--sp {n}: the request makes {tokens} tokens after patching, not a multiple of {n}; "
            "change the height, width or frames, or use an sp that divides it")
    if text_tokens is not None and text_tokens % n:
        raise InvalidInputError(
            f"--sp {n}: {model} attends jointly over {text_tokens} text tokens, not a multiple "
            f"of {n}; set max_sequence_length to a multiple of {n}")


class ParallelGroups:
    """This process's place in a :class:`Parallel` layout, with its process groups.

    Build it with :meth:`create` on every rank (a collective: torch.distributed's ``new_group``).

    :ivar rank: this rank in the world. :ivar sp_rank: its shard ``r % sp``.
    :ivar cfg_rank: its CFG branch ``r // sp`` (0: unconditional, 1: conditional).
    :ivar sp_group: the ``sp`` ranks of its branch. :ivar cfg_group: the (1 or 2) ranks holding
        its shard, one per branch.
    """

    def __init__(self, parallel: Parallel, rank: int, sp_group: Any, cfg_group: Any) -> None:
        self.parallel = parallel
        self.rank = rank
        self.sp_rank, self.cfg_rank = rank % parallel.sp, rank // parallel.sp
        self.sp_group, self.cfg_group = sp_group, cfg_group

    @classmethod
    def create(cls, parallel: Parallel) -> "ParallelGroups":
        """The groups of ``parallel`` over the default process group, created (``env://``, gloo
        for CPU tensors and nccl for CUDA ones) if torchrun started this process and nobody has
        yet.

        :raises FlowseamError: when the world's size is not ``parallel.world_size``, or the
            process was not started as a rank (``flowseam generate --nproc N`` or torchrun).
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            if not is_rank_of(parallel.world_size):
                raise FlowseamError(
                    f"Parallel({parallel}) needs {parallel.world_size} ranks; this process is "
                    f"not one of them (WORLD_SIZE={os.environ.get('WORLD_SIZE', 'unset')}): start "
                    f"it with flowseam generate --nproc {parallel.world_size} or torchrun")
            dist.init_process_group(
                backend="cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != parallel.world_size:
            raise FlowseamError(f"Parallel({parallel}) needs {parallel.world_size} ranks; the "
                                f"process group has {world}")
        n, c = parallel.sp, parallel.cfg_degree
        sp_groups = [dist.new_group([b * n + s for s in range(n)]) for b in range(c)]
        cfg_groups = [dist.new_group([b * n + s for b in range(c)]) for s in range(n)]
        return cls(parallel, rank, sp_groups[rank // n], cfg_groups[rank % n])

    # -- the collectives a split generation needs --------------------------------------------
    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous ``1/sp`` of ``x`` along ``dim`` (no communication)."""
        return x.chunk(self.parallel.sp, dim=dim)[self.sp_rank]

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every shard of the sequence group, concatenated along ``dim`` in rank order."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.parallel.sp)]
        dist.all_gather(parts, x.contiguous(), group=self.sp_group)
        return torch.cat(parts, dim=dim)

    def gather_branches(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """``[unconditional, conditional]`` velocities from this rank's one branch."""
        import torch.distributed as dist

        parts = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(parts, mine.contiguous(), group=self.cfg_group)
        return parts

    def agreed(self, step_callback: Callable | None) -> Callable:
        """A step callback every rank calls at every step: it runs ``step_callback`` (this
        rank's; None on ranks that have none, e.g. a server's workers) and, when any rank's
        raised, raises on every rank — the raising rank's own exception, on the others
        :class:`ParallelStopError` — so no rank is left waiting in a collective. Either carries
        ``agreed_stop = True`` (:func:`agreed_stop`): every rank stopped at the same step."""
        def callback(i: int, n: int, latents: torch.Tensor) -> None:
            error = None
            if step_callback is not None:
                try:
                    step_callback(i, n, latents)
                except BaseException as exc:  # re-raised below, after every rank knows
                    error = exc
            if self.any(error is not None):
                if error is None:
                    error = ParallelStopError(f"another rank stopped the generation at step {i}")
                error.agreed_stop = True
                raise error

        return callback

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any (so every rank stops together)."""
        import torch.distributed as dist

        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


@dataclass(frozen=True)
class SequenceSplit:
    """Where a card's DiT splits and gathers its token sequence (diffusers' ``_cp_plan`` points).

    :param inputs: submodule name (``""``: the DiT itself) → {argument name: dim}: those
        arguments are sharded along ``dim`` before the submodule runs.
    :param outputs: submodule name → {output index: dim}: those outputs are sharded after it
        runs (e.g. the rotary embedding, computed for the whole sequence).
    :param gather: submodule name → dim: its output is gathered after it runs.
    :param cross_attention: suffixes of attention modules that attend from the local tokens to
        something unsplit (Wan's ``attn2``: the text); every other attention module is
        self-attention over the split sequence.
    """

    inputs: dict[str, dict[str, int]] = field(default_factory=dict)
    outputs: dict[str, dict[int, int]] = field(default_factory=dict)
    gather: dict[str, int] = field(default_factory=dict)
    cross_attention: tuple[str, ...] = ()

    def install(self, dit: torch.nn.Module, groups: ParallelGroups) -> set[Callable]:
        """Register the hooks on ``dit``; returns the hook functions (a ``copy.deepcopy`` of
        ``dit`` holds the same functions: :func:`remove_hooks` drops them from a copy)."""
        import inspect

        hooks: set[Callable] = set()
        for name, args in self.inputs.items():
            module = dit.get_submodule(name)
            params = list(inspect.signature(module.forward).parameters)

            def pre(mod, a, kw, args=args, params=params):
                a = list(a)
                for arg, dim in args.items():
                    if arg in kw and kw[arg] is not None:
                        kw[arg] = groups.shard(kw[arg], dim)
                    elif arg in params and params.index(arg) < len(a):
                        a[params.index(arg)] = groups.shard(a[params.index(arg)], dim)
                return tuple(a), kw

            module.register_forward_pre_hook(pre, with_kwargs=True)
            hooks.add(pre)
        for name, outs in self.outputs.items():
            def post(mod, a, out, outs=outs):
                out = list(out)
                for i, dim in outs.items():
                    out[i] = groups.shard(out[i], dim)
                return tuple(out)

            dit.get_submodule(name).register_forward_hook(post)
            hooks.add(post)
        for name, dim in self.gather.items():
            def gather(mod, a, out, dim=dim):
                return groups.gather(out, dim)

            dit.get_submodule(name).register_forward_hook(gather)
            hooks.add(gather)
        return hooks

    @staticmethod
    def remove_hooks(module: torch.nn.Module, hooks: set[Callable]) -> None:
        """Drop ``hooks`` (what :meth:`install` returned) from ``module`` and its submodules:
        a ``copy.deepcopy`` of a split DiT then runs its whole sequence on one rank."""
        for sub in module.modules():
            for table in (sub._forward_pre_hooks, sub._forward_hooks):
                for key, fn in list(table.items()):
                    if fn in hooks:
                        del table[key]
                        sub._forward_pre_hooks_with_kwargs.pop(key, None)
                        sub._forward_hooks_with_kwargs.pop(key, None)

    def is_cross(self, processor_name: str) -> bool:
        """Whether the attention module of ``processor_name`` (``blocks.0.attn2.processor``)
        attends to something unsplit."""
        module = processor_name.rsplit(".processor", 1)[0]
        return any(module.endswith(s) for s in self.cross_attention)
