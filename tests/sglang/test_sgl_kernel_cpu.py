"""The test-support sgl-kernel stand-ins against their contracts (no engine needed).

Each op is checked on a hand-made case and, where SGLang 0.5.23 ships a host-side
implementation of the same contract, against it."""

import numpy as np
import pytest
import torch

from specplug.common import sampling, tree as tree_lib
from specplug.common.sglang_trees import sglang_layout
from tests.support import sgl_kernel_cpu as k


def test_assign_extend_and_req_to_token_are_inverse():
    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    req_pool = torch.tensor([2, 0])
    start, end = torch.tensor([3, 1]), torch.tensor([5, 4])
    out = torch.empty(5, dtype=torch.int64)
    k.assign_extend_cache_locs_cpu(req_pool, req_to_token, start, end, out, 10)
    assert out.tolist() == [23, 24, 1, 2, 3]
    pool = torch.zeros(4, 10, dtype=torch.int32)
    k.assign_req_to_token_pool_cpu(req_pool, pool, start, end, out, 10)
    assert pool[2, 3:5].tolist() == [23, 24] and pool[0, 1:4].tolist() == [1, 2, 3]
    assert int(pool.sum()) == sum(out.tolist())  # nothing else written


def test_fill_accept_out_cache_loc_compacts_in_order():
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1]], dtype=torch.int32)
    out_cache_loc = torch.tensor([100, 101, 102, 103, 104, 105])
    result = torch.full((6,), -7)
    k.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, result)
    assert result.tolist() == [100, 102, 104, -7, -7, -7]


def test_fill_bonus_tokens_takes_last_accepted():
    accept_tokens = torch.tensor([[7, 8, 9], [4, 5, 6]], dtype=torch.int32)
    bonus = torch.zeros(2, dtype=torch.int32)
    k.fill_bonus_tokens_cpu(accept_tokens, torch.tensor([2, 3]), bonus, 3)
    assert bonus.tolist() == [8, 6]


def test_copy_all_layer_kv_cache_reads_all_sources_before_writing():
    buffers = [torch.arange(12, dtype=torch.float32).view(6, 2), torch.arange(6, dtype=torch.int64) * 10]
    before = [b.clone() for b in buffers]
    ptrs = torch.tensor([b.data_ptr() for b in buffers])
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    tgt, src = torch.tensor([1, 2]), torch.tensor([2, 4])  # slot 2 is read AND written
    k.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, old in zip(buffers, before):
        assert torch.equal(b[1], old[2]) and torch.equal(b[2], old[4])
        assert torch.equal(b[[0, 3, 4, 5]], old[[0, 3, 4, 5]])


def _tree_mask_batch(trees):
    return torch.cat([t.attention_mask().flatten() for t in trees])


@pytest.mark.parametrize("seed", range(5))
def test_reconstruct_indices_matches_sglangs_host_version(seed):
    from sglang.srt.speculative.ngram_worker import _derive_tree_links

    g = torch.Generator().manual_seed(seed)
    n, bs = 7, 3
    trees = [tree_lib.DraftTree(torch.zeros(n, dtype=torch.long),
                                torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]))
             for _ in range(bs)]
    mask = _tree_mask_batch(trees)
    seq_lens = torch.tensor([5, 9, 2])
    positions, index = torch.empty(bs * n, dtype=torch.long), torch.empty(bs, n, dtype=torch.long)
    next_token, next_sibling = torch.empty(bs, n, dtype=torch.long), torch.empty(bs, n, dtype=torch.long)
    k.reconstruct_indices_from_tree_mask(mask, seq_lens, positions, index, next_token, next_sibling, bs, n)
    ref_token, ref_sibling = _derive_tree_links(mask.numpy().astype(bool), bs, n)
    assert torch.equal(next_token, ref_token) and torch.equal(next_sibling, ref_sibling)
    depth = torch.stack([t.depth for t in trees])
    assert torch.equal(positions.view(bs, n), depth + seq_lens[:, None])
    assert torch.equal(index, torch.arange(bs * n).view(bs, n))


@pytest.mark.parametrize("seed", range(5))
def test_verify_tree_greedy_agrees_with_specplug_greedy(seed):
    """Same trees, same target argmax: the stand-in's accepted path and bonus equal
    specplug.common.sampling.verify(method="greedy")."""
    g = torch.Generator().manual_seed(seed)
    n, bs, vocab = 6, 4, 3  # tiny vocab so drafts often match
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3]] * bs)
    candidates = torch.randint(0, vocab, (bs, n), generator=g)
    target = torch.randint(0, vocab, (bs, n), generator=g)  # target argmax after each node
    layout = sglang_layout(parents)
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    k.verify_tree_greedy_cpu(predicts, accept_index, accept_num, candidates, *layout, target)
    logits = torch.nn.functional.one_hot(target, vocab).float()
    ref = sampling.verify(candidates, parents, logits, method="greedy")
    assert accept_num.tolist() == ref.num_accepted.tolist()
    for b in range(bs):
        path = ref.accepted_nodes[b, : int(ref.num_accepted[b]) + 1]
        assert accept_index[b, : path.numel()].tolist() == (path + b * n).tolist()
        assert int(predicts[b * n + int(path[-1])]) == int(ref.bonus_token[b])


def test_import_stubs_answer_imports_and_refuse_calls():
    import sgl_kernel
    import torchvision
    from sgl_kernel.kvcacheio import transfer_kv_all_layer  # any submodule, any name
    from torchvision.transforms import InterpolationMode

    assert sgl_kernel.verify_tree_greedy_cpu is k.verify_tree_greedy_cpu
    assert "test.stub" in torchvision.__version__
    with pytest.raises(NotImplementedError, match="test-support placeholder"):
        transfer_kv_all_layer(1)
    with pytest.raises(NotImplementedError):
        InterpolationMode.BICUBIC()
    assert np.asarray(0) == 0  # numpy unaffected by the stubs


def test_murmur_hash32_is_sglangs_kernel():
    """The hash of SGLang's seeded sampler (`sampling_seed`), as the torch op SGLang calls on
    CPU; the expected values are SGLang 0.5.23's Triton kernel (murmur_hash32_kernel, run
    under TRITON_INTERPRET=1) on the same inputs, a negative and a > 32-bit seed included."""
    seed = torch.tensor([4321, -5, 2**40 + 3]).to(torch.uint64)
    positions = torch.tensor([5, 0, 123456])
    expected = [[911365489, 3358899008, 1196340571, 1354826075], [2189798581, 4292763232, 16346941, 2903866390],
                [3099256277, 3935333586, 840362601, 4076699449]]
    out = torch.ops.sgl_kernel.murmur_hash32_cpu.default(seed, positions, torch.arange(4))
    assert out.dtype == torch.uint32 and out.to(torch.int64).tolist() == expected
    from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32

    assert torch.equal(murmur_hash32(seed, positions, torch.arange(4)), out)  # SGLang's CPU dispatch reaches it
