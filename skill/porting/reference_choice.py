"""Which reference a family is copied from, and a check that a copy fits the family."""

from __future__ import annotations

from skill.porting.plan import PortPlan

# Why a family needs its reference, by reference.
_WHY = {
    "deepseek_v3": "it has multi-head latent attention, which only deepseek_v3 carries.",
    "qwen3": "it has MoE, which only qwen3 carries.",
    "qwen2": "it is dense; qwen3's MoE code would stay behind.",
    "qwen3_5": "it has Gated DeltaNet layers beside attention, which only qwen3_5 carries.",
}


def choose_reference(profile: PortPlan) -> str:
    """The reference the analyser names for this family (one rule, :func:`reference_for`)."""
    return profile.reference


def copied_reference(args_text: str) -> str:
    """Which reference an ``args.py`` was copied from, by the fields only that reference has."""
    if "linear_num_value_heads" in args_text:
        return "qwen3_5"
    if "kv_lora_rank" in args_text:
        return "deepseek_v3"
    return "qwen3" if "moe_args" in args_text else "qwen2"


def check_reference_fits(profile: PortPlan, args_text: str) -> None:
    """Refuse, naming the right reference, a copy the family's edits cannot start from."""
    wanted = choose_reference(profile)
    copied = copied_reference(args_text)
    if copied != wanted:
        raise ValueError(
            f"{profile.model_type} must be copied from the {wanted} reference, not {copied}: "
            + _WHY[wanted]
            + f" Run copy_reference(reference={wanted!r}, overwrite=True) first."
        )
