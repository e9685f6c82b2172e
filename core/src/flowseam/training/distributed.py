"""Data-parallel training on torch.distributed: the few points where a method meets the other ranks.

A training method runs the same code on one process or on N ranks (``flowseam train --nproc N``,
or under ``torchrun``) and calls this module at five points (:class:`DataParallel` and its
:class:`Shard`): **platform** (rank 0 resolves it, every other rank rebuilds its frozen
``to_dict()``), **sharding** (this rank's share of a step's groups or rows, with seeds that never
depend on the rank, so N ranks roll out the samples one process would), **gathering** (rewards
over whole groups, so advantages are computed identically on every rank), **gradients** (DDP,
or FSDP2 ``fully_shard`` with ``fsdp``) and **writing** (rank 0 alone). gloo carries CPU tensors
and nccl CUDA tensors, with the same code; each rank of a GPU run uses ``cuda:LOCAL_RANK``.
docs/scaling.md ("Data-parallel training") walks through each point.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator

import torch
from pydantic import Field

from ..errors import FlowseamError, InvalidInputError
from .config import ConfigSection, validate_config

if TYPE_CHECKING:  # pragma: no cover
    from ..seam.platform import Platform


@dataclass(frozen=True)
class Shard:
    """This rank's share of one step: members ``members`` of groups ``groups``.

    :ivar groups: the group (prompt) indices this rank rolls out, ``range`` within ``[0, G)``.
    :ivar members: the member indices of each of those groups, ``range`` within ``[0, K)``.
    """

    dp: "DataParallel"
    n_groups: int
    group_size: int
    groups: range
    members: range

    def parts(self) -> list[tuple[int, list[int]]]:
        """``[(group, [member, ...]), ...]``: one rollout batch per group this rank holds."""
        return [(g, list(self.members)) for g in self.groups]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``(len(groups), len(members))`` block → the whole ``(G, K)`` matrix, on
        every rank (a collective: every rank calls it)."""
        expected = (len(self.groups), len(self.members))
        if tuple(local.shape) != expected:
            raise InvalidInputError(
                f"local block has shape {tuple(local.shape)}; this shard is {expected}")
        if self.dp.world_size == 1:
            return local
        blocks = self.dp.gather_tensor(local)
        # member split: every block holds every group → concatenate along members; group split:
        # every block holds whole groups → along groups
        return torch.cat(blocks, dim=1 if len(self.groups) == self.n_groups else 0)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block ``(len(groups), len(members))`` of a ``(G, K)`` matrix."""
        return full[self.groups.start:self.groups.stop, self.members.start:self.members.stop]


class DataParallel:
    """This process's place among the ranks of a run (world size 1 without torch.distributed).

    Build it with :meth:`from_env` (reads torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and
    creates the default process group if needed), or :meth:`single` for one process.

    :param fsdp: shard the trainer's modules with FSDP2 ``fully_shard`` instead of replicating
        them with DDP.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0,
                 fsdp: bool = False) -> None:
        self.rank, self.world_size, self.local_rank, self.fsdp = rank, world_size, local_rank, fsdp

    @classmethod
    def single(cls) -> "DataParallel":
        """One process: every collective is the identity."""
        return cls()

    @classmethod
    def from_env(cls, fsdp: bool = False) -> "DataParallel":
        """The ranks torchrun (or ``flowseam train --nproc``) started, from the environment.

        Creates the default process group (``env://``) unless the caller already did; with CUDA
        available, binds this rank to ``cuda:LOCAL_RANK`` first. Without ``WORLD_SIZE`` > 1 it is
        :meth:`single` (and ``fsdp`` is refused: there is nothing to shard over).

        :raises FlowseamError: for ``fsdp`` on one process, or an environment torchrun did not set
            up (missing ``RANK``/``MASTER_ADDR``).
        """
        import torch.distributed as dist

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1 and not (dist.is_available() and dist.is_initialized()):
            if fsdp:
                raise FlowseamError("[distributed] fsdp = true needs several ranks: run with "
                                    "flowseam train --nproc N (N >= 2) or under torchrun")
            return cls.single()
        if not dist.is_initialized():
            missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise FlowseamError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: start "
                                    "ranks with flowseam train --nproc N or torchrun")
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            if torch.cuda.is_available():
                torch.cuda.set_device(local_rank)
            # no backend named: gloo for CPU tensors, plus nccl for CUDA tensors when available
            dist.init_process_group()
            atexit.register(_destroy)
        return cls(dist.get_rank(), dist.get_world_size(),
                   int(os.environ.get("LOCAL_RANK", "0")), fsdp)

    # -- who am I ------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes metrics and checkpoints."""
        return self.rank == 0

    def __repr__(self) -> str:
        how = "fsdp" if self.fsdp else "ddp"
        return f"<DataParallel rank {self.rank}/{self.world_size} {how}>"

    # -- 1. the platform -----------------------------------------------------------------------
    def platform(self, resolve: Callable[[], "Platform"]) -> "Platform":
        """Rank 0's Platform on every rank: rank 0 calls ``resolve()``; the others rebuild its
        ``to_dict()`` with ``Platform.from_dict`` (no plugin discovery).

        :raises PluginLoadError: on a rank whose installed plugins differ from rank 0's.
        """
        if self.world_size == 1:
            return resolve()
        from ..seam.platform import Platform

        platform = resolve() if self.is_main else None
        (frozen,) = self.broadcast_objects([platform.to_dict() if platform is not None else None])
        return platform if platform is not None else Platform.from_dict(frozen)

    # -- 2. sharding ---------------------------------------------------------------------------
    def shard_groups(self, n_groups: int, group_size: int) -> Shard:
        """This rank's share of ``n_groups`` (G) groups of ``group_size`` (K) samples on N ranks.

        Every rank gets the same number of samples *and* of rollout batches, so every rank runs
        the same number of DiT forwards (FSDP all-gathers parameters in each one): if ``K % N ==
        0``, every rank rolls out ``K / N`` members of *every* group (a small step, one prompt of
        K = 8 on 8 GPUs, still spreads over all ranks); else, if ``G % N == 0``, ``G / N`` whole
        groups. Seeds derive from (run seed, step, group, member), never from the rank.

        :raises FlowseamError: when neither ``group_size`` nor ``n_groups`` is a multiple of the
            world size.
        """
        N, G, K = self.world_size, n_groups, group_size
        if K % N == 0:
            return Shard(self, G, K, range(G), range(self.rank * K // N, (self.rank + 1) * K // N))
        if G % N == 0:
            return Shard(self, G, K, range(self.rank * G // N, (self.rank + 1) * G // N), range(K))
        raise FlowseamError(
            f"group_size={K} × prompts_per_step={G} cannot be split evenly over {N} ranks: make "
            f"group_size or prompts_per_step a multiple of {N}")

    def shard_rows(self, n_rows: int, what: str = "batch_size") -> range:
        """This rank's contiguous share of ``n_rows`` rows.

        :raises FlowseamError: if ``n_rows`` is not a multiple of the world size.
        """
        if n_rows % self.world_size:
            raise FlowseamError(f"{what}={n_rows} cannot be split evenly over {self.world_size} "
                                f"ranks: make it a multiple of {self.world_size}")
        per = n_rows // self.world_size
        return range(self.rank * per, (self.rank + 1) * per)

    # -- 3. gathering --------------------------------------------------------------------------
    def sum(self, value: float) -> float:
        """``value`` summed over every rank (float64)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64, device=self._device())
        dist.all_reduce(t)
        return float(t.item())

    def gather_tensor(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``local`` (same shape and dtype on every rank), in rank order, on CPU."""
        if self.world_size == 1:
            return [local]
        import torch.distributed as dist

        local = local.detach().to(self._device()).contiguous()
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(out, local)
        return [t.cpu() for t in out]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (for metrics: small objects only)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_objects(self, objs: list[Any]) -> list[Any]:
        """Rank 0's list of picklable objects, on every rank."""
        if self.world_size == 1:
            return objs
        import torch.distributed as dist

        objs = list(objs)
        dist.broadcast_object_list(objs, src=0)
        return objs

    # -- 4. gradients --------------------------------------------------------------------------
    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module an update runs its forward and backward through.

        One process: ``module`` itself. DDP: a ``DistributedDataParallel`` around it (rank 0's
        weights broadcast to every rank; ``module`` keeps its parameter names, so checkpoints and
        weight syncs read it directly). FSDP2: ``module`` sharded in place with ``fully_shard``,
        each child in an ``nn.ModuleList`` (the DiT's blocks) its own unit; its parameters become
        DTensors (:func:`full_state` reads them whole).
        """
        if self.world_size == 1:
            return module
        if self.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self._device().type, (self.world_size,))
            for blocks in module.children():
                if isinstance(blocks, torch.nn.ModuleList):
                    for block in blocks:
                        fully_shard(block, mesh=mesh)
            # flowseam never modifies a velocity in place, the case this warning is about
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
            return fully_shard(module, mesh=mesh)
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self._device().index] if self._device().type == "cuda" else None
        # buffers are constants in a DiT (rotary tables); broadcasting them would add a
        # collective to every forward
        return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)

    @contextlib.contextmanager
    def accumulate(self, module: torch.nn.Module, sync: bool) -> Iterator[None]:
        """Run one forward and backward of ``module`` (what :meth:`wrap` returned); gradients are
        reduced over ranks only when ``sync`` (the last backward before the optimizer step),
        accumulated locally otherwise."""
        if self.world_size == 1 or sync:
            yield
            return
        if hasattr(module, "no_sync"):  # DDP
            with module.no_sync():
                yield
        elif hasattr(module, "set_requires_gradient_sync"):  # FSDP2
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
        else:
            yield

    # -- 5. checkpoints -------------------------------------------------------------------------
    def checkpoint_views(self, stages: list[Any], gather: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """``({name: module}, {name: optimizer})`` as the checkpoint functions read and fill them:
        the stages' own policies and optimizers, or under FSDP2 whole copies of them — gathered
        from every rank when ``gather`` (a collective: every rank calls it; rank 0 then holds
        the whole trainable parameters and AdamW state, keyed by parameter name, on CPU), else
        empty ones of the whole shapes to load a checkpoint into (then :meth:`restore`)."""
        if not self.fsdp:
            return {s.name: s.policy for s in stages}, {s.name: s.optimizer for s in stages}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        modules, optimizers = {}, {}
        for s in stages:
            if gather:
                weights, optim = get_state_dict(s.policy, s.optimizer, options=StateDictOptions(
                    full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
            else:
                weights = {n: torch.empty(p.shape, dtype=p.dtype) for n, p in s.policy.named_parameters()
                           if p.requires_grad}
                optim = None
            modules[s.name], optimizers[s.name] = _WholeParameters(weights), _WholeOptimizerState(optim)
        return modules, optimizers

    def restore(self, stages: list[Any], modules: dict[str, Any], optimizers: dict[str, Any]) -> None:
        """Under FSDP2, shard what a checkpoint loaded into :meth:`checkpoint_views` (every rank
        loaded the whole state) into each stage's policy and optimizer; nothing otherwise."""
        if not self.fsdp:
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        for s in stages:
            set_state_dict(s.policy, s.optimizer, model_state_dict=modules[s.name].tensors,
                           optim_state_dict=optimizers[s.name].state,
                           options=StateDictOptions(full_state_dict=True, strict=False))

    def _device(self) -> torch.device:
        import torch.distributed as dist

        if torch.cuda.is_available() and dist.get_backend() != "gloo":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


class _WholeParameters:
    """Whole trainable tensors by name, read and filled by the checkpoint functions as a module's
    ``named_parameters()``."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = {n: t.requires_grad_(True) for n, t in tensors.items()}

    def named_parameters(self):
        return iter(self.tensors.items())


class _WholeOptimizerState:
    """A whole (name-keyed) optimizer state dict, saved and loaded as an optimizer's."""

    def __init__(self, state: dict[str, Any] | None) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


#: the ``[distributed]`` config table every method accepts
class DistributedSection(ConfigSection):
    """The ``[distributed]`` table of every method: ``fsdp = true`` shards the trainer (FSDP2)
    instead of replicating it (DDP)."""

    fsdp: bool = False


class ParallelSection(ConfigSection):
    """The ``[parallel]`` table of ``flowgrpo``: split every rollout over the ranks
    (:class:`flowseam.Parallel`: ``sp`` sequence shards, ``cfg`` the two CFG branches on two
    groups), ``sp x (2 if cfg else 1)`` ranks in all, which must be every rank of the run."""

    sp: Annotated[int, Field(ge=1)] = 1
    cfg: bool = False


def data_parallel(config: dict[str, Any]) -> DataParallel:
    """This process's :class:`DataParallel` for a method's ``config`` (its ``[distributed]``
    table: ``fsdp``), before any model loads.

    :raises FlowseamError: for unknown keys, or ``fsdp`` on one process.
    """
    return DataParallel.from_env(**validate_config(DistributedSection, config.get("distributed")))


def full_state(module: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """``module``'s parameters (and buffers) as whole, plain CPU tensors, by name.

    Under FSDP2 every rank must call it (each sharded parameter is all-gathered).
    """
    out = {}
    for name, p in module.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        out[name] = whole(p.detach()).cpu()
    if not trainable_only:
        for name, b in module.named_buffers():
            out[name] = whole(b.detach()).cpu()
    return out


def whole(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from an FSDP2-sharded parameter (an all-gather: every rank calls it);
    any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def state_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of ``tensors``, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # its own bytes, not a copy
    return h.hexdigest()


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
