"""Qwen3.5 model definition: args, modules, RoPE, the gated delta rule and the HF state-dict adapter."""
