"""Which modules parallelize() shards as FSDP units of their own, for any nn.Module (no process
group needed: fsdp_units only looks; tests/distributed/test_parallelize.py shards and trains)."""

import pytest
import torch.nn as nn

from muonlab.distributed import find_blocks, fsdp_units
from muonlab.models import GPT, GPTConfig
from muonlab.models.gpt import moe_config


def _names(units):
    return [n for n, _ in units]


class HFLike(nn.Module):
    """Shaped like a Hugging Face decoder: the layers at model.layers, an embedding and a head."""

    def __init__(self, layers: int = 3):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(10, 8)
        self.model.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(layers))
        self.lm_head = nn.Linear(8, 10)


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_in, self.norm, self.fc_out = nn.Linear(8, 24), nn.LayerNorm(24), nn.Linear(24, 4)


def test_gpt_blocks_are_its_units_as_before():
    gpt = GPT(GPTConfig(d_model=16, n_layers=3, n_heads=2, context=8))
    assert _names(fsdp_units(gpt)) == ["blocks.0", "blocks.1", "blocks.2"]
    assert [m for _, m in fsdp_units(gpt)] == list(gpt.blocks)
    assert _names(fsdp_units(gpt, "blocks")) == ["blocks.0", "blocks.1", "blocks.2"]
    moe = GPT(moe_config(num_experts=4, d_model=16, n_layers=2, n_heads=2, context=8))
    assert _names(fsdp_units(moe)) == ["blocks.0", "blocks.1"]


def test_a_sequential_mlp_is_sharded_layer_by_layer():
    mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    assert find_blocks(mlp)[0] == ""  # the model itself holds them
    assert _names(fsdp_units(mlp)) == ["0", "2", "4"]
    # mixed layers: the type with the most parameters repeats; the norms stay in the root
    mixed = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8))
    assert _names(fsdp_units(mixed)) == ["0", "2"]


def test_the_largest_list_of_blocks_wins_and_names_are_dotted():
    assert _names(fsdp_units(HFLike())) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert _names(fsdp_units(HFLike(), "model.layers.1")) == ["model.layers.1.0", "model.layers.1.2"]


def test_a_module_listed_twice_is_one_unit():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(4, 4))
    units = fsdp_units(model)
    assert _names(units) == ["0", "3"] and units[0][1] is shared


def test_a_model_without_blocks_is_one_unit_or_wrapped_by_size():
    assert find_blocks(NoBlocks()) is None
    assert fsdp_units(NoBlocks()) == []  # FSDP's size-based policy: nothing reaches 1e8 parameters
    assert _names(fsdp_units(NoBlocks(), min_unit_params=100)) == ["fc_in", "fc_out"]  # 216 and 100
    # bottom up: a parent counts only what its units do not hold
    outer = nn.Module()
    outer.inner = NoBlocks()
    outer.extra = nn.Linear(24, 24)
    assert _names(fsdp_units(outer, min_unit_params=100)) == ["inner.fc_in", "inner.fc_out", "extra"]
    assert _names(fsdp_units(outer, min_unit_params=300)) == ["inner", "extra"]
    assert fsdp_units(outer, None) == []


@pytest.mark.parametrize("model, block_attr, parts", [
    (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), "blocks",
     ["apply_fsdp expects model.blocks to be an nn.ModuleList or nn.Sequential of blocks, got NoneType on Sequential",
      'leave block_attr out to shard the blocks found ("" (the model itself): 2 x Linear)']),
    (HFLike(), "layers", ["got NoneType on HFLike", "('model.layers': 3 x Sequential)",
                          "or name an nn.ModuleList or nn.Sequential of it: 'model.layers', 'model.layers.0'"]),
    (HFLike(), "lm_head", ["model.lm_head", "got Linear on HFLike"]),
    (NoBlocks(), "layers", ["got NoneType on NoBlocks; leave block_attr out to shard it by size (it repeats no block)"]),
])
def test_a_wrong_block_attr_names_the_fix(model, block_attr, parts):
    with pytest.raises(TypeError) as info:
        fsdp_units(model, block_attr)
    for part in parts:
        assert part in str(info.value), (part, str(info.value))


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "100"])
def test_min_unit_params_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=r"min_unit_params must be an integer >= 1"):
        fsdp_units(NoBlocks(), min_unit_params=value)
