"""The mixture-of-experts block: router, routed experts, shared experts.

Routers score by softmax (Qwen, Mixtral) or by independent sigmoids (DeepSeek-V3), may
keep only the best ``topk_group`` of ``n_group`` expert groups (a group scored by the sum
of its two best experts), select with a score-correction bias that does not weight
(``e_score_correction_bias``, a buffer of a router module), renormalise the kept weights
(``norm_topk_prob``) and scale them (``routed_scaling_factor``); the router projection may
have a bias. Experts are one MLP module each (per-expert 2D keys) or two 3D parameters
(transformers 5's layout, ``(E, out, in)``, or gpt-oss's ``(E, in, out)``, gate and up
concatenated or interleaved). Shared experts are DeepSeek's (``n_shared_experts`` times
the expert width) or Qwen2-MoE's (own width, optionally gated by a sigmoid).
"""

from __future__ import annotations

from tests.fuzz.source import ConfigField, Piece, block, indent, lines
from tests.fuzz.spec import FamilySpec, MoESpec


def expert_count_field(moe: MoESpec) -> str:
    if moe.correction_bias or (moe.n_shared_experts and moe.shared_style == "deepseek"):
        return "n_routed_experts"
    return "num_local_experts" if moe.block_name == "block_sparse_moe" else "num_experts"


def _router(moe: MoESpec, experts: str) -> tuple[str, str, list[tuple[str, str]]]:
    """(router class code or "", the gate's constructor, inits)."""
    if not moe.correction_bias:
        return "", f"nn.Linear(config.hidden_size, config.{experts}, bias={moe.router_bias})", []
    bias_init = "self.bias = nn.Parameter(torch.zeros(self.num_experts))" if moe.router_bias else ""
    bias_arg = "self.bias.float()" if moe.router_bias else "None"
    code = (
        "class PREFIXTopkRouter(nn.Module):\n"
        "    def __init__(self, config: PREFIXConfig):\n"
        + indent(
            lines(
                "super().__init__()",
                f"self.num_experts = config.{experts}",
                "self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))",
                bias_init,
                "# Added to the scores to choose experts, never to weight them.",
                'self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))',
            ),
            2,
        )
        + "\n\n    def forward(self, hidden_states):\n"
        + indent(f"return F.linear(hidden_states.float(), self.weight.float(), {bias_arg})", 2)
    )
    init_body = "init.normal_(module.weight, mean=0.0, std=std)\ninit.zeros_(module.e_score_correction_bias)"
    if moe.router_bias:
        init_body += "\ninit.zeros_(module.bias)"
    return code, "PREFIXTopkRouter(config)", [("PREFIXTopkRouter", init_body)]


def _fused_experts(spec: FamilySpec, experts: str, act_field: str) -> tuple[str, list[tuple[str, str]]]:
    moe = spec.moe
    assert moe is not None
    out_in = moe.layout == "fused_out_in"
    shapes = (
        (
            "(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim)",
            "(self.num_experts, self.hidden_dim, self.intermediate_dim)",
        )
        if out_in
        else (
            "(self.num_experts, self.hidden_dim, 2 * self.intermediate_dim)",
            "(self.num_experts, self.intermediate_dim, self.hidden_dim)",
        )
    )
    up = "F.linear(current, self.gate_up_proj[expert_idx])" if out_in else "current @ self.gate_up_proj[expert_idx]"
    down = "F.linear(current, self.down_proj[expert_idx])" if out_in else "current @ self.down_proj[expert_idx]"
    parts = "up, gate" if moe.gate_up_order.endswith("up_first") else "gate, up"
    split = (
        f"{parts} = gate_up.chunk(2, dim=-1)"
        if moe.gate_up_order.startswith("concatenated")
        else f"{parts} = gate_up[..., ::2], gate_up[..., 1::2]"
    )
    code = block(
        f'''
        class PREFIXExperts(nn.Module):
            """All routed experts as two 3D parameters, one slice per expert."""

            def __init__(self, config: PREFIXConfig):
                super().__init__()
                self.num_experts = config.{experts}
                self.hidden_dim = config.hidden_size
                self.intermediate_dim = config.moe_intermediate_size
                self.gate_up_proj = nn.Parameter(torch.empty{shapes[0]})
                self.down_proj = nn.Parameter(torch.empty{shapes[1]})
                self.act_fn = ACT2FN[config.{act_field}]

            def forward(self, hidden_states, top_k_index, top_k_weights):
                final_hidden_states = torch.zeros_like(hidden_states)
                for expert_idx in range(self.num_experts):
                    token_idx, slot = torch.where(top_k_index == expert_idx)
                    if token_idx.numel() == 0:
                        continue
                    current = hidden_states[token_idx]
                    gate_up = {up}
                    {split}
                    current = self.act_fn(gate) * up
                    current = {down}
                    current = current * top_k_weights[token_idx, slot, None].to(current.dtype)
                    final_hidden_states.index_add_(0, token_idx, current)
                return final_hidden_states
        '''
    )
    init_body = (
        "init.normal_(module.gate_up_proj, mean=0.0, std=std)\ninit.normal_(module.down_proj, mean=0.0, std=std)"
    )
    return code, [("PREFIXExperts", init_body)]


def _route(moe: MoESpec) -> str:
    parts = [
        "routing_weights = F.softmax(router_logits, dim=-1, dtype=torch.float)"
        if moe.scoring == "softmax"
        else "routing_weights = router_logits.sigmoid()",
        "scores_for_choice = routing_weights + self.gate.e_score_correction_bias"
        if moe.correction_bias
        else "scores_for_choice = routing_weights",
    ]
    if moe.n_group > 1:
        parts.append(
            block(
                """
                # Keep the best topk_group groups, each scored by the sum of its two best experts.
                grouped = scores_for_choice.view(-1, self.n_group, self.num_experts // self.n_group)
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
                group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
                group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
                score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, self.num_experts)
                scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
                """
            )
        )
    parts += [
        "top_k_index = torch.topk(scores_for_choice, self.top_k, dim=-1, sorted=False)[1]",
        "top_k_weights = routing_weights.gather(1, top_k_index)",
    ]
    parts.append(
        "if self.norm_topk_prob:\n    top_k_weights = top_k_weights / (top_k_weights.sum(dim=-1, keepdim=True) + 1e-20)"
    )
    if moe.routed_scaling_factor is not None:
        parts.append("top_k_weights = top_k_weights * self.routed_scaling_factor")
    parts.append("return top_k_index, top_k_weights")
    return lines(*parts)


def moe_piece(spec: FamilySpec, act_field: str) -> Piece:
    moe = spec.moe
    assert moe is not None
    experts = expert_count_field(moe)
    router_code, gate_ctor, inits = _router(moe, experts)
    fields = [
        ConfigField(experts, moe.n_experts),
        ConfigField("num_experts_per_tok", moe.top_k),
        ConfigField("moe_intermediate_size", moe.moe_intermediate_size),
        ConfigField("norm_topk_prob", moe.norm_topk_prob),
    ]
    init = [
        "super().__init__()",
        f"self.num_experts = config.{experts}",
        "self.top_k = config.num_experts_per_tok",
        "self.norm_topk_prob = config.norm_topk_prob",
    ]
    if moe.n_group > 1:
        init += ["self.n_group = config.n_group", "self.topk_group = config.topk_group"]
        fields += [ConfigField("n_group", moe.n_group), ConfigField("topk_group", moe.topk_group)]
    if moe.routed_scaling_factor is not None:
        init.append("self.routed_scaling_factor = config.routed_scaling_factor")
        fields.append(ConfigField("routed_scaling_factor", moe.routed_scaling_factor))
    init.append(f"self.gate = {gate_ctor}")
    pieces_code = [router_code] if router_code else []
    if moe.layout == "per_expert":
        init.append(
            "self.experts = nn.ModuleList(\n"
            "    [PREFIXMLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(self.num_experts)]\n"
            ")"
        )
        run_experts = block(
            """
            hidden_out = torch.zeros_like(flat)
            for expert_idx in range(self.num_experts):
                token_idx, slot = torch.where(top_k_index == expert_idx)
                if token_idx.numel() == 0:
                    continue
                expert_out = self.experts[expert_idx](flat[token_idx])
                hidden_out.index_add_(0, token_idx, expert_out * top_k_weights[token_idx, slot, None].to(flat.dtype))
            """
        )
    else:
        code, expert_inits = _fused_experts(spec, experts, act_field)
        pieces_code.append(code)
        inits += expert_inits
        init.append("self.experts = PREFIXExperts(config)")
        run_experts = "hidden_out = self.experts(flat, top_k_index, top_k_weights)"
    shared = ""
    if moe.n_shared_experts and moe.shared_style == "deepseek":
        init.append(
            "self.shared_experts = PREFIXMLP(\n"
            "    config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts\n"
            ")"
        )
        fields.append(ConfigField("n_shared_experts", moe.n_shared_experts))
        shared = "hidden_out = hidden_out + self.shared_experts(flat)"
    elif moe.n_shared_experts:
        init.append("self.shared_expert = PREFIXMLP(config, intermediate_size=config.shared_expert_intermediate_size)")
        fields.append(ConfigField("shared_expert_intermediate_size", moe.shared_intermediate_size))
        if moe.shared_gate:
            init.append("self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)")
            shared = "hidden_out = hidden_out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)"
        else:
            shared = "hidden_out = hidden_out + self.shared_expert(flat)"
    forward = lines(
        "bsz, seq_len, hidden_dim = hidden_states.shape",
        "flat = hidden_states.view(-1, hidden_dim)",
        "router_logits = self.gate(flat).float()",
        "top_k_index, top_k_weights = self.route(router_logits)",
        run_experts,
        shared,
        "return hidden_out.view(bsz, seq_len, hidden_dim)",
    )
    block_code = (
        "class PREFIXSparseMoeBlock(nn.Module):\n"
        "    def __init__(self, config: PREFIXConfig):\n"
        + indent(lines(*init), 2)
        + "\n\n    def route(self, router_logits):\n"
        + indent(_route(moe), 2)
        + "\n\n    def forward(self, hidden_states):\n"
        + indent(forward, 2)
    )
    if moe.layers == "leading_dense":
        fields.append(ConfigField("first_k_dense_replace", moe.first_k_dense))
    elif moe.layers == "sparse_step":
        fields.append(ConfigField("decoder_sparse_step", moe.sparse_step))
    code = "\n\n\n".join([*pieces_code, block_code])
    return Piece(
        code=code,
        imports={"import torch.nn.functional as F", "from transformers.activations import ACT2FN"},
        fields=fields,
        inits=inits,
    )


def is_moe_layer_expr(spec: FamilySpec) -> str | None:
    """The block's test for a MoE layer (``None``: every layer is one)."""
    moe = spec.moe
    assert moe is not None
    if moe.layers == "leading_dense":
        return "layer_idx >= config.first_k_dense_replace"
    if moe.layers == "sparse_step":
        return "(layer_idx + 1) % config.decoder_sparse_step == 0"
    return None
