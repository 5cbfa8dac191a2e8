"""Position encodings: the rotary embedding and its helpers, or ALiBi's slopes.

RoPE comes in the catalogue's variants: the two halves of a head paired
(``rotate_half``) or adjacent features paired (GPT-J's ``::2`` slices); the usual
direction, or the reversed one (NanoChat's ``rotate_half`` returns ``(x2, -x1)``: a
rotation by ``-theta``); only the first ``partial_rotary_factor`` of each head rotated;
frequencies scaled by transformers' own ``ROPE_INIT_FUNCTIONS`` (linear, llama3, yarn).
Multi-head latent attention uses DeepSeek-V3's helpers (``rope_interleave`` selects the
de-interleaving one). Learned absolute positions need no code here (an ``nn.Embedding``
in the base model).
"""

from __future__ import annotations

from tests.fuzz.source import ConfigField, Piece, block
from tests.fuzz.spec import FamilySpec, RopeSpec


def rope_parameters(spec: FamilySpec) -> dict:
    """The config's ``rope_parameters`` (transformers 5 layout)."""
    rope = spec.rope
    assert rope is not None
    params: dict = {"rope_type": rope.scaling, "rope_theta": rope.theta}
    if rope.partial_factor != 1.0:
        params["partial_rotary_factor"] = rope.partial_factor
    if rope.scaling == "linear":
        params["factor"] = 4.0
    elif rope.scaling == "llama3":
        params.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    elif rope.scaling == "yarn":
        # factor = max_position_embeddings / original_max_position_embeddings, as YaRN expects.
        params.update(
            factor=4.0,
            original_max_position_embeddings=spec.max_position_embeddings // 4,
            beta_fast=32.0,
            beta_slow=1.0,
        )
        if spec.mla is not None:
            params.update(mscale=1.0, mscale_all_dim=1.0)
    return params


def _rotary_class(head_dim_expr: str, interleaved_cache: bool) -> str:
    emb = "torch.repeat_interleave(freqs, 2, dim=-1)" if interleaved_cache else "torch.cat((freqs, freqs), dim=-1)"
    return block(
        f"""
        class PREFIXRotaryEmbedding(nn.Module):
            inv_freq: torch.Tensor

            def __init__(self, config: PREFIXConfig, device=None):
                super().__init__()
                self.config = config
                self.rope_type = config.rope_parameters.get("rope_type", "default")
                rope_init_fn = self.compute_default_rope_parameters
                if self.rope_type != "default":
                    rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
                inv_freq, self.attention_scaling = rope_init_fn(self.config, device)
                self.register_buffer("inv_freq", inv_freq, persistent=False)
                self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

            @staticmethod
            def compute_default_rope_parameters(config, device=None, seq_len=None):
                base = config.rope_parameters["rope_theta"]
                head_dim = {head_dim_expr}
                dim = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
                exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
                inv_freq = 1.0 / (base**exponents)
                return inv_freq, 1.0

            @torch.no_grad()
            def forward(self, x, position_ids):
                inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
                freqs = (inv_freq.to(x.device) @ position_ids[:, None, :].float()).transpose(1, 2)
                emb = {emb}
                cos = emb.cos() * self.attention_scaling
                sin = emb.sin() * self.attention_scaling
                return cos.to(x.dtype), sin.to(x.dtype)
        """
    )


def _rotate_half(rope: RopeSpec) -> str:
    first, second = ("-x2", "x1") if rope.direction == "standard" else ("x2", "-x1")
    if rope.pairing == "interleaved":
        return block(
            f'''
            def rotate_half(x):
                """Rotate adjacent feature pairs: (x1, x2) = (x[2i], x[2i + 1]) -> ({first}, {second})."""
                x1 = x[..., ::2]
                x2 = x[..., 1::2]
                return torch.stack(({first}, {second}), dim=-1).flatten(-2)
            '''
        )
    return block(
        f'''
        def rotate_half(x):
            """Rotate the two halves of the features: (x1, x2) -> ({first}, {second})."""
            x1 = x[..., : x.shape[-1] // 2]
            x2 = x[..., x.shape[-1] // 2 :]
            return torch.cat(({first}, {second}), dim=-1)
        '''
    )


_APPLY_FULL = """
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed
"""

_APPLY_PARTIAL = '''
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        """Rotate the first ``cos.shape[-1]`` features of each head; the rest pass through."""
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        rotary_dim = cos.shape[-1]
        q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
        k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
        q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
        k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
        return torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1)
'''

_APPLY_INTERLEAVE_MLA = '''
    def apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1):
        """DeepSeek-V3's RoPE over adjacent pairs: de-interleave the features, then rotate halves."""
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        b, h, s, d = q.shape
        q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
        b, h, s, d = k.shape
        k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed
'''

_ALIBI = '''
    def build_alibi_slopes(num_heads):
        """ALiBi's per-head slopes: the geometric sequence 2**(-8 / n), interleaved for a head
        count that is no power of two."""
        closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
        base = 2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3)))
        slopes = torch.pow(torch.tensor(base), torch.arange(1, 1 + closest_power_of_2, dtype=torch.float32))
        if closest_power_of_2 != num_heads:
            extra_base = 2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3)))
            num_remaining = min(closest_power_of_2, num_heads - closest_power_of_2)
            extra_powers = torch.arange(1, 1 + 2 * num_remaining, 2, dtype=torch.float32)
            slopes = torch.cat([slopes, torch.pow(torch.tensor(extra_base), extra_powers)])
        return slopes
'''


def positions_piece(spec: FamilySpec) -> Piece:
    if spec.positions == "alibi":
        return Piece(code=block(_ALIBI), imports={"import math"})
    if spec.positions == "learned":
        return Piece()
    rope = spec.rope
    assert rope is not None
    fields = [ConfigField("rope_parameters", rope_parameters(spec))]
    if spec.mla is not None:
        head_dim = "config.head_dim" if spec.mla.head_dim_in_config else "config.qk_rope_head_dim"
        code = "\n\n\n".join(
            [
                _rotary_class(head_dim, interleaved_cache=False),
                _rotate_half(RopeSpec()),
                block(_APPLY_FULL),
                block(_APPLY_INTERLEAVE_MLA),
            ]
        )
        fields.append(ConfigField("rope_interleave", spec.mla.rope_interleave))
    else:
        head_dim = 'getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads'
        code = "\n\n\n".join(
            [
                _rotary_class(head_dim, interleaved_cache=rope.pairing == "interleaved"),
                _rotate_half(rope),
                block(_APPLY_PARTIAL if rope.partial_factor != 1.0 else _APPLY_FULL),
            ]
        )
    imports = {"from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS"}
    return Piece(code=code, imports=imports, fields=fields)
