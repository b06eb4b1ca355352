"""Triton kernels against their torch references, fresh random inputs, odd sizes. On the
CPU they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
on a GPU the same tests run the compiled kernels at real sizes too.
Tolerances, relative to the largest output: float32 1e-5; bfloat16 4 ulp (2^-6): the
kernels round once where the references round after each op, and the interpreter's
bfloat16 rounding differs from the GPU's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kiln.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from tests.decode_cases import DEV, decode_batch, spy_launches

TOL = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8}
SIZES = [(1, 8), (3, 769), (17, 576)] + ([(257, 4096), (1000, 5120)] if DEV == "cuda" else [])


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    scale = b.float().abs().max().clamp_min(1e-30)
    rel = float((a.float() - b.float()).abs().max() / scale)
    assert rel <= TOL[dtype], f"relative error {rel:.3e} > {TOL[dtype]:.1e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h", SIZES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel(dtype: torch.dtype, t: int, h: int, with_residual: bool) -> None:
    x = torch.randn(t, h, device=DEV, dtype=dtype)
    w = torch.randn(h, device=DEV, dtype=dtype)
    r = torch.randn(t, h, device=DEV, dtype=dtype) if with_residual else None
    out, res = rms_norm_triton(x, w, 1e-5, r)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, r)
    _close(out, ref, dtype)
    if with_residual:
        _close(res, ref_res, dtype)
    else:
        assert res is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "t,i", [(1, 3), (5, 771), (9, 1536)] + ([(513, 14336)] if DEV == "cuda" else [])
)
def test_silu_and_mul_kernel(dtype: torch.dtype, t: int, i: int) -> None:
    x = torch.randn(t, 2 * i, device=DEV, dtype=dtype) * 3
    _close(silu_and_mul_triton(x), silu_and_mul_ref(x), dtype)


def test_strided_rows() -> None:
    """A row stride larger than the row (a view into a wider tensor) is honoured."""
    base = torch.randn(6, 200, device=DEV)
    x = base[:, :150]
    w = torch.randn(150, device=DEV)
    _close(rms_norm_triton(x, w, 1e-6)[0], rms_norm_ref(x, w, 1e-6)[0], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else []))
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("nb", [1, 2, 4])
def test_paged_decode_attention_kernel(
    dtype: torch.dtype, splits: int | None, window: int | None, nb: int
) -> None:
    """GQA with 4 query heads per kv head, odd context lengths, scattered blocks; one, two
    or four KV blocks per step of the online softmax (contexts not a whole number of
    steps, splits of whole steps)."""
    from kiln.kernels.attention import paged_attention_ref
    from kiln.kernels.decode_attention import decode_attention_triton

    torch.manual_seed(0)
    ctx = [1, 15, 16, 17, 33, 100, 141] if DEV == "cpu" else [1, 17, 255, 1000, 4097, 8191]
    d = 32
    q, cache, bt, lens, meta = decode_batch(ctx, 16, 2, 8, d, dtype, spare=3)
    out = torch.zeros_like(q)
    tok = torch.arange(len(ctx), device=DEV)
    decode_attention_triton(
        q, cache, bt, lens, tok, out, d**-0.5, max(ctx), window, splits, blocks_per_step=nb
    )
    ref = paged_attention_ref(q, cache, meta, d**-0.5, window)
    _close(out, ref, dtype)


@pytest.mark.gpu
def test_attention_dispatcher_mixed_step_on_gpu() -> None:
    """A step with prefill chunks and decode tokens: Triton decode + reference prefill equal
    the reference for the whole step (bf16)."""
    from kiln.kernels.attention import AttentionMetadata, paged_attention, paged_attention_ref

    torch.manual_seed(3)
    bs, hk, hq, d = 32, 8, 32, 128
    ctx, new = [700, 1, 33, 4000, 90, 513], [1, 1, 33, 1, 20, 1]
    nblocks = sum(-(-c // bs) for c in ctx) + 1
    cache = torch.randn(2, nblocks, bs, hk, d, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(nblocks).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctx]
    width = max(map(len, tables))
    starts = [0, *torch.tensor(new).cumsum(0).tolist()]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device="cuda"),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda"
        ),
        slot_mapping=torch.zeros(sum(new), dtype=torch.long, device="cuda"),
        query_start_loc_cpu=starts,
        seq_lens_cpu=ctx,
    )
    q = torch.randn(sum(new), hq, d, device="cuda", dtype=torch.bfloat16)
    _close(
        paged_attention(q, cache, meta, d**-0.5),
        paged_attention_ref(q, cache, meta, d**-0.5),
        torch.bfloat16,
    )


@pytest.mark.parametrize("splits,switch,bs", [(1, 1, 8), (2, 1, 8), (1, 0, 8), (1, 1, 2)])
def test_decode_attention_one_split_writes_the_output_itself(splits: int, switch: int, bs: int,
                                                             monkeypatch) -> None:  # fmt: skip
    """With one split the partial kernel writes the normalized output (``DIRECT``) and the
    reduction is not launched; with two, or ``KILN_DECODE_DIRECT=0``, both run; the output
    is the reference's either way (odd contexts; over an fp8 cache: ``test_kv_fp8.py``).
    Blocks of 8 and 2 tokens: fewer than the 16 tokens a step that tl.dot needs on a GPU,
    so the kernel takes several blocks a step."""
    from kiln.kernels import decode_attention as da
    from kiln.kernels.attention import paged_attention_ref

    def check(k: dict) -> None:  # the GPU's tl.dot needs a step of 16 or more tokens
        assert "NB" not in k or k["NB"] * k["BS"] >= 16  # (P @ V's K)

    monkeypatch.setattr(da, "DIRECT", switch)
    kernels = {"partial": "_decode_partial", "reduce": "_decode_reduce"}
    launched = spy_launches(monkeypatch, da, kernels, "DIRECT", check)
    torch.manual_seed(splits)
    d = 16
    q, cache, bt, lens, meta = decode_batch([1, 7, 8, 9, 30], bs, 2, 6, d, torch.float32)
    tok = torch.arange(q.shape[0], device=DEV)
    out = torch.full_like(q, float("nan"))
    da.decode_attention_triton(
        q, cache, bt, lens, tok, out, d**-0.5, 32, None, splits, blocks_per_step=1
    )
    _close(out, paged_attention_ref(q, cache, meta, d**-0.5), torch.float32)
    direct = splits == 1 and switch == 1
    assert launched == [("partial", direct)] + ([] if direct else [("reduce", None)])


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 5, 64])
@pytest.mark.parametrize("nb", [1, 4])
def test_decode_attention_with_a_graph_bound(splits: int | None, nb: int) -> None:
    """As a CUDA graph runs it: ``max_seq_len`` far above every context (the engine's
    limit), splits fixed in advance; contexts from 1 token to 32k."""
    from kiln.kernels.attention import AttentionMetadata, paged_attention_ref
    from kiln.kernels.decode_attention import decode_attention_triton

    torch.manual_seed(5)
    bs, hk, hq, d = 32, 8, 32, 128
    ctx = [1, 2, 31, 32, 33, 1000, 8191, 32768]
    nblocks = sum(-(-c // bs) for c in ctx) + 1
    cache = torch.randn(2, nblocks, bs, hk, d, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(nblocks).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctx]
    width = 131072 // bs
    n = len(ctx)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    bt = bt.cuda()
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device="cuda"),
        seq_lens=lens,
        block_tables=bt,
        slot_mapping=torch.zeros(n, dtype=torch.long, device="cuda"),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=ctx,
    )
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    tok = torch.arange(n, device="cuda")
    decode_attention_triton(
        q, cache, bt, lens, tok, out, d**-0.5, 131072, None, splits, blocks_per_step=nb
    )
    _close(out, paged_attention_ref(q, cache, meta, d**-0.5), torch.bfloat16)


def test_pdl_only_on_compiled_hopper_kernels(monkeypatch) -> None:
    """Programmatic dependent launch is off for CPU tensors, under the interpreter, before
    compute capability 9, with KILN_PDL=0 and for steps of more than ``MAX_ROWS`` rows;
    level 1 launches the projections as dependents (the small kernels only trigger),
    level 2 every decode-layer kernel."""
    from kiln.kernels import pdl

    def cuda(rows: int) -> SimpleNamespace:  # what pdl reads of a CUDA tensor
        return SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0), shape=(rows, 8))

    for major, interpret, level, want, mode in (
        (9, False, 1, True, 1), (10, False, 2, True, 2), (9, False, 3, True, 2),
        (8, False, 1, False, 0), (9, True, 1, False, 0), (9, False, 0, False, 0),
    ):  # fmt: skip
        monkeypatch.setattr(pdl, "_capability_major", lambda i, m=major: m)
        monkeypatch.setattr(pdl, "INTERPRET", interpret)
        monkeypatch.setattr(pdl, "LEVEL", level)
        for rows in (1, pdl.MAX_ROWS):
            assert pdl.pdl(cuda(rows)) is want and pdl.mode(cuda(rows)) == mode, (major, level)
        assert not pdl.pdl(cuda(pdl.MAX_ROWS + 1)) and pdl.mode(cuda(pdl.MAX_ROWS + 1)) == 0
        assert not pdl.pdl(torch.zeros(1)) and pdl.mode(torch.zeros(1)) == 0


def test_pdl_dependents_always_wait(monkeypatch) -> None:
    """Every launcher that launches a kernel as a programmatic dependent (``launch_pdl``)
    compiles that kernel's wait in (``PDL`` 2, or True for the skinny GEMV), and with PDL on
    every decode-layer kernel gets the constant: a dependent that did not wait would read
    the previous kernel's output before it is written. Checked on the CPU by recording the
    launches instead of running them."""
    from kiln.kernels import activation, decode_attention, gemv, pdl, rmsnorm, rotary, wq_mma
    from kiln.kernels.decode_attention import decode_attention_triton
    from kiln.kernels.gemv import skinny_matmul_triton, split_k_reduce
    from kiln.layers.rotary import RotaryEmbedding

    calls: list[tuple[str, dict]] = []

    class Rec:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((self.name, k))

    monkeypatch.setattr(pdl, "mode", lambda x: 2)
    monkeypatch.setattr(pdl, "pdl", lambda x: True)
    for mod, name in ((rmsnorm, "_rms_norm_kernel"), (activation, "_silu_mul_kernel"),
                      (gemv, "_skinny_kernel"), (gemv, "_split_k_reduce"),
                      (decode_attention, "_decode_partial"), (decode_attention, "_decode_reduce"),
                      (rotary, "_rotary_kv_kernel"), (wq_mma, "_wq4_mma_kernel")):  # fmt: skip
        monkeypatch.setattr(mod, name, Rec(name))
    rms_norm_triton(torch.randn(3, 40), torch.randn(40), 1e-6, torch.randn(3, 40))
    silu_and_mul_triton(torch.randn(3, 80))
    skinny_matmul_triton(torch.randn(1, 4096), torch.randn(16, 4096))
    split_k_reduce(torch.randn(2, 3, 40), torch.empty(3, 40), None)
    cache = torch.randn(2, 4, 16, 2, 64)
    q = torch.randn(2, 4, 64)
    lens = torch.tensor([5, 20], dtype=torch.int32)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    decode_attention_triton(q, cache, bt, lens, torch.arange(2), torch.empty_like(q), 0.125, 32)
    cs = RotaryEmbedding(64, 64, 10000.0, None).cos_sin(torch.device("cpu"))
    rotary.rotary_write_kv_triton(torch.randn(2, 8 * 64), torch.tensor([3, 7]), cs, cache,
                                  torch.tensor([3, 40]), 4, 2, 64)  # fmt: skip
    words = torch.zeros(16, 128, dtype=torch.uint8)
    wq_mma.wq4_mma(torch.randn(1, 256).bfloat16(), words, torch.ones(16, 2), words[:, :2])
    names = {n for n, _ in calls}
    assert names == {"_rms_norm_kernel", "_silu_mul_kernel", "_skinny_kernel",
                     "_split_k_reduce", "_decode_partial", "_decode_reduce",
                     "_rotary_kv_kernel", "_wq4_mma_kernel"}  # fmt: skip
    for name, kw in calls:
        boolean = name in ("_skinny_kernel", "_wq4_mma_kernel")  # True: waits inside
        waits = kw["PDL"] is True if boolean else kw["PDL"] == 2
        assert kw["launch_pdl"] and waits, (name, kw.get("PDL"), kw.get("launch_pdl"))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_attention_sees_the_token_written_before_it_in_a_graph(fp8: bool) -> None:
    """Decode attention reads its first chunk of K and V before it waits for the kernel
    before it (``KILN_DECODE_PREFETCH``, programmatic dependent launch): in a CUDA graph
    that poisons the new tokens' cache slots, then writes them (rotary + KV write), then
    runs decode attention, the output still matches the reference on the final cache."""
    from kiln.kernels.attention import AttentionMetadata, dequantize_cache, paged_attention_ref
    from kiln.kernels.decode_attention import decode_attention_triton
    from kiln.kernels.rotary import rotary_write_kv_triton
    from kiln.layers.rotary import RotaryEmbedding

    torch.manual_seed(11)
    bs, hk, hq, d = 32, 8, 32, 128
    ctx = [1, 31, 32, 33, 150, 1000, 4096]
    n = len(ctx)
    nblocks = sum(-(-c // bs) for c in ctx) + 1
    cache = torch.randn(2, nblocks, bs, hk, d, device="cuda", dtype=torch.bfloat16)
    scales = torch.tensor([0.02, 0.05], device="cuda") if fp8 else None
    if fp8:
        from kiln.kernels.attention import KV_FP8

        cache = (cache * 8).clamp(-448, 448).to(KV_FP8)
    perm = torch.randperm(nblocks).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctx]
    bt = torch.tensor([t + [0] * (4096 // bs - len(t)) for t in tables], dtype=torch.int32)
    bt, lens = bt.cuda(), torch.tensor(ctx, dtype=torch.int32, device="cuda")
    last = [t[(c - 1) // bs] * bs + (c - 1) % bs for t, c in zip(tables, ctx, strict=True)]
    slots = torch.tensor(last, device="cuda")
    pos = lens.long() - 1
    cos_sin = RotaryEmbedding(d, 8192, 10000.0, None).cos_sin(torch.device("cuda"))
    qkv = torch.randn(n, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    tok = torch.arange(n, device="cuda")
    out = torch.empty(n, hq, d, device="cuda", dtype=torch.bfloat16)
    blk, off = slots // bs, slots % bs

    raw = cache.view(torch.uint8) if fp8 else cache
    # an fp8 cache's values are transposed per block: (hk, d, bs) within it
    raw_v = raw[1].view(nblocks, hk, d, bs) if fp8 else raw[1].permute(0, 2, 3, 1)

    poison = torch.full((n, hk, d), 0x7E if fp8 else 100, device="cuda").to(raw.dtype)

    def step() -> None:  # poison the new tokens' slots (e4m3 448 in an fp8 cache), then
        raw[0, blk, off] = poison  # write them, then attend
        raw_v[blk, :, :, off] = poison
        q = rotary_write_kv_triton(qkv, pos, cos_sin, cache, slots, hq, hk, d, scales)
        decode_attention_triton(q, cache, bt, lens, tok, out, d**-0.5, 4096, kv_scale=scales)

    step()  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        q = rotary_write_kv_triton(qkv, pos, cos_sin, cache.clone(), slots, hq, hk, d, scales)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device="cuda"),
            seq_lens=lens, block_tables=bt, slot_mapping=slots,
            query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=ctx,
        )  # fmt: skip
        plain = dequantize_cache(cache, scales) if fp8 else cache
        ref = paged_attention_ref(q.float(), plain.float(), meta, d**-0.5)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
