"""comm.collectives.pack: one flat send buffer, bit for bit what casting each tensor and
concatenating them gives, whatever mix of layouts and dtypes it is handed."""

import pytest
import torch

from muonlab.comm.collectives import pack


def _reference(tensors, dtype):
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors]) if tensors else torch.empty(0, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "one_transposed", "with_empty", "none"])
def test_pack_is_each_tensor_cast_then_concatenated(dtype, layout):
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(12, 8, generator=gen) * 1e3 for _ in range(5)]  # values bf16 rounds
    if layout == "one_transposed":
        tensors[2] = torch.randn(8, 12, generator=gen).t()  # a view that is not contiguous
    elif layout == "with_empty":
        tensors.insert(1, torch.empty(0, 8))
    elif layout == "none":
        tensors = []
    got = pack(tensors, dtype, like=torch.empty(0))
    assert got.dtype == dtype and torch.equal(got, _reference(tensors, dtype))


def test_a_single_tensor_in_the_wire_dtype_is_sent_as_it_is():
    t = torch.randn(4, 6)
    assert pack([t], torch.float32, like=t).data_ptr() == t.data_ptr()
