"""Small models that train on a CPU in seconds."""

from .gpt import GPT, MLP, Attention, Block, GPTConfig, MoE, moe_config

__all__ = ["GPT", "GPTConfig", "Attention", "Block", "MLP", "MoE", "moe_config"]
