"""The chunk tables of triton_utils, the one computation every kernel family's launches read: of a batch (kept per
shape) and of packed sequences, around the chunk length and with empty sequences."""
import pytest
import torch

from kalmix.ops.common.triton_utils import chunk_starts, chunk_table
from kalmix.ops.common.varlen import batch_offsets, check_offsets

C = 64


def test_batch_table_is_the_packed_table_of_equal_lengths():
    """The cached table of an unpacked batch equals the one built from its cu_seqlens (a partial last chunk)."""
    B, T = 3, 2 * C + 5
    cu = torch.arange(0, (B + 1) * T, T)
    packed = check_offsets("test", cu, B * T)
    for got, want in zip(chunk_table(None, B, T, C, cu.device), chunk_table(packed, B, T, C, cu.device)):
        assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want)
    assert torch.equal(batch_offsets(B, T, cu.device), cu.to(torch.int32))


@pytest.mark.parametrize("C", [4, 64])
def test_packed_tables_against_a_loop(C):
    """Each sequence's first chunk, the number of chunks and every chunk's token range, against a loop over the
    sequences; an empty sequence owns no chunk."""
    lens = [C, 1, 0, C + 1, 2 * C - 3, 0, 3 * C]
    cu = torch.tensor([0] + lens).cumsum(0)
    first, ranges = [], []
    for bos, n in zip(cu[:-1].tolist(), lens):
        first.append(len(ranges))
        ranges += [[t, min(t + C, bos + n)] for t in range(bos, bos + n, C)]
    packed = check_offsets("test", cu, None)
    starts, n_chunks = chunk_starts(packed, 1, int(cu[-1]), C, cu.device)
    table_first, table = chunk_table(packed, 1, int(cu[-1]), C, cu.device)
    assert n_chunks == len(ranges) == table.shape[0]
    for got in (starts, table_first):
        assert got.dtype == torch.int32 and got.tolist() == first
    assert table.dtype == torch.int32 and table.tolist() == ranges
