"""DeepSeek-V4 in the engine: config, weights, the three attention kinds, mHC and the MoE.

Written against transformers' ``DeepseekV4ForCausalLM`` (the reference of the
tests) and the DeepSeek-V4 paper; transformers is never imported at serving time.
docs/deepseek_v4.md says what runs and how the cache is kept.
"""
