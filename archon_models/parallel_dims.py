"""Parallel degrees of an Archon job and the named device meshes they imply.

The layout follows torchtitan's ``ParallelDims``: the world is one mesh with the
dimensions ``pp, dp_replicate, dp_shard, cp, tp`` (outermost first), and the groups
that span several of those dimensions are flattened sub-meshes with their own
names (``dp_shard_cp`` shards the weights for FSDP, ``dp_cp`` reduces the loss, ...).

With expert parallelism the ``dp_shard`` dimension is split into
``dp_shard_mod_ep`` and ``dp_shard_in_ep``: the experts are split over ``ep``
ranks borrowed from ``dp_shard_in_ep * cp`` (and ``tp`` when ``etp == 1``), and the
expert weights are FSDP-sharded over what is left, ``dp_shard_mod_ep``.

Every dimension is part of the mesh even when its size is 1, so ``get_mesh("tp")``
works in every configuration; a name that does not exist in the configuration
(``"ep"`` without expert parallelism) gives ``None``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger(__name__)

__all__ = ["ArchonParallelDims"]


@dataclass
class ArchonParallelDims:
    """Degrees of data, context, tensor, pipeline and expert parallelism.

    Attributes:
        dp_replicate: HSDP replica groups (weights replicated across them).
        dp_shard: FSDP shard degree; ``-1`` derives it from the others and ``world_size``.
        cp: context parallel degree (Ulysses sequence parallelism).
        tp: tensor parallel degree.
        pp: pipeline parallel degree.
        ep: expert parallel degree; borrows ranks from ``dp_shard * cp`` (and ``tp``
            when ``etp == 1``), so it does not enter the world-size product.
        etp: expert tensor parallel degree: ``1`` (experts not split by TP) or ``tp``.
        world_size: number of processes.
        device_type: device type of the mesh (``"cuda"``, ``"cpu"`` for gloo, ...).

    ``world_size == pp * dp_replicate * dp_shard * cp * tp`` must hold.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    world_size: int = 1
    device_type: str = "cuda"

    _world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------ validation

    def _validate(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp", "ep", "etp", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ArchonParallelDims.{name} must be an integer >= 1, got {value!r}.")
        if (
            isinstance(self.dp_shard, bool)
            or not isinstance(self.dp_shard, int)
            or (self.dp_shard < 1 and self.dp_shard != -1)
        ):
            raise ValueError(
                f"ArchonParallelDims.dp_shard must be an integer >= 1, or -1 to derive it from "
                f"world_size, got {self.dp_shard!r}."
            )

        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ValueError(
                    f"Cannot derive dp_shard: world_size ({self.world_size}) is not divisible by "
                    f"pp * dp_replicate * cp * tp = {self.pp} * {self.dp_replicate} * {self.cp} * "
                    f"{self.tp} = {others}. Choose degrees whose product divides world_size."
                )
            self.dp_shard = self.world_size // others

        product = others * self.dp_shard
        if product != self.world_size:
            raise ValueError(
                f"pp * dp_replicate * dp_shard * cp * tp = {self.pp} * {self.dp_replicate} * "
                f"{self.dp_shard} * {self.cp} * {self.tp} = {product} must equal world_size "
                f"({self.world_size}). Set dp_shard=-1 to derive it, or change the degrees."
            )

        if self.etp not in (1, self.tp):
            raise ValueError(f"etp ({self.etp}) must be 1 (experts not split by TP) or equal to tp ({self.tp}).")

        if self.ep > 1:
            # The ranks EP may borrow: dp_shard * cp, plus tp when TP does not split experts.
            borrowable = self.dp_shard * self.cp * (self.tp if self.etp == 1 else 1)
            inner = self.cp * (self.tp if self.etp == 1 else 1)
            if borrowable % self.ep != 0 or self.ep % inner != 0:
                tp_part = " * tp" if self.etp == 1 else ""
                raise ValueError(
                    f"ep ({self.ep}) must divide dp_shard * cp{tp_part} = {borrowable} and be a "
                    f"multiple of cp{tp_part} = {inner} (dp_shard={self.dp_shard}, cp={self.cp}, "
                    f"tp={self.tp}, etp={self.etp}). Pick ep from the divisors of {borrowable} "
                    f"that are multiples of {inner}."
                )

    # --------------------------------------------------------------------- flags

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate_enabled or self.dp_shard_enabled

    @property
    def dp_cp_enabled(self) -> bool:
        """Data or context parallel: the loss needs an all-reduce over ``dp_cp``."""
        return self.dp_enabled or self.cp_enabled

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over ``dp_shard * cp``: CP ranks hold the same weights, so they shard them."""
        return self.dp_shard_enabled or self.cp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    # --------------------------------------------------------------- derived sizes

    @property
    def dp_shard_in_ep(self) -> int:
        """The part of ``dp_shard`` that EP borrows (1 without EP)."""
        if not self.ep_enabled:
            return 1
        return self.ep // (self.cp * (self.tp if self.etp == 1 else 1))

    @property
    def dp_shard_mod_ep(self) -> int:
        """The part of ``dp_shard`` left for FSDP-sharding expert weights."""
        return self.dp_shard // self.dp_shard_in_ep

    @property
    def fsdp_gradient_divide_factor(self) -> int:
        """Gradients average over every rank that sees different data: ``dp * cp``."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def seq_len_divisor(self) -> int:
        """Packed lengths must be multiples of this (TP and CP split the sequence; x2 as AReaL)."""
        return self.tp * self.cp * 2

    @property
    def context_and_model_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    # -------------------------------------------------------------------- meshes

    def _base_dims(self) -> list[tuple[str, int]]:
        if self.ep_enabled:
            return [
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                ("dp_shard_mod_ep", self.dp_shard_mod_ep),
                ("dp_shard_in_ep", self.dp_shard_in_ep),
                ("cp", self.cp),
                ("tp", self.tp),
            ]
        return [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("tp", self.tp),
        ]

    def _flattened_dims(self) -> dict[str, tuple[str, ...]]:
        shard = ("dp_shard_mod_ep", "dp_shard_in_ep") if self.ep_enabled else ("dp_shard",)
        flat: dict[str, tuple[str, ...]] = {
            "dp": ("dp_replicate", *shard),
            "dp_shard_cp": (*shard, "cp"),
            "dp_cp": ("dp_replicate", *shard, "cp"),
            "pp_cp_tp": ("pp", "cp", "tp"),
        }
        if self.ep_enabled:
            flat["dp_shard"] = shard
            flat["ep"] = ("dp_shard_in_ep", "cp", "tp") if self.etp == 1 else ("dp_shard_in_ep", "cp")
        return flat

    def build_mesh(self) -> DeviceMesh:
        """Create the world mesh and its named sub-meshes; needs an initialised process group."""
        if not dist.is_initialized():
            raise RuntimeError(
                "ArchonParallelDims.build_mesh needs torch.distributed to be initialised "
                "(call torch.distributed.init_process_group first)."
            )
        actual = dist.get_world_size()
        if actual != self.world_size:
            raise ValueError(
                f"ArchonParallelDims.world_size is {self.world_size} but the process group has "
                f"{actual} ranks. Pass world_size=torch.distributed.get_world_size()."
            )
        dims = self._base_dims()
        names = tuple(name for name, _ in dims)
        world_mesh = init_device_mesh(self.device_type, tuple(size for _, size in dims), mesh_dim_names=names)
        meshes: dict[str, DeviceMesh] = {name: world_mesh[name] for name in names}
        for flat_name, parts in self._flattened_dims().items():
            meshes[flat_name] = world_mesh[parts]._flatten(mesh_dim_name=flat_name)
        if self.ep_enabled and self.etp_enabled:
            # 2D [ep, tp] mesh for ExpertTensorParallel: ep is (dp_shard_in_ep, cp) here.
            meshes["ep_tp"] = world_mesh[("ep", "tp")]
        self._world_mesh = world_mesh
        self._meshes = meshes
        logger.info(
            "Built device mesh %s with dims %s",
            self.device_type,
            ", ".join(f"{n}={s}" for n, s in dims),
        )
        return world_mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        """The world mesh, built on first use."""
        if self._world_mesh is None:
            self.build_mesh()
        assert self._world_mesh is not None
        return self._world_mesh

    def get_mesh(self, name: str) -> DeviceMesh | None:
        """The sub-mesh called ``name``, or ``None`` if this configuration has none."""
        if self._world_mesh is None:
            self.build_mesh()
        return self._meshes.get(name)

    def get_group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of the 1-D sub-mesh called ``name``, or ``None``."""
        mesh = self.get_mesh(name)
        if mesh is None:
            return None
        if mesh.ndim != 1:
            raise ValueError(f"Mesh {name!r} has {mesh.ndim} dimensions; get_group needs a 1-D mesh.")
        return mesh.get_group()

    @property
    def mesh_names(self) -> tuple[str, ...]:
        """Every name ``get_mesh`` answers in this configuration (after building)."""
        return tuple(self._meshes)
