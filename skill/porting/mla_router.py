"""An MoE family on the deepseek_v3 (MLA) reference whose router is not DeepSeek-V3's.

The reference routes by sigmoid scores, a score-correction bias (the saved ``expert_bias``
of its ``CorrectionBiasMoE``, fixed unless ``load_balance_coeff`` opts into balancing it),
groups scored by the sum of their two best experts and renormalisation by ``norm_topk_prob``.
The analysis measures each of these on HF's own MoE block; this module rewrites the copied
args' ``_moe_args`` (and the adapter's bias entry) so the package routes as the family does,
still in AReaL's ``MoEArgs`` terms:

- softmax scores: ``score_func="softmax"`` (AReaL's router: softmax over every expert, then
  the top-k of those probabilities);
- no score-correction bias: no ``load_balance_coeff`` opt-in, and no checkpoint key for it
  (``model_edits.no_correction_bias`` builds AReaL's MoE instead);
- a ``norm_topk_prob`` the forward never reads: ``route_norm`` fixed at what HF does;
- a group limit switched on by a config value (``topk_method="group_limited_greedy"``):
  groups only under that value, any value HF does not implement refused.

A group scored by its best expert is the package's router (``model_edits.max_group_router``,
``snippets/router.py MaxGroupTopKRouter``); ``num_expert_groups`` / ``num_limited_groups`` keep
AReaL's meaning. Each rewrite names the reference text it replaces and fails when the copy does
not hold it, so a changed reference is caught here. Applied twice, nothing changes.
"""

from __future__ import annotations

import textwrap

from skill.codemod.cst import (
    CodemodError,
    Document,
    prune_unused_imports,
    replace_in_function,
    replace_text,
)
from skill.porting.plan import PortPlan

# The reference's group count and MoEArgs construction, as _moe_args holds them.
_REFERENCE_GROUPS = 'n_group = getattr(hf_config, "n_group", None) or 1'
_REFERENCE_RETURN = """return MoEArgs(
    num_experts=int(num_experts),
    num_shared_experts=int(getattr(hf_config, "n_shared_experts", None) or 0),
    top_k=int(hf_config.num_experts_per_tok),
    score_func="sigmoid",
    route_norm=bool(getattr(hf_config, "norm_topk_prob", False)),
    route_scale=float(getattr(hf_config, "routed_scaling_factor", None) or 1.0),
    # HF computes the router GEMM in fp32 whatever the model dtype.
    router_dtype=router_dtype if router_dtype is not None else torch.float32,
    num_expert_groups=int(n_group) if n_group > 1 else None,
    num_limited_groups=int(topk_group) if n_group > 1 else None,
    # None: the checkpoint's bias stays as loaded; a value opts into balancing it.
    load_balance_coeff=load_balance_coeff,
)"""
# from_hf_config's docstring on the keywords, with the balancing opt-in (the reference's) and without.
BALANCING_KWARGS_DOC = """(outputs of a critic's ``score`` head, default 1), ``router_dtype`` (dtype of the
        router GEMM; ``None`` keeps HF's fp32) and ``load_balance_coeff`` (opts into
        auxiliary-loss-free balancing of the score-correction bias, AReaL's
        ``MoEArgs.load_balance_coeff``; by default the checkpoint's bias stays fixed in
        training). Any other keyword is ignored, as AReaL's own ``from_hf_config`` ignores
        it. ``eos_token_id`` of ``None`` keeps the default; a list takes its first id."""
_NO_BALANCING_KWARGS_DOC = """(outputs of a critic's ``score`` head, default 1) and ``router_dtype`` (dtype of
        the router GEMM; ``None`` keeps HF's fp32). Any other keyword is ignored, as
        AReaL's own ``from_hf_config`` ignores it. ``eos_token_id`` of ``None`` keeps the
        default; a list takes its first id."""
# The balancing opt-in: _moe_args' parameter, and from_hf_config's call passing it on.
_REFERENCE_SIGNATURE = (
    "def _moe_args(hf_config: Any, router_dtype: torch.dtype | None, load_balance_coeff: float | None)"
    " -> MoEArgs | None:"
)
_NO_BALANCING_SIGNATURE = "def _moe_args(hf_config: Any, router_dtype: torch.dtype | None) -> MoEArgs | None:"
REFERENCE_CALL = '_moe_args(hf_config, kwargs.get("router_dtype"), kwargs.get("load_balance_coeff"))'
_NO_BALANCING_CALL = '_moe_args(hf_config, kwargs.get("router_dtype"))'
_REFERENCE_DOC = '''"""DeepSeek-V3 routing in AReaL's ``MoEArgs`` terms; ``None`` when the config has no routed experts.

    Sigmoid scores; the score-correction bias (``expert_bias``) shifts which experts are
    chosen, not their weights; the best ``topk_group`` of ``n_group`` groups (each scored
    by its two best experts) compete; the chosen scores are renormalised when
    ``norm_topk_prob`` and then multiplied by ``routed_scaling_factor``. One group is no
    limit at all, so it needs no grouping.
    """'''
_REFERENCE_CHECK_TAIL = 'if getattr(hf_config, "attention_dropout", 0.0):'


_REQUIRED_MOE_LINE = '_REQUIRED_MOE_HF_FIELDS = ("moe_intermediate_size", "num_experts_per_tok")\n'
# Config fields HF's forward never reads, though their names suggest an args field does
# (stage 1 checks the args field stays put when such a field changes).
_UNREAD_FIELDS = (
    "# HF's router never reads norm_topk_prob (moe_args.route_norm does not follow it).\n"
    '_UNREAD_HF_FIELDS = ("norm_topk_prob",)\n'
)


def _swap(text: Document, reference: str, new: str, what: str) -> Document:
    """``text`` with the reference's ``reference`` replaced by ``new`` (already replaced: unchanged)."""
    if reference in text:
        return replace_text(text, reference, new, 1)
    if new in text:
        return text
    raise CodemodError(f"the copied args do not hold the reference's {what}: the deepseek_v3 reference changed.")


def differs_from_reference(plan: PortPlan) -> bool:
    """Whether the family routes otherwise than the deepseek_v3 reference's ``_moe_args`` does."""
    return (
        plan.router_scoring != "sigmoid"
        or plan.score_correction_key is None
        or plan.route_norm_fixed is not None
        or plan.expert_group_switch is not None
        or plan.group_scoring != "sum_top2"
    )


def _return_statement(plan: PortPlan) -> str:
    lines = [
        "return MoEArgs(",
        "    num_experts=int(num_experts),",
        '    num_shared_experts=int(getattr(hf_config, "n_shared_experts", None) or 0),',
        "    top_k=int(hf_config.num_experts_per_tok),",
        f'    score_func="{plan.router_scoring}",',
    ]
    if plan.route_norm_fixed is not None:
        lines += [
            "    # HF's router never reads norm_topk_prob: the chosen weights are"
            + (" always renormalised." if plan.route_norm_fixed else " never renormalised."),
            f"    route_norm={plan.route_norm_fixed},",
        ]
    else:
        lines.append('    route_norm=bool(getattr(hf_config, "norm_topk_prob", False)),')
    lines += [
        '    route_scale=float(getattr(hf_config, "routed_scaling_factor", None) or 1.0),',
        "    # HF computes the router GEMM in fp32 whatever the model dtype.",
        "    router_dtype=router_dtype if router_dtype is not None else torch.float32,",
        "    num_expert_groups=int(n_group) if n_group > 1 else None,",
        "    num_limited_groups=int(topk_group) if n_group > 1 else None,",
    ]
    if plan.score_correction_key is not None:
        lines += [
            "    # None: the checkpoint's bias stays as loaded; a value opts into balancing it.",
            "    load_balance_coeff=load_balance_coeff,",
        ]
    return "\n".join([*lines, ")"])


def _docstring(plan: PortPlan) -> str:
    scores = (
        "Softmax over every expert's logit; the top-k of those probabilities"
        if plan.router_scoring == "softmax"
        else "Sigmoid scores; the top-k of them"
    )
    parts = [f"Routing in AReaL's ``MoEArgs`` terms; ``None`` when the config has no routed experts.\n\n{scores}"]
    if plan.score_correction_key is not None:
        parts.append(", chosen after the score-correction bias (``expert_bias``) shifts the scores (not the weights)")
    if plan.route_norm_fixed is None:
        parts.append(", renormalised when ``norm_topk_prob``")
    elif plan.route_norm_fixed:
        parts.append(", always renormalised (HF never reads ``norm_topk_prob``)")
    else:
        parts.append(", never renormalised (HF never reads ``norm_topk_prob``)")
    parts.append(", then multiplied by ``routed_scaling_factor``.")
    rule = "its best expert" if plan.group_scoring == "max" else "the sum of its two best experts"
    if plan.expert_group_switch is not None:
        field, value = plan.expert_group_switch
        parts.append(
            f" With ``{field}={value!r}`` only the best ``topk_group`` of ``n_group`` groups (each"
            f" scored by {rule}) compete; otherwise every expert does."
        )
    else:
        parts.append(
            f" Only the best ``topk_group`` of ``n_group`` groups (each scored by {rule}) compete;"
            " one group is no limit at all, so it needs no grouping."
        )
    return "".join(parts)


def _docstring_statement(plan: PortPlan) -> str:
    """``_moe_args``' docstring as a statement of its body (wrapped, body-relative indentation)."""
    summary, _, rest = _docstring(plan).partition("\n\n")
    lines = textwrap.wrap(rest, width=88, break_on_hyphens=False)
    return '"""' + summary + "\n\n" + "".join(f"    {line}\n" for line in lines) + '    """'


def _switch_check(plan: PortPlan) -> str:
    assert plan.expert_group_switch is not None
    field, _ = plan.expert_group_switch
    values = tuple(plan.expert_group_switch_values)
    return (
        f'if getattr(hf_config, "{field}", None) not in {values!r}:\n'
        "    raise ValueError(\n"
        f"        f\"{field}={{getattr(hf_config, '{field}', None)!r}} is not supported; HF implements \"\n"
        f'        "{" and ".join(repr(v) for v in values)}."\n'
        "    )\n"
        f"{_REFERENCE_CHECK_TAIL}\n"
        '    logger.warning("attention_dropout=%s is ignored: Archon models apply no dropout.", '
        "hf_config.attention_dropout)"
    )


# Where the reference reads the routed-expert count (in _moe_args and from_hf_config).
_REFERENCE_COUNT = 'getattr(hf_config, "n_routed_experts", None)'


def router_args(text: Document, plan: PortPlan, camel: str) -> Document:
    """The copied deepseek_v3 args' ``_moe_args`` routing as the family's (see the module doc),
    the routed experts counted by the family's own config field."""
    if plan.moe and plan.expert_count_source not in (None, "n_routed_experts"):
        family_count = f'getattr(hf_config, "{plan.expert_count_source}", None)'
        if _REFERENCE_COUNT in text:
            text = replace_text(text, _REFERENCE_COUNT, family_count)
        elif family_count not in text:
            raise CodemodError("the copied args do not read n_routed_experts: the deepseek_v3 reference changed.")
    if not plan.moe or not differs_from_reference(plan):
        return text
    if "def _moe_args(" not in text:
        raise CodemodError("the copied args hold no _moe_args: the deepseek_v3 reference changed.")
    text = replace_in_function(text, None, "_moe_args", _REFERENCE_RETURN, _return_statement(plan))
    if plan.expert_group_switch is not None:
        field, value = plan.expert_group_switch
        text = replace_in_function(
            text,
            None,
            "_moe_args",
            _REFERENCE_GROUPS,
            f"# Only {field}={value!r} limits the choice to the best groups; HF's\n"
            f"# other {field} takes the top-k of every expert.\n"
            f'grouped = hf_config.{field} == "{value}"\n'
            f'n_group = (getattr(hf_config, "n_group", None) or 1) if grouped else 1',
        )
        if f'getattr(hf_config, "{field}", None) not in' not in text:  # the refusal, once
            text = replace_in_function(
                text,
                None,
                "_check_supported",
                _REFERENCE_CHECK_TAIL
                + '\n    logger.warning("attention_dropout=%s is ignored: Archon models apply no dropout.", '
                "hf_config.attention_dropout)",
                _switch_check(plan),
            )
    if plan.route_norm_fixed is not None and _UNREAD_FIELDS not in text:
        if _REQUIRED_MOE_LINE not in text:
            raise CodemodError("the copied args do not hold the reference's _REQUIRED_MOE_HF_FIELDS.")
        text = replace_text(text, _REQUIRED_MOE_LINE, _REQUIRED_MOE_LINE + _UNREAD_FIELDS, 1)
    if plan.score_correction_key is None:
        # No score-correction bias: nothing to balance, so no opt-in for it.
        text = _swap(text, _REFERENCE_SIGNATURE, _NO_BALANCING_SIGNATURE, "_moe_args' signature")
        text = _swap(text, REFERENCE_CALL, _NO_BALANCING_CALL, "from_hf_config's call of _moe_args")
        text = _swap(text, BALANCING_KWARGS_DOC, _NO_BALANCING_KWARGS_DOC, "from_hf_config's docstring")
    # The copy names the family where the reference's docstring names DeepSeek-V3.
    reference_doc = _REFERENCE_DOC.replace("DeepSeek-V3", camel, 1)
    text = replace_in_function(text, None, "_moe_args", reference_doc, _docstring_statement(plan))
    if _return_statement(plan).splitlines()[4].strip() not in text:
        raise CodemodError("the copied _moe_args does not hold the reference's MoEArgs call.")
    return prune_unused_imports(text)


# The adapter's score-correction bias: its map entry and the docstring sentence naming it.
CORRECTION_BIAS_TARGET = ".moe.expert_bias"
_ADAPTER_BIAS_TEXT = (
    "-> ``kv_norm``, ...); the router's ``e_score_correction_bias`` is the MoE's\n"
    "``expert_bias`` buffer. Published checkpoints also hold"
)
_ADAPTER_NO_BIAS_TEXT = "-> ``kv_norm``, ...). Published checkpoints may also hold"


def no_correction_bias_adapter(text: Document) -> Document:
    """The deepseek_v3 adapter's docstring without the score-correction bias (the map entry
    goes with :func:`is_correction_bias_entry`)."""
    if _ADAPTER_BIAS_TEXT in text:
        return replace_text(text, _ADAPTER_BIAS_TEXT, _ADAPTER_NO_BIAS_TEXT, 1)
    if _ADAPTER_NO_BIAS_TEXT in text:
        return text
    raise CodemodError("the copied adapter does not name the reference's score-correction bias.")


def is_correction_bias_entry(archon_target: str | None) -> bool:
    """The ``from_hf_map`` entry of the router's score-correction bias."""
    return archon_target is not None and archon_target.endswith(CORRECTION_BIAS_TARGET)
