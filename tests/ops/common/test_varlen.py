"""The one check of packed offsets (``check_offsets``, kalmix/ops/common/varlen.py): each breach of the rule a
ValueError naming the offsets and the rule, empty sequences allowed; one host read for a tensor, none for checked
``Offsets``, whichever op and impl takes them."""
import pytest
import torch

from kalmix.ops import SPECS
from kalmix.ops.common.varlen import Offsets, check_offsets, offsets_from_host
from tests.host_reads import HostReads


@pytest.mark.parametrize("cu, kw, match", [
    ([0, 3, 8], {}, None),
    (torch.tensor([0.0, 3, 8]), {}, r"must be a 1-D integer tensor \(int32 or int64\) \[N \+ 1\] of "
                                    r"offsets, got a torch.float32 tensor of shape \[3\]"),
    (torch.tensor([0, 3, 8], dtype=torch.int16), {}, r"1-D integer tensor \(int32 or int64\).*got a torch.int16"),
    (torch.tensor([True, False]), {}, r"1-D integer tensor \(int32 or int64\).*got a torch.bool"),
    (torch.tensor([[0, 3, 8]]), {}, r"1-D integer tensor .* got a torch.int64 tensor of shape \[1, 3\]"),
    ([0, 3, 8], {"as_list": True}, r"1-D integer tensor .* got list"),
    (torch.tensor([0, 3, 8], device="meta"), {}, r"is on meta but the inputs are on cpu"),
    ([], {}, r"must start at 0 and end at T = 8, got \[\] \(N \+ 1 >= 2 offsets for N sequences\)"),
    ([0], {}, r"must start at 0 and end at T = 8, got \[0\] \(N \+ 1 >= 2 offsets for N sequences\)"),
    ([1, 3, 8], {}, r"start at 0 and end at T = 8, got \[1, 3, 8\]"),
    ([0, 3, 7], {}, r"start at 0 and end at T = 8, got \[0, 3, 7\]"),
    ([0, 3, 9], {}, r"end at T = 8, got \[0, 3, 9\]"),
    ([0, 5, 3, 8], {}, r"must be non-decreasing \(equal offsets are an empty sequence\), got cu_seqlens\[2\] = 3 "
                       r"after 5 in \[0, 5, 3, 8\]"),
    ([0, 3, 3, 8, 8], {}, None),                                        # empty sequences: allowed
    ([0, 2, 4, 8], {"row": 4}, None),
    ([0, 3, 8], {"row": 4}, r"must contain every row start of the \[2, 4\] batch \(a document cannot span rows\); "
                            r"missing \[4\] in \[0, 3, 8\]"),
    ([0, 4, 7], {"row": 4}, r"start at 0 and end at B·T = 8 \(the flattened batch\), got \[0, 4, 7\]"),
    ([0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12], {"total": 12, "row": 4},
     r"missing \[8\] in \[0, 1, 2, 3, 4, 5, 6, 7, …, 12\]"),
])
def test_the_rule(cu, kw, match):
    """Every part of the rule: a 1-D int32/int64 tensor on the inputs' device, at least two offsets, 0 first and
    the number of tokens last, non-decreasing (equal offsets: an empty sequence), every row start of a batch."""
    kw = dict(kw)
    total, row, as_list = kw.pop("total", 8), kw.pop("row", None), kw.pop("as_list", False)
    if not isinstance(cu, torch.Tensor) and not as_list:
        cu = torch.tensor(cu, dtype=torch.int64)
    if match is not None:
        with pytest.raises(ValueError, match=f"^test: `cu_seqlens` (.* )?{match}"):
            check_offsets("test", cu, total, torch.device("cpu"), row)
        return
    got = check_offsets("test", cu, total, torch.device("cpu"), row)
    assert got.bounds == tuple(cu.tolist()) and got.tensor.dtype == torch.int32
    assert got.tensor.tolist() == cu.tolist() and got.n == len(cu) - 1
    assert got.lengths == [b - a for a, b in zip(cu.tolist(), cu[1:].tolist())]


def test_host_offsets_follow_the_same_rule():
    """Offsets computed on the host (a piece's, repeated documents') go through the same rule."""
    assert offsets_from_host("t", [0, 2, 2, 5], 5, torch.device("cpu")).tensor.tolist() == [0, 2, 2, 5]
    with pytest.raises(ValueError, match=r"^t: `cu_seqlens` must be non-decreasing"):
        offsets_from_host("t", [0, 3, 2, 5], 5, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^t: `cu_seqlens` must start at 0 and end at the number of tokens, "
                                         r"got \[2, 5\]"):
        offsets_from_host("t", [2, 5], None, torch.device("cpu"))


def test_one_read_for_a_tensor_none_for_offsets():
    """A tensor is read to the host once; checked Offsets are taken with their total and device compared, nothing
    read; a wrong total or device is still an error."""
    cu = torch.tensor([0, 3, 3, 8])
    with HostReads() as reads:
        offsets = check_offsets("t", cu, 8)
    assert reads.count == 1, reads.where
    with HostReads() as reads:
        assert check_offsets("t", offsets, 8, torch.device("cpu")) is offsets
    assert reads.count == 0, reads.where
    with pytest.raises(ValueError, match=r"^t: `cu_seqlens` must end at T = 9, got offsets ending at 8"):
        check_offsets("t", offsets, 9)
    meta = Offsets(torch.tensor([0, 8], device="meta"), (0, 8))
    with pytest.raises(ValueError, match=r"`cu_seqlens` is on meta but the inputs are on cpu"):
        check_offsets("t", meta, 8, torch.device("cpu"))


@pytest.mark.parametrize("name", list(SPECS))
def test_ops_read_a_tensor_once_and_offsets_never(name):
    """Every op and impl: packed by a tensor, one host read (its check; the values are not checked here); by
    checked Offsets, none, in the backward neither; the same outputs. An Offsets of another total is refused."""
    gen = torch.Generator().manual_seed(0)
    args = SPECS[name].inputs(1, 12, 2, 4, 3, torch.float64, gen)
    cu = torch.tensor([0, 5, 5, 6, 12])
    offsets = check_offsets("t", cu, 12)
    for impl in SPECS[name].impls:
        outs = []
        for given, want in ((cu, 1), (offsets, 0)):
            leaves = [a.detach().requires_grad_(given is offsets) for a in args]
            with HostReads() as reads:
                outs.append(SPECS[name].fn(*leaves, cu_seqlens=given, output_final_state=True, impl=impl,
                                           check_values=False))
            assert reads.count == want, (impl, reads.where)
        with HostReads() as reads:
            sum(x.sum() for x in _leaves(outs[-1])).backward()
        assert reads.count == 0, (impl, reads.where)
        for a, b in zip(_leaves(outs[0]), _leaves(outs[1])):
            assert torch.equal(a, b)
        with pytest.raises(ValueError, match=r"`cu_seqlens` must end at T = 11, got offsets ending at 12"):
            SPECS[name].fn(*[a[:, :11] if a.dim() >= 3 else a for a in args], cu_seqlens=offsets, impl=impl)


def _leaves(x) -> list[torch.Tensor]:
    """The tensors of nested tuples (None left out)."""
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _leaves(y)]
    return [] if x is None else [x]
