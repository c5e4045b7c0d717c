"""Context parallelism in one process: the 2N-chunk layout, CP packing, and the attention kernel
with every CP rank simulated (K/V whole, as after the all-gather). The 2-rank runs (gloo) are in
test_engine_dist.py (scripts/cp_equivalence.py)."""
import pytest
import torch

from mrl.batch import Batch
from mrl.engine import pack
from mrl.errors import UserError
from mrl.models import context_parallel as CP
from mrl.models.attention import resolve_backend


def test_each_rank_takes_a_front_and_a_back_chunk_of_every_sequence():
    # two sequences padded to 8 and 4 tokens, N = 2: chunks of 2 and 1
    idx0, pos0 = CP.rank_index([8, 4], 2, 0)
    idx1, pos1 = CP.rank_index([8, 4], 2, 1)
    assert idx0.tolist() == [0, 1, 6, 7, 8, 11] and pos0.tolist() == [0, 1, 6, 7, 0, 3]
    assert idx1.tolist() == [2, 3, 4, 5, 9, 10] and pos1.tolist() == [2, 3, 4, 5, 1, 2]
    lay = CP.layout([8, 4], 2, 1)
    gathered = torch.cat([idx0, idx1])          # the ranks' local rows, concatenated in rank order
    assert gathered[lay.inverse].tolist() == list(range(12))
    assert CP.padded_length(13, 2) == 16 and CP.tokens_per_rank(13, 2) == 8 and CP.tokens_per_rank(13, 1) == 13
    with pytest.raises(ValueError, match="multiple of 2 x 2"):
        CP.rank_index([6], 2, 0)


def test_causal_work_is_balanced_over_ranks():
    """Query chunk j attends to j + 1 chunks: every rank does (r + 1) + (2N - r) = 2N + 1 of them."""
    n = 4
    work = [sum(j + 1 for j in (r, 2 * n - 1 - r)) for r in range(n)]
    assert work == [2 * n + 1] * n


def _batch():
    return Batch.from_sequences([[1, 2, 3], [4, 5], [11]], [[6, 7], [8, 9, 10], [12, 13, 14, 15, 16]],
                                loss_masks=[[1, 1], [1, 0, 1], [1, 1, 1, 1, 1]])


def test_cp_pack_splits_the_row_and_maps_responses_back():
    b = _batch()
    plain = pack(b, [0, 1, 2])
    mbs = [pack(b, [0, 1, 2], cp_size=2, cp_rank=r) for r in range(2)]
    # sequences of 5, 5, 6 tokens padded to 8, 8, 8; each rank holds 12
    assert [mb.row_tokens for mb in mbs] == [12, 12]
    lay = mbs[0].cp.layout
    assert lay.lengths == [8, 8, 8]
    gathered_tokens = torch.cat([mb.tokens[0] for mb in mbs])
    # the plain row (sequences back to back) comes back from the gathered local rows
    assert gathered_tokens[mbs[0].cp.row].tolist() == plain.tokens[0, :plain.sequence_tokens].tolist()
    assert sum(int(mb.real.sum()) for mb in mbs) == plain.sequence_tokens == 16
    # positions restart per sequence and follow the chunks
    assert mbs[0].position_ids[0].tolist() == [0, 1, 6, 7] * 3
    # each response token is predicted on exactly one rank; the gather order restores response order
    counts = mbs[0].cp.counts
    assert counts == mbs[1].cp.counts and sum(counts) == plain.response_labels.numel() == 10
    assert [mb.response_labels.numel() for mb in mbs] == list(counts)
    most = max(counts)
    padded = torch.cat([torch.cat([mb.response_labels, mb.response_labels.new_zeros(most - mb.response_labels.numel())])
                        for mb in mbs])
    assert padded[mbs[0].cp.order].tolist() == plain.response_labels.tolist()
    # the local row position of a response token holds the token before its label
    for mb in mbs:
        before = mb.tokens[0, mb.response_positions]
        whole = plain.tokens[0, plain.response_positions]
        assert set(zip(before.tolist(), mb.response_labels.tolist())) <= set(zip(whole.tolist(), plain.response_labels.tolist()))
    # whole-batch counts and the [n, R] map stay those of the micro-batch
    assert mbs[0].loss_tokens == plain.loss_tokens == 9
    assert torch.equal(mbs[1].response_rows, plain.response_rows)
    # the local thd description: two chunks of each sequence; RoPE's table covers the longest
    assert mbs[0].packed_seq_params.cu_seqlens_q.tolist() == [0, 4, 8, 12]
    assert mbs[0].packed_seq_params.max_seqlen_q == 8


def test_cp_pack_pads_the_local_row_for_sequence_parallelism():
    mbs = [pack(_batch(), [0, 1], cp_size=2, cp_rank=r, pad_to_multiple=3) for r in range(2)]
    # 5 + 5 tokens -> 8 + 8, and a padding sequence of 8: 24 = a multiple of 2N x 3, 12 per rank
    assert mbs[0].cp.layout.lengths == [8, 8, 8]
    assert all(mb.row_tokens == 12 for mb in mbs)
    assert sum(int(mb.real.sum()) for mb in mbs) == 10


# bf16: two ulps at the gradients' magnitude (up to ~6 here)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 6.25e-2)])
def test_cp_attention_equals_causal_attention_per_sequence(dtype, tol):
    """Every rank's local queries against the whole K/V (as after the all-gather) give the rows and
    the gradients of plain causal attention over each sequence; GQA 4:2; a sequence shorter than
    the 2N chunks (one token per chunk)."""
    torch.manual_seed(0)
    n = 2
    lengths = [CP.padded_length(x, n) for x in (8, 21, 3)]
    total = sum(lengths)
    q = torch.randn(total, 4, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(total, 2, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(total, 2, 16, dtype=dtype, requires_grad=True)
    ref = CP.reference_attention(q, k, v, lengths, 0.25)
    g = torch.randn_like(ref)
    dq, dk, dv = torch.autograd.grad((ref * g).sum(), (q, k, v))
    out, gq, gk, gv = torch.zeros_like(ref), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r in range(n):
        lay = CP.layout(lengths, n, r)
        qs = q.detach()[lay.index].requires_grad_()
        ks, vs = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
        o = CP._sdpa_cp(qs, ks, vs, lay, 0.25)
        out[lay.index] = o.detach()
        a, b_, c = torch.autograd.grad((o * g[lay.index]).sum(), (qs, ks, vs))
        gq[lay.index] = a
        gk += b_
        gv += c
    for name, got, want in (("out", out, ref), ("dq", gq, dq), ("dk", gk, dk), ("dv", gv, dv)):
        assert (got.float() - want.float()).abs().max().item() <= tol, name


def test_cp_attention_builds_no_score_matrix_of_the_sequence():
    """At 4 x 2048 tokens, one head: the largest buffer the CP kernel allocates is far below one
    [chunk, sequence] fp32 score matrix (2 MB here), let alone [T, T] (256 MB)."""
    from torch.profiler import ProfilerActivity, profile

    n, length = 2, 2048
    lengths = [length] * 4
    total = sum(lengths)
    q = torch.randn(total // n, 1, 32, requires_grad=True)
    k = torch.randn(total, 1, 32, requires_grad=True)
    v = torch.randn(total, 1, 32, requires_grad=True)
    lay = CP.layout(lengths, n, 0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        CP._sdpa_cp(q, k, v, lay, 0.2).sum().backward()
    largest = max(e.cpu_memory_usage for e in prof.events())
    score_chunk = (length // (2 * n)) * length * 4
    assert largest < score_chunk / 2, (largest, score_chunk)


def test_attention_backends_under_context_parallelism():
    assert resolve_backend("auto", "cpu", 2) == "sdpa"
    assert resolve_backend("auto", "cuda", 2) == "varlen"
    with pytest.raises(UserError, match="'sdpa' with parallel.context = 2 runs on CPU only"):
        resolve_backend("sdpa", "cuda", 2)
    for bad in ("te", "flex"):
        with pytest.raises(UserError, match=f"'{bad}' does not take parallel.context = 2"):
            resolve_backend(bad, "cuda", 2)


def test_bf16_cp_attention_rounds_as_the_whole_sequence_call():
    """CP2's split softmax (each query chunk against its earlier chunks and its own, merged) in
    bf16 gives CP1's `sdpa` output and q/K/V gradients up to float32 order: both run the float32
    flash kernel and round once (`mrl.models.flash_cpu`), the K/V gradients of the chunks and
    ranks summed in float32. Elements that differ are float32 sums landing on the other side of a
    bf16 rounding boundary: one bf16 ulp, in well under 1% of the elements (the kernel that merged
    two bf16 outputs differed in 45% of the outputs and 60% of dK: tools/bench/cp_bf16_rounding.py)."""
    from mrl.models.attention import sdpa_packed

    torch.manual_seed(0)
    n, dt = 2, torch.bfloat16
    lengths = [CP.padded_length(x, n) for x in (130, 41, 8)]
    total = sum(lengths)
    q = torch.randn(total, 4, 16, dtype=dt, requires_grad=True)
    k = torch.randn(total, 2, 16, dtype=dt, requires_grad=True)
    v = torch.randn(total, 2, 16, dtype=dt, requires_grad=True)
    cp1 = sdpa_packed(q, k, v, torch.tensor([0] + lengths).cumsum(0), 0.25)
    g = torch.randn_like(cp1)
    want = [cp1.detach(), *torch.autograd.grad((cp1 * g).sum(), (q, k, v))]
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)   # the ranks' sum (the all-reduce) in float32
    for r in range(n):
        lay = CP.layout(lengths, n, r)
        qs = q.detach()[lay.index].requires_grad_()
        ks, vs = k.detach().float().requires_grad_(), v.detach().float().requires_grad_()
        o = CP._sdpa_cp(qs, ks, vs, lay, 0.25)
        assert o.dtype == dt
        out[lay.index] = o.detach()
        a, b_, c = torch.autograd.grad((o * g[lay.index]).sum(), (qs, ks, vs))
        dq[lay.index] = a
        dk += b_
        dv += c
    for name, got, w in zip(("out", "dq", "dk", "dv"), (out, dq, dk.to(dt), dv.to(dt)), want):
        differ = got != w
        assert differ.float().mean().item() < 0.01, name
        ulp = torch.ldexp(torch.ones(()), torch.frexp(w[differ].float().abs())[1] - 8)
        assert ((got[differ].float() - w[differ].float()).abs() <= ulp).all(), name


@pytest.mark.parametrize("gqa_kernel,dtype,tol", [(True, torch.float32, 2e-6), (False, torch.float32, 2e-6),
                                                   (True, torch.bfloat16, 6.25e-2)])
def test_varlen_cp_plumbing_with_a_stand_in_kernel(monkeypatch, gqa_kernel, dtype, tol):
    """The CUDA path's bookkeeping on CPU: torch's `varlen_attn` (CUDA only) replaced by a dense
    stand-in with its contract (per query "sequence", a bottom-right causal mask over its key
    "sequence"; `enable_gqa` or K/V repeated per query head, as torch releases differ). Every
    rank's chunks against their key prefixes give causal attention per sequence and its
    gradients; the kernel gets K/V in q's dtype, cut from float32 rows whose gradients stay
    float32 (summed over chunks there)."""
    import inspect

    import torch.nn.attention.varlen as varlen

    seen = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert window_size == (-1, 0) and k.dtype == q.dtype and v.dtype == q.dtype
        seen.append((k.shape[1], enable_gqa))
        outs = []
        for i in range(len(cu_q) - 1):
            qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
            rep = qs.shape[1] // ks.shape[1]
            ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
            nq, nk = qs.shape[0], ks.shape[0]
            mask = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)   # bottom-right
            o = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (qs, ks, vs)),
                                                                 attn_mask=mask, scale=scale)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    if not gqa_kernel:   # a torch release without `enable_gqa`
        stand_in.__signature__ = inspect.Signature([p for p in inspect.signature(stand_in).parameters.values()
                                                    if p.name != "enable_gqa"])
    monkeypatch.setattr(varlen, "varlen_attn", stand_in)
    torch.manual_seed(0)
    n = 2
    lengths = [CP.padded_length(x, n) for x in (8, 21, 3)]
    total = sum(lengths)
    # inputs rounded to `dtype`; the reference in float32
    q, k, v = (torch.randn(total, h, 16).to(dtype).float().requires_grad_() for h in (4, 2, 2))
    ref = CP.reference_attention(q, k, v, lengths, 0.25)
    g = torch.randn_like(ref)
    want = [ref.detach(), *torch.autograd.grad((ref * g).sum(), (q, k, v))]
    out, gq, gk, gv = torch.zeros_like(ref), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r in range(n):
        lay = CP.layout(lengths, n, r)
        qs = q.detach()[lay.index].to(dtype).requires_grad_()
        ks, vs = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()   # float32 rows
        o = CP._varlen_cp(qs, ks, vs, lay, 0.25)
        assert o.dtype == dtype
        out[lay.index] = o.detach().float()
        a, b_, c = torch.autograd.grad((o.float() * g[lay.index]).sum(), (qs, ks, vs))
        assert b_.dtype == c.dtype == torch.float32
        gq[lay.index] = a.float()
        gk += b_
        gv += c
    assert set(seen) == ({(2, True)} if gqa_kernel else {(4, False)})
    for name, got, w in zip(("out", "dq", "dk", "dv"), (out, gq, gk, gv), want):
        assert (got - w).abs().max().item() <= tol, name
