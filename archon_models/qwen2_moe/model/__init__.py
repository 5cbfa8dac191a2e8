"""Qwen2Moe model definition: args, modules, RoPE and the HF state-dict adapter."""
