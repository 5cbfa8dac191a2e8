"""DeepSeek-V3 model definition: args, modules, RoPE and the HF state-dict adapter."""
