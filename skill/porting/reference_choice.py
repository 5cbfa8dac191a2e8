"""Which reference a family is copied from, and a check that a copy fits the family."""

from __future__ import annotations

from skill.porting.plan import PortPlan


def choose_reference(profile: PortPlan) -> str:
    """The reference the analyser names for this family (one rule, :func:`reference_for`)."""
    return profile.reference


def check_reference_fits(profile: PortPlan, args_text: str) -> None:
    """Refuse, naming the right reference, a copy the family's edits cannot start from."""
    wanted = choose_reference(profile)
    copied = "qwen3" if "moe_args" in args_text else "qwen2"
    if copied != wanted:
        raise ValueError(
            f"{profile.model_type} must be copied from the {wanted} reference, not {copied}: "
            + (
                "it has MoE, which only qwen3 carries."
                if wanted == "qwen3"
                else "it is dense; qwen3's MoE code would stay behind."
            )
            + f" Run copy_reference(reference={wanted!r}, overwrite=True) first."
        )
