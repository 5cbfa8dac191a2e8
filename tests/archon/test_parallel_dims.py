"""ArchonParallelDims: validation, flags, derived sizes, and the meshes it builds on gloo."""

from __future__ import annotations

import pytest

from archon_models.parallel_dims import ArchonParallelDims
from skill.harness.distributed import launch


def test_dp_shard_is_derived_from_world_size():
    dims = ArchonParallelDims(tp=2, pp=2, world_size=8)
    assert dims.dp_shard == 2
    assert (dims.dp_replicate, dims.cp, dims.ep, dims.etp) == (1, 1, 1, 1)


@pytest.mark.parametrize(
    ("kwargs", "flags"),
    [
        (dict(world_size=1), set()),
        (dict(dp_shard=2, world_size=2), {"dp_enabled", "dp_shard_enabled", "fsdp_enabled", "dp_cp_enabled"}),
        (dict(tp=2, world_size=2), {"tp_enabled"}),
        # CP ranks hold the same weights, so they shard them: FSDP is on with cp > 1.
        (dict(cp=2, world_size=2), {"cp_enabled", "fsdp_enabled", "dp_cp_enabled"}),
        (dict(pp=2, world_size=2), {"pp_enabled"}),
        (
            dict(dp_replicate=2, dp_shard=2, world_size=4),
            {"dp_enabled", "dp_replicate_enabled", "dp_shard_enabled", "fsdp_enabled", "dp_cp_enabled"},
        ),
        (
            dict(ep=2, world_size=2),
            {"ep_enabled", "dp_enabled", "dp_shard_enabled", "fsdp_enabled", "dp_cp_enabled"},
        ),
        (
            dict(tp=2, ep=2, etp=2, world_size=4),
            {
                "tp_enabled",
                "ep_enabled",
                "etp_enabled",
                "dp_enabled",
                "dp_shard_enabled",
                "fsdp_enabled",
                "dp_cp_enabled",
            },
        ),
    ],
)
def test_enabled_flags(kwargs, flags):
    dims = ArchonParallelDims(device_type="cpu", **kwargs)
    all_flags = {
        "dp_enabled",
        "dp_replicate_enabled",
        "dp_shard_enabled",
        "dp_cp_enabled",
        "fsdp_enabled",
        "cp_enabled",
        "tp_enabled",
        "pp_enabled",
        "ep_enabled",
        "etp_enabled",
    }
    assert {f for f in all_flags if getattr(dims, f)} == flags


def test_derived_sizes():
    dims = ArchonParallelDims(dp_shard=2, cp=2, tp=2, world_size=8)
    assert dims.fsdp_gradient_divide_factor == 4
    assert dims.seq_len_divisor == 8
    assert dims.context_and_model_parallel_size == 4
    # EP borrows dp_shard_in_ep * cp * tp ranks (etp == 1): 4 / (2 * 2) = 1 of dp_shard.
    ep = ArchonParallelDims(dp_shard=2, cp=1, tp=2, ep=2, world_size=4)
    assert (ep.dp_shard_in_ep, ep.dp_shard_mod_ep) == (1, 2)
    # With etp == tp, TP stays out of EP: EP takes 2 of dp_shard.
    etp = ArchonParallelDims(dp_shard=2, tp=2, ep=2, etp=2, world_size=4)
    assert (etp.dp_shard_in_ep, etp.dp_shard_mod_ep) == (2, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp=0, world_size=2), "tp must be an integer >= 1"),
        (dict(dp_shard=0, world_size=2), "dp_shard must be an integer >= 1, or -1"),
        (dict(tp=3, world_size=4), "Cannot derive dp_shard"),
        (dict(dp_shard=2, tp=2, world_size=2), r"must equal world_size \(2\)"),
        (dict(tp=2, etp=3, world_size=2), r"etp \(3\) must be 1 .* or equal to tp \(2\)"),
        (dict(ep=3, world_size=2), r"ep \(3\) must divide dp_shard \* cp \* tp = 2"),
        # etp == tp keeps TP out of EP, so only dp_shard * cp = 1 rank is left to borrow.
        (dict(tp=2, ep=2, etp=2, world_size=2), r"ep \(2\) must divide dp_shard \* cp = 1"),
        (dict(tp=True, world_size=2), "tp must be an integer"),
    ],
)
def test_bad_sizes_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArchonParallelDims(**kwargs)


def test_build_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ArchonParallelDims(world_size=1, device_type="cpu").build_mesh()


_CONFIGS = {
    "tp": dict(tp=2),
    "dp_shard": dict(dp_shard=2),
    "cp": dict(cp=2),
    "pp": dict(pp=2),
    "ep": dict(ep=2),
}


def _mesh_layouts(rank: int, world_size: int) -> dict[str, dict[str, list]]:
    """Every named mesh of every configuration, as rank lists."""
    layouts: dict[str, dict[str, list]] = {}
    for label, kwargs in _CONFIGS.items():
        dims = ArchonParallelDims(world_size=world_size, device_type="cpu", **kwargs)
        dims.build_mesh()
        layouts[label] = {name: dims.get_mesh(name).mesh.tolist() for name in dims.mesh_names}
        layouts[label]["missing"] = [dims.get_mesh("ep_tp") is None]
        layouts[label]["tp_group_size"] = [dims.get_group("tp").size()]
    return layouts


def test_meshes_on_two_gloo_ranks():
    per_rank = launch(_mesh_layouts, world_size=2, timeout_s=120)
    for rank, layouts in enumerate(per_rank):
        both, alone = [0, 1], [rank]
        assert layouts["tp"]["tp"] == both and layouts["tp"]["dp_shard_cp"] == alone
        assert layouts["tp"]["tp_group_size"] == [2]
        assert layouts["dp_shard"]["dp_shard_cp"] == both and layouts["dp_shard"]["tp"] == alone
        assert layouts["dp_shard"]["dp"] == both
        # FSDP shards over dp_shard * cp, the loss reduces over dp * cp.
        assert layouts["cp"]["cp"] == both and layouts["cp"]["dp_shard_cp"] == both
        assert layouts["cp"]["dp_cp"] == both and layouts["cp"]["dp"] == alone
        assert layouts["pp"]["pp"] == both and layouts["pp"]["pp_cp_tp"] == both
        # EP borrows the two dp_shard ranks; experts are FSDP-sharded over what is left (one rank).
        assert layouts["ep"]["ep"] == both and layouts["ep"]["dp_shard_in_ep"] == both
        assert layouts["ep"]["dp_shard_mod_ep"] == alone and layouts["ep"]["dp_shard_cp"] == both
        assert "ep" not in layouts["tp"]
        assert all(layouts[label]["missing"] == [True] for label in _CONFIGS)
