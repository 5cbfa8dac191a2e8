"""Stage 1: ``from_hf_config`` reads every field from the right config attribute.

The expected mapping is derived from the config, not written per family: each Archon
args field has a source in a shared vocabulary (the Archon naming convention: ``dim``
comes from ``hidden_size``, ``norm_eps`` from ``rms_norm_eps`` ...), and a field the
vocabulary does not know is expected to follow the config attribute of the same name.
A matching value alone can be a coincidence (a tiny config and a wrong attribute can
agree), so every source attribute is also perturbed: the field must follow it, unless HF's
own model does not follow it either. That is measured, not assumed: a config class may carry
an attribute its model never reads (transformers 5.25's Falcon sets ``num_key_value_heads``
for the KV cache while its attention reads ``multi_query`` and ``num_kv_heads``), and a field
that stays put is then right.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import PretrainedConfig

if TYPE_CHECKING:
    from archon_models.base import BaseModelArgs

from skill.harness.case import ModelCase
from skill.harness.models import build_hf_config, build_hf_model, get_spec
from skill.harness.results import CheckResult, StageRecorder, StageResult, run_stage


@dataclass(frozen=True)
class FieldSource:
    """Where an args field comes from.

    ``attrs`` are config attribute paths tried in order (``"a.b"`` is key ``b`` of the
    dict attribute ``a``, as in v5 ``rope_parameters.rope_theta``); ``derive`` gives the
    expected value when none of them is present; ``normalize`` turns the attribute's
    value into the field's (a list of EOS ids gives the first).
    """

    attrs: tuple[str, ...]
    derive: Callable[[PretrainedConfig], Any] | None = None
    normalize: Callable[[Any], Any] | None = None


def _first_id(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value


def _derived_head_dim(config: PretrainedConfig) -> int:
    return config.hidden_size // config.num_attention_heads


def _derived_kv_heads(config: PretrainedConfig) -> int:
    """KV heads of a config without ``num_key_value_heads``: one under multi-query
    attention (Falcon's ``multi_query`` without its new decoder architecture), else all."""
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1
    return config.num_attention_heads


# Archon field (the last component of a nested path such as ``moe_args.top_k``) ->
# its source. Shared by every family; extend it when a new family brings a new name.
ARGS_FIELD_SOURCES: dict[str, FieldSource] = {
    "dim": FieldSource(("hidden_size",)),
    "n_layers": FieldSource(("num_hidden_layers",)),
    "n_heads": FieldSource(("num_attention_heads",)),
    "n_kv_heads": FieldSource(("num_key_value_heads",), derive=_derived_kv_heads),
    "vocab_size": FieldSource(("vocab_size",)),
    "head_dim": FieldSource(("head_dim",), derive=_derived_head_dim),
    "hidden_dim": FieldSource(("intermediate_size", "ffn_hidden_size")),
    "norm_eps": FieldSource(("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")),
    "rope_theta": FieldSource(("rope_parameters.rope_theta", "rope_theta")),
    "max_seq_len": FieldSource(("max_position_embeddings",)),
    "eos_id": FieldSource(("eos_token_id",), normalize=_first_id),
    "enable_weight_tying": FieldSource(("tie_word_embeddings",)),
    "pad_id": FieldSource(("pad_token_id",)),
    "num_experts": FieldSource(("num_experts", "num_local_experts", "n_routed_experts")),
    "top_k": FieldSource(("num_experts_per_tok",)),
    "route_norm": FieldSource(("norm_topk_prob",)),
    "route_scale": FieldSource(("routed_scaling_factor",)),
    "num_shared_experts": FieldSource(("num_shared_experts", "n_shared_experts")),
    "moe_inter_dim": FieldSource(("moe_intermediate_size",)),
    "sliding_window": FieldSource(("sliding_window",)),
}

# Set by the caller of from_hf_config, not read from the config.
CALLER_FIELDS = frozenset({"attn_type", "is_critic", "num_labels"})

_MISSING = object()


def _get_path(config: PretrainedConfig, path: str) -> Any:
    head, _, key = path.partition(".")
    value = getattr(config, head, _MISSING)
    if key and value is not _MISSING:
        return value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
    return value


def _set_path(config: PretrainedConfig, path: str, value: Any) -> None:
    head, _, key = path.partition(".")
    if key:
        updated = dict(getattr(config, head))
        updated[key] = value
        setattr(config, head, updated)
    else:
        setattr(config, head, value)


def _perturbations(value: Any) -> list[Any]:
    """Different values of the same kind to try in order (a config validator may reject
    some, e.g. a head count that no longer divides the hidden size)."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [v for v in (value + 1, value * 2, value // 2) if v != value and v > 0]
    if isinstance(value, float):
        return [value * 2 if value else 0.5]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [[*value, max(value, default=-1) + 1]]
    return []


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(actual, tuple | list) and isinstance(expected, tuple | list):
        return list(actual) == list(expected)
    if isinstance(expected, float) or isinstance(actual, float):
        try:
            return float(actual) == float(expected)
        except (TypeError, ValueError):
            return False
    return actual == expected


def iter_args_fields(args: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of every field, descending into nested dataclasses (``moe_args``)."""
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        path = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from iter_args_fields(value, prefix=f"{path}.")
        else:
            yield path, value


def _read_path(args: Any, path: str) -> Any:
    for part in path.split("."):
        args = getattr(args, part, _MISSING) if args is not None else _MISSING
    return args


def source_for(field_path: str, config: PretrainedConfig) -> FieldSource | None:
    """The source of a field: the vocabulary, else a config attribute of the same name."""
    leaf = field_path.rsplit(".", 1)[-1]
    if leaf in CALLER_FIELDS:
        return None
    if leaf in ARGS_FIELD_SOURCES:
        return ARGS_FIELD_SOURCES[leaf]
    if _get_path(config, leaf) is not _MISSING:
        return FieldSource((leaf,))
    return None


def leaf_of(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def hf_norms_eps(config: PretrainedConfig) -> float | None:
    """The one epsilon every norm of the HF model built from ``config`` holds (on the meta
    device: no memory), or ``None`` when they differ or none is found."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    values = {
        value
        for module in model.modules()
        if "norm" in type(module).__name__.lower()
        for value in [getattr(module, "eps", getattr(module, "variance_epsilon", None))]
        if isinstance(value, float)
    }
    return values.pop() if len(values) == 1 else None


def hf_renormalises_regardless(case: ModelCase, config: PretrainedConfig) -> bool:
    """Whether HF's router, on the tiny model of ``config``, renormalises its top-k weights
    with ``norm_topk_prob=False`` too (Cohere2-MoE's softmax over the top-k logits): the
    field is then not the source of ``route_norm``, which must stay True."""
    if not isinstance(getattr(config, "norm_topk_prob", None), bool):
        return False
    from skill.analysis.modules import anatomy, layer_has_experts
    from skill.analysis.probes import probe_renormalises_without_field

    model = build_hf_model(case, config)
    layer = next((layer for layer in anatomy(model, config.num_hidden_layers).layers if layer_has_experts(layer)), None)
    top_k = next((getattr(config, n) for n in ("num_experts_per_tok", "moe_topk", "top_k") if hasattr(config, n)), 0)
    if layer is None or not isinstance(top_k, int):
        return False
    return bool(probe_renormalises_without_field(model, layer, config, top_k))


def hf_ties_regardless(case: ModelCase, config: PretrainedConfig) -> bool | None:
    """What HF's tiny model of ``config`` does with its LM head whatever ``tie_word_embeddings``
    says: ``True`` (it is the embedding either way), ``False`` (a head of its own either way:
    remote code that defines no tying), ``None`` when it follows the field."""
    from skill.analysis.probes import probe_head_is_embedding

    outcomes = []
    for value in (True, False):
        changed = copy.deepcopy(config)
        changed.tie_word_embeddings = value
        outcomes.append(probe_head_is_embedding(build_hf_model(case, changed)))
    if outcomes[0] is None or outcomes[0] != outcomes[1]:
        return None
    return outcomes[0]


class HFReads:
    """Whether HF's tiny model of ``config`` reads a config attribute, measured once per
    attribute: the attribute is perturbed and the model built again from the same seed. It
    reads it when the constructor rejects every other value, when the parameters change
    shape, or when, with the original weights loaded, the logits of a fixed token sequence
    change. Whether a model reads an attribute is a property of its code, not of the sizes,
    so the tiny model's answer holds for the config class's defaults too."""

    def __init__(self, case: ModelCase, config: PretrainedConfig) -> None:
        self._case = case
        self._config = config
        self._measured: dict[str, bool] = {}

    def __call__(self, attr: str) -> bool:
        if attr not in self._measured:
            self._measured[attr] = self._measure(attr)
        return self._measured[attr]

    def _measure(self, attr: str) -> bool:
        import torch

        value = _get_path(self._config, attr)
        if value is _MISSING:
            return True
        base = build_hf_model(self._case, self._config)
        tokens = torch.arange(8).remainder(self._config.vocab_size).unsqueeze(0)
        with torch.no_grad():
            expected = base(input_ids=tokens).logits
        weights = base.state_dict()
        for new_value in _perturbations(value):
            changed = copy.deepcopy(self._config)
            _set_path(changed, attr, new_value)
            try:
                other = build_hf_model(self._case, changed)
            except Exception:  # a constructor rejecting the value has read it
                continue
            shapes = {name: tensor.shape for name, tensor in other.state_dict().items()}
            if shapes != {name: tensor.shape for name, tensor in weights.items()}:
                return True
            other.load_state_dict(weights)
            with torch.no_grad():
                return not torch.equal(other(input_ids=tokens).logits, expected)
        return True


def check_args_against_config(
    rec: StageRecorder,
    config: PretrainedConfig,
    label: str,
    renormalises_regardless: bool = False,
    ties_regardless: bool | None = None,
    hf_reads: Callable[[str], bool] | None = None,
) -> None:
    """One check per args field: right value, and it follows its source attribute."""
    args_class = get_spec(config.model_type).model_args_class
    args = args_class.from_hf_config(config)
    for path, value in iter_args_fields(args):
        name = f"{label}: {path}"
        if leaf_of(path) == "route_norm" and renormalises_regardless:
            detail = "HF's router renormalises whatever config.norm_topk_prob says (probed): expected True"
            rec.check(name, value is True, f"{detail}, got {value!r}")
            continue
        if leaf_of(path) == "enable_weight_tying" and ties_regardless is not None:
            detail = (
                f"HF's LM head {'is' if ties_regardless else 'is not'} the embedding whatever "
                f"config.tie_word_embeddings says (probed): expected {ties_regardless}"
            )
            rec.check(name, value is ties_regardless, f"{detail}, got {value!r}")
            continue
        source = source_for(path, config)
        if source is None:
            rec.check(name, True, f"not read from the config (= {value!r})")
            continue
        attr = next((a for a in source.attrs if _get_path(config, a) is not _MISSING), None)
        if attr is not None and attr in unread_fields(config):
            rec.add(_stays_check(name, args_class, config, path, attr, value))
            continue
        if attr is None:
            if source.derive is None:
                rec.check(name, True, f"config has none of {list(source.attrs)}; keeps {value!r}")
                continue
            expected = source.derive(config)
            rec.check(name, _same(value, expected), f"derived: expected {expected!r}, got {value!r}")
            continue
        raw = _get_path(config, attr)
        normalize = source.normalize or (lambda v: v)
        if raw is None:
            # Unset in this config, so the field keeps its default; once the config sets
            # it (an int id, a window) the field must follow.
            if isinstance(value, int) and not isinstance(value, bool):
                check = _follow_check(name, args_class, config, path, attr, 0, normalize)
                rec.check(name, check.passed, f"config.{attr} is None, args keeps {value!r}; {check.detail}")
            else:
                rec.check(name, True, f"config.{attr} is None; args keeps {value!r}")
            continue
        expected = normalize(raw)
        if leaf_of(path) == "norm_eps" and not _same(value, expected):
            held = hf_norms_eps(config)
            if held is not None and not _same(raw, held):
                # The config has the field but HF builds its norms without it (BioGPT).
                detail = f"HF's norms hold eps {held!r} (config.{attr} unused); got {value!r}"
                rec.check(name, _same(value, held), detail)
                continue
        if not _same(value, expected):
            rec.check(
                name,
                False,
                f"expected config.{attr} = {expected!r}, got {value!r}; fix from_hf_config in {args_class.__module__}",
            )
            continue
        rec.add(_follow_check(name, args_class, config, path, attr, raw, normalize, hf_reads))


def _follow_check(
    name: str,
    args_class: type[BaseModelArgs],
    config: PretrainedConfig,
    path: str,
    attr: str,
    value: Any,
    normalize: Callable[[Any], Any],
    hf_reads: Callable[[str], bool] | None = None,
) -> CheckResult:
    """Passes when setting ``config.<attr>`` to another value moves the field with it, or
    when it does not and ``hf_reads`` measures that HF's model does not read the attribute
    either (the parity stages then compare the field's value with HF's forward)."""
    rejected: list[str] = []
    for new_value in _perturbations(value):
        changed = copy.deepcopy(config)
        try:
            _set_path(changed, attr, new_value)
            moved = _read_path(args_class.from_hf_config(changed), path)
        except Exception as exc:
            rejected.append(f"{new_value!r} ({type(exc).__name__})")
            continue
        if not _same(moved, normalize(new_value)):
            if hf_reads is not None and not hf_reads(attr):
                return CheckResult(
                    name=name,
                    passed=True,
                    detail=(
                        f"= config.{attr} ({value!r}), which HF's model does not read either (measured: same "
                        f"parameters and logits with another {attr}); the field stays {moved!r}"
                    ),
                )
            return CheckResult(
                name=name,
                passed=False,
                detail=(
                    f"equals config.{attr} ({value!r}) but does not follow it: with {attr}={new_value!r} "
                    f"the field is {moved!r}; from_hf_config reads the wrong attribute or a constant"
                ),
            )
        return CheckResult(name=name, passed=True, detail=f"= config.{attr} ({value!r}) and follows it")
    why = f"; every other value was rejected: {', '.join(rejected)}" if rejected else ""
    return CheckResult(name=name, passed=True, detail=f"= config.{attr} ({value!r}){why}")


def unread_fields(config: PretrainedConfig) -> tuple[str, ...]:
    """Config fields the family's args module declares HF never reads (``_UNREAD_HF_FIELDS``)."""
    module = sys.modules[get_spec(config.model_type).model_args_class.__module__]
    return tuple(getattr(module, "_UNREAD_HF_FIELDS", ()))


def _stays_check(
    name: str, args_class: type[BaseModelArgs], config: PretrainedConfig, path: str, attr: str, value: Any
) -> CheckResult:
    """Passes when the field keeps its value whatever ``config.<attr>`` (HF never reads it;
    the parity stage proves that against HF with the field set otherwise)."""
    for new_value in _perturbations(_get_path(config, attr)):
        changed = copy.deepcopy(config)
        _set_path(changed, attr, new_value)
        moved = _read_path(args_class.from_hf_config(changed), path)
        if not _same(moved, value):
            return CheckResult(
                name=name,
                passed=False,
                detail=f"HF never reads config.{attr}, yet with {attr}={new_value!r} the field is {moved!r}",
            )
    return CheckResult(name=name, passed=True, detail=f"= {value!r}, not config.{attr}: HF never reads it")


def _check_caller_fields(rec: StageRecorder, config: PretrainedConfig) -> None:
    args_class = get_spec(config.model_type).model_args_class
    for attn_type in ("sdpa", "varlen"):
        got = args_class.from_hf_config(config, attn_type=attn_type).attn_type
        rec.check(f"attn_type={attn_type!r} is passed through", got == attn_type, f"got {got!r}")
    plain = getattr(args_class.from_hf_config(config), "is_critic", None)
    critic = getattr(args_class.from_hf_config(config, is_critic=True), "is_critic", None)
    rec.check(
        "is_critic is passed through",
        plain is False and critic is True,
        f"default {plain!r}, with is_critic=True {critic!r}",
    )


def unset_required_fields(config: PretrainedConfig) -> list[str]:
    """Required fields of the family's args that ``config`` leaves ``None`` (a config class
    whose defaults are no model, such as Dots1Config's expert counts)."""
    module = sys.modules[get_spec(config.model_type).model_args_class.__module__]
    required = getattr(module, "_REQUIRED_HF_FIELDS", ())
    unset = [name for name in required if getattr(config, name, None) is None]
    # The MoE fields are required of a config with routed experts only (a dense Qwen3Config
    # needs none; DeepseekV2Config's defaults have 64 experts and no num_experts_per_tok).
    moe_unset = [name for name in getattr(module, "_REQUIRED_MOE_HF_FIELDS", ()) if getattr(config, name, None) is None]
    if unset or not moe_unset:
        return unset
    try:
        get_spec(config.model_type).model_args_class.from_hf_config(config)
    except ValueError:
        return moe_unset
    return []


def check_refuses_unset_fields(rec: StageRecorder, config: PretrainedConfig, unset: list[str]) -> None:
    """``from_hf_config`` of a config that leaves required fields unset raises, naming them."""
    args_class = get_spec(config.model_type).model_args_class
    try:
        args_class.from_hf_config(config)
    except ValueError as e:
        named = all(name in str(e) for name in unset)
        rec.check("defaults: refused (required fields unset)", named, f"{unset} unset: {e}")
        return
    rec.check("defaults: refused (required fields unset)", False, f"{unset} unset, yet from_hf_config returned args")


def run_args_stage(case: ModelCase, workdir: str | Path | None = None, raise_on_failure: bool = True) -> StageResult:
    """Stage 1 on the case's tiny config and on the config class's defaults."""
    del workdir  # stage 1 touches no files

    def body(rec: StageRecorder) -> None:
        tiny = build_hf_config(case)
        # The router's semantics do not depend on sizes: measured once, on the tiny model.
        regardless = hf_renormalises_regardless(case, tiny)
        ties = hf_ties_regardless(case, tiny)
        hf_reads = HFReads(case, tiny)
        check_args_against_config(rec, tiny, "tiny", regardless, ties, hf_reads)
        defaults = type(tiny)()
        unset = unset_required_fields(defaults)
        if unset:
            check_refuses_unset_fields(rec, defaults, unset)
        else:
            check_args_against_config(rec, defaults, "defaults", regardless, ties, hf_reads)
        _check_caller_fields(rec, tiny)

    return run_stage(case, 1, body, raise_on_failure)
