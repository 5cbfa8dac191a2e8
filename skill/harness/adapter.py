"""Stage 2: the state-dict adapter loses nothing, in either direction.

Roundtrips must be bit-exact: a converter only renames, splits and stacks tensors, so
any numeric change is a bug. The HF side is the real ``save_pretrained`` output of a
tiny model, not a hand-written key list.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from archon_models.base import BaseStateDictAdapter
from skill.harness.case import ModelCase
from skill.harness.compare import compare_tensor_dicts
from skill.harness.keys import distinct_state_dict, join_single, key_indices, mapped_archon_key, wrapped_names
from skill.harness.models import (
    build_archon_model,
    build_hf_config,
    build_hf_model,
    copy_remote_code,
    read_hf_checkpoint,
    save_hf_checkpoint,
)
from skill.harness.results import StageRecorder, StageResult, run_stage

OUTPUT_KEY = "output.weight"
EMBEDDING_KEY = "tok_embeddings.weight"


def _archon_side(
    hf_config: PretrainedConfig, seed: int, hf_assets_path: Path
) -> tuple[BaseStateDictAdapter, dict[str, torch.Tensor], bool]:
    """The adapter (built on the checkpoint's folder, as AReaL's engine builds it), a state dict
    of distinct values, and whether the port ties its head."""
    archon = build_archon_model(hf_config, hf_assets_path=hf_assets_path)
    state = distinct_state_dict(archon.model, seed)
    tied = bool(getattr(archon.args, "enable_weight_tying", False))
    if tied and OUTPUT_KEY in state:
        # A tied model's output projection is its embedding, whatever the module layout.
        state[OUTPUT_KEY] = state[EMBEDDING_KEY].clone()
    return archon.adapter, state, tied


def check_roundtrips(
    rec: StageRecorder,
    adapter: BaseStateDictAdapter,
    archon_state: dict[str, torch.Tensor],
    hf_state: dict[str, torch.Tensor],
    label: str = "",
) -> dict[str, torch.Tensor]:
    """Both roundtrips, and ``to_hf`` writing exactly the checkpoint's keys and shapes."""
    hf_from_archon = adapter.to_hf(dict(archon_state))
    rec.add(
        compare_tensor_dicts(
            f"{label}archon -> hf -> archon keeps every key and tensor",
            adapter.from_hf(dict(hf_from_archon)),
            archon_state,
            exact=True,
        )
    )
    rec.add(
        compare_tensor_dicts(
            f"{label}hf -> archon -> hf keeps every key and tensor",
            adapter.to_hf(adapter.from_hf(dict(hf_state))),
            hf_state,
            exact=True,
        )
    )
    missing = sorted(set(hf_state) - set(hf_from_archon))
    unexpected = sorted(set(hf_from_archon) - set(hf_state))
    bad_shapes = sorted(
        f"{k} {tuple(hf_from_archon[k].shape)} vs {tuple(hf_state[k].shape)}"
        for k in set(hf_state) & set(hf_from_archon)
        if hf_from_archon[k].shape != hf_state[k].shape
    )
    rec.check(
        f"{label}to_hf writes the checkpoint's keys and shapes",
        not (missing or unexpected or bad_shapes),
        f"missing {missing[:5]}, unexpected {unexpected[:5]}, shapes {bad_shapes[:5]}"
        if missing or unexpected or bad_shapes
        else f"{len(hf_state)} keys",
    )
    return hf_from_archon


def check_single_conversion(
    rec: StageRecorder,
    adapter: BaseStateDictAdapter,
    archon_state: dict[str, torch.Tensor],
    hf_from_archon: dict[str, torch.Tensor],
    tied: bool = False,
) -> None:
    """``convert_single_to_hf`` (incremental weight sync) agrees with ``to_hf``, wrapped or not.

    With tied embeddings ``to_hf`` drops the output projection while a single
    conversion still names it, so it is left out of the comparison.
    """
    # A fused checkpoint key (q/k/v, gate/up) is named by each parameter it stacks, one
    # slice each; the slices, in state-dict order, concatenate to the key along dim 0
    # (dim 1 for a key stored (in, out), GPT-2's Conv1D c_attn).
    slices: dict[str, list[torch.Tensor]] = {}
    for name, tensor in archon_state.items():
        if tied and name == OUTPUT_KEY:
            continue
        for hf_key, piece in adapter.convert_single_to_hf(name, tensor):
            slices.setdefault(hf_key, []).append(piece)
    single = {k: join_single(adapter, k, v) for k, v in slices.items()}
    rec.add(compare_tensor_dicts("convert_single_to_hf agrees with to_hf", single, hf_from_archon, exact=True))

    wrong: list[str] = []
    tried = 0
    for name, tensor in archon_state.items():
        plain = dict(adapter.convert_single_to_hf(name, tensor))
        for wrapped in wrapped_names(name):
            tried += 1
            got = dict(adapter.convert_single_to_hf(wrapped, tensor))
            if got.keys() != plain.keys() or any(not torch.equal(got[k], plain[k]) for k in plain):
                wrong.append(f"{wrapped} -> {sorted(got)}")
    rec.check(
        "convert_single_to_hf strips ._checkpoint_wrapped_module and ._orig_mod",
        tried > 0 and not wrong,
        f"{len(wrong)} wrapped names converted differently: {wrong[:3]}" if wrong else f"{tried} wrapped names",
    )


def check_expert_split(
    rec: StageRecorder, adapter: BaseStateDictAdapter, archon_state: dict[str, torch.Tensor]
) -> None:
    """Archon's 3D expert tensors become one 2D checkpoint tensor per expert, in order.

    Expert tensors are the 3D tensors of an ``experts`` module (the MoE contract's
    ``moe.experts``); other 3D parameters (a depthwise convolution's weight) are whole tensors."""
    stacked = {k: v for k, v in archon_state.items() if v.ndim == 3 and "experts" in k.split(".")}
    if not stacked:
        rec.check("MoE 3D <-> 2D", True, "no 3D expert tensors (dense model)")
        return
    if hasattr(adapter, "join_single_to_hf"):
        check_fused_experts(rec, adapter, archon_state, stacked)
        return
    problems: list[str] = []
    for name, tensor in stacked.items():
        pairs = adapter.convert_single_to_hf(name, tensor)
        if len(pairs) != tensor.shape[0]:
            problems.append(f"{name}: {len(pairs)} checkpoint tensors for {tensor.shape[0]} experts")
            continue
        for position, (hf_key, piece) in enumerate(pairs):
            indices = key_indices(hf_key)
            # The expert id is the last index in the key (layers.<l>...experts.<e>...).
            expert = int(indices[-1]) if indices else position
            if piece.shape != tensor.shape[1:] or not torch.equal(piece, tensor[expert]):
                problems.append(f"{name}[{expert}] -> {hf_key} is not that expert's 2D slice")
    rec.check(
        "MoE 3D <-> 2D: one 2D tensor per expert, in order",
        not problems,
        "; ".join(problems[:4]) if problems else f"{len(stacked)} stacked tensors",
    )


def check_fused_experts(
    rec: StageRecorder,
    adapter: BaseStateDictAdapter,
    archon_state: dict[str, torch.Tensor],
    stacked: dict[str, torch.Tensor],
) -> None:
    """A checkpoint holding every expert of a projection in one 3D tensor: expert ``e`` of
    Archon's weights is expert ``e`` of the checkpoint's, and of nothing else. Keeping one
    expert of every 3D weight (the others zeroed), ``to_hf`` gives that expert's slice of
    each fused tensor, exactly, and zeros in every other slice."""
    full = adapter.to_hf(archon_state)
    fused = {k: v for k, v in full.items() if v.ndim == 3}
    n_experts = next(iter(stacked.values())).shape[0]
    problems: list[str] = []
    if not fused or any(v.shape[0] != n_experts for v in fused.values()):
        problems.append(f"to_hf wrote no 3D tensors of {n_experts} experts: {sorted(fused)[:3]}")
    for expert in range(n_experts) if not problems else ():
        kept = {
            k: torch.zeros_like(v).index_copy(0, torch.tensor([expert]), v[expert : expert + 1]) if k in stacked else v
            for k, v in archon_state.items()
        }
        one = adapter.to_hf(kept)
        for key, tensor in fused.items():
            others = torch.cat([one[key][:expert], one[key][expert + 1 :]])
            if not torch.equal(one[key][expert], tensor[expert]) or bool(others.any()):
                problems.append(f"{key}: expert {expert} lands elsewhere than slice {expert}")
    rec.check(
        "MoE 3D <-> fused 3D: expert e of every Archon weight is expert e of every checkpoint tensor",
        not problems,
        "; ".join(problems[:4]) if problems else f"{len(stacked)} Archon weights in {len(fused)} checkpoint tensors",
    )


def check_tying(rec: StageRecorder, case: ModelCase, directory: Path) -> None:
    """Tied embeddings: to_hf writes no output projection, from_hf refills it. Where HF keeps
    a head of its own even with ``tie_word_embeddings=True`` (remote code that defines no
    tying), the port must not tie either, and the head travels as any weight."""
    tied_case = case.model_copy(update={"config_overrides": {**case.config_overrides, "tie_word_embeddings": True}})
    hf_config = build_hf_config(tied_case)
    if not getattr(hf_config, "tie_word_embeddings", False):
        rec.check("tied embeddings", True, f"{type(hf_config).__name__} cannot tie embeddings")
        return
    hf_model = build_hf_model(tied_case, hf_config)
    hf_state = read_hf_checkpoint(save_hf_checkpoint(hf_model, directory))
    adapter, archon_state, ties = _archon_side(hf_config, case.seed, directory)
    # Imported here: the analysis needs libcst, which a GPU machine running the harness lacks.
    from skill.analysis.probes import probe_head_is_embedding

    if probe_head_is_embedding(hf_model) is False:
        rec.check(
            "tie_word_embeddings=True: HF keeps its own LM head, and so does the port",
            not ties,
            "the port ties the output projection to the embedding" if ties else "",
        )
        check_roundtrips(rec, adapter, archon_state, hf_state, label="tie_word_embeddings=True: ")
        return
    hf_from_archon = check_roundtrips(rec, adapter, archon_state, hf_state, label="tied: ")
    output_keys = {k for k, _ in adapter.convert_single_to_hf(OUTPUT_KEY, archon_state[OUTPUT_KEY])}
    written = sorted(output_keys & set(hf_from_archon))
    rec.check("tied: to_hf skips the output projection", not written, f"wrote {written}" if written else "")
    loaded = adapter.from_hf(dict(hf_state))
    same = OUTPUT_KEY in loaded and torch.equal(loaded[OUTPUT_KEY], loaded[EMBEDDING_KEY])
    rec.check(
        "tied: from_hf fills the output projection from the embedding",
        same,
        "" if same else f"{OUTPUT_KEY} {'differs from' if OUTPUT_KEY in loaded else 'missing next to'} {EMBEDDING_KEY}",
    )


def _raises_naming(adapter: BaseStateDictAdapter, state: dict[str, torch.Tensor], names: list[str]) -> str | None:
    """None when ``from_hf(state)`` raises an error that names one of ``names``; else why not."""
    try:
        adapter.from_hf(state)
    except Exception as exc:
        message = str(exc)
        return None if any(n and n in message for n in names) else f"raised without naming {names[0]}: {message[:120]}"
    return "did not raise"


def check_bad_keys(rec: StageRecorder, adapter: BaseStateDictAdapter, hf_state: dict[str, torch.Tensor]) -> None:
    """An unknown key or a missing key makes from_hf raise an error that names it."""
    layer_key = next(k for k in sorted(hf_state) if ".0." in k)
    unknown_keys = [
        layer_key.rsplit(".", 2)[0] + ".harness_unknown.weight",
        "harness_unknown.weight",
    ]
    sample = next(iter(hf_state.values()))
    unknown_problems = []
    for key in unknown_keys:
        why = _raises_naming(adapter, {**hf_state, key: sample.clone()}, [key])
        if why:
            unknown_problems.append(f"{key}: {why}")
    rec.check(
        "from_hf raises on an unknown key, naming it",
        not unknown_problems,
        "; ".join(unknown_problems) if unknown_problems else f"tried {unknown_keys}",
    )

    missing_problems = []
    for key in sorted(hf_state):
        partial = {k: v for k, v in hf_state.items() if k != key}
        why = _raises_naming(adapter, partial, [key, mapped_archon_key(adapter, key) or ""])
        if why:
            missing_problems.append(f"{key}: {why}")
    rec.check(
        "from_hf raises on each missing key, naming it",
        not missing_problems,
        f"{len(missing_problems)} of {len(hf_state)}: {missing_problems[:3]}"
        if missing_problems
        else f"each of {len(hf_state)} keys",
    )


def _released_copies(state: dict[str, torch.Tensor], templates: list[str], n_layers: int) -> dict[str, torch.Tensor]:
    """A released checkpoint's extra keys: each ignored key template written for every layer of
    ``n_layers`` the saved ``state`` lacks it on, holding a copy of a layer's tensor moved by 1."""
    copies: dict[str, torch.Tensor] = {}
    for template in templates:
        held = [state[template.format(layer)] for layer in range(n_layers) if template.format(layer) in state]
        if template.count("{}") != 1 or not held:
            continue
        copies.update(
            {template.format(layer): held[0] + 1.0 for layer in range(n_layers) if template.format(layer) not in state}
        )
    return copies


def check_ignored_keys(
    rec: StageRecorder, case: ModelCase, hf_config: PretrainedConfig, model: PreTrainedModel, directory: Path
) -> None:
    """Keys transformers' load drops where the model lacks them (``_keys_to_ignore_on_load_unexpected``,
    measured as :func:`skill.analysis.ignored_keys.ignored_checkpoint_keys` measures it): the
    ``save_pretrained`` checkpoint gets a copy on every layer without the module, as a released
    one stores it (A.X-K1's ``post_mlp_layernorm`` on dense layers); ``from_pretrained`` must
    report nothing unexpected and the adapter's ``from_hf`` must drop the same copies. Families
    without such keys get no check. ``model`` is the stage's tiny HF model of ``hf_config``."""
    # Imported here: skill.analysis pulls in libcst, which the GPU machine running the harness lacks.
    from skill.analysis.ignored_keys import ignore_patterns, ignored_checkpoint_keys
    from skill.analysis.saved_names import saved_locations

    if not ignore_patterns(model):
        return  # most families: nothing to measure, no save to spend
    templates = ignored_checkpoint_keys(model, saved_locations(model).get)
    if not templates:
        return
    save_hf_checkpoint(model, directory)
    copy_remote_code(case, directory)
    saved = read_hf_checkpoint(directory)
    copies = _released_copies(saved, templates, int(hf_config.num_hidden_layers))
    files = sorted(directory.glob("*.safetensors"))
    save_file({**load_file(str(files[0])), **copies}, str(files[0]), metadata={"format": "pt"})
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        str(directory), output_loading_info=True, trust_remote_code=case.trust_remote_code
    )
    reported = sorted(str(key) for kind in ("unexpected_keys", "missing_keys") for key in loaded[1].get(kind, []))
    rec.check(
        f"from_pretrained ignores {len(copies)} {'copy' if len(copies) == 1 else 'copies'} of {', '.join(templates)}"
        " on layers without it",
        bool(copies) and not reported,
        f"reported: {reported[:5]}" if reported else ", ".join(sorted(copies)),
    )
    adapter = build_archon_model(hf_config).adapter
    try:
        got = adapter.from_hf(read_hf_checkpoint(directory))
    except KeyError as e:
        rec.check("from_hf drops the copies transformers ignores", False, str(e))
        return
    rec.add(
        compare_tensor_dicts("from_hf drops the copies transformers ignores", got, adapter.from_hf(saved), exact=True)
    )


def run_adapter_stage(case: ModelCase, workdir: str | Path | None = None, raise_on_failure: bool = True) -> StageResult:
    """Stage 2: roundtrips, single-tensor conversion, wrapper prefixes, MoE split, tying, bad keys."""

    def body(rec: StageRecorder) -> None:
        with tempfile.TemporaryDirectory(prefix="archon-stage2-", dir=workdir) as tmp:
            hf_config = build_hf_config(case)
            hf_model = build_hf_model(case, hf_config)
            hf_state = read_hf_checkpoint(save_hf_checkpoint(hf_model, Path(tmp) / "hf"))
            adapter, archon_state, tied = _archon_side(hf_config, case.seed, Path(tmp) / "hf")
            hf_from_archon = check_roundtrips(rec, adapter, archon_state, hf_state)
            check_single_conversion(rec, adapter, archon_state, hf_from_archon, tied=tied)
            check_expert_split(rec, adapter, archon_state)
            check_bad_keys(rec, adapter, hf_state)
            check_tying(rec, case, Path(tmp) / "hf_tied")
            check_ignored_keys(rec, case, hf_config, hf_model, Path(tmp) / "hf_released")

    return run_stage(case, 2, body, raise_on_failure)
