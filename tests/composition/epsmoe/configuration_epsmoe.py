"""Epsmoe: a test family for archon-port's composition proof.

Mixture-of-experts MLPs in every layer, RMSNorm over the full width of the query and key
projections, sandwich norms around both sub-layers, and both sub-layer outputs scaled by
``residual_multiplier`` before they join the residual stream.
"""

from typing import ClassVar

from transformers import PretrainedConfig


class EpsmoeConfig(PretrainedConfig):
    model_type = "epsmoe"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=1024,
        moe_intermediate_size=512,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=4096,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_parameters=None,
        attention_bias=False,
        attention_dropout=0.0,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        residual_multiplier=0.5,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.residual_multiplier = residual_multiplier
        self.rope_parameters = (
            rope_parameters if rope_parameters is not None else {"rope_type": "default", "rope_theta": 10000.0}
        )
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )


__all__ = ["EpsmoeConfig"]
