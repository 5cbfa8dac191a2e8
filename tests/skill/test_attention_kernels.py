"""The packed-document attention kernels the edits copy into packages (skill/snippets/attention.py).

Every kernel, on every path it can take, against one plain computation over the whole
packed row with a ``[T, T]`` document mask: the CPU path (one call per document), flex
attention's block mask, score_mod and log-sum-exp (the CUDA path; its forward runs on CPU
uncompiled, so its semantics are proved here), the sink fold from that log-sum-exp
(gradients included), and the flash varlen call of a sliding window driven by stand-ins
carrying each torch version's signature (tests/varlen_standins.py). Sinks are also checked
against transformers' own eager functions (granite_swa's sigmoid(lse - sink) rescaling
and gpt_oss's extra softmax column).
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from skill.snippets import attention
from skill.snippets.attention import (
    AlibiAttention,
    EagerAttention,
    SinkAttention,
    SlidingWindowAttention,
    SoftCappedAlibiAttention,
    SoftCappedSinkAttention,
    WindowedAlibiAttention,
    alibi_slopes,
    flex_functions,
    flex_packed,
    fold_sinks,
    per_document,
)
from tests import varlen_standins

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
DOC_LENS = (7, 13, 4)
SCALE = 0.3


def _inputs(trailing: int = 0, seed: int = 0):
    """Packed q/k/v of DOC_LENS (plus ``trailing`` padding tokens past cu_seqlens[-1])."""
    g = torch.Generator().manual_seed(seed)
    total = sum(DOC_LENS) + trailing
    q = torch.randn(1, HEADS, total, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(DOC_LENS).cumsum(0).tolist()], dtype=torch.int32)
    sinks = torch.randn(HEADS, generator=g, dtype=torch.float64)
    return q, k, v, cu, sinks


def _reference(q, k, v, cu, window=None, softcap=None, sinks=None):
    """The whole packed row at once: a [T, T] mask of same document, causal, in window."""
    total = q.shape[2]
    pos = torch.arange(total)
    doc = torch.searchsorted(cu.long(), pos, right=True)
    distance = pos[:, None] - pos[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (distance >= 0)
    if window is not None:
        allowed &= distance < window
    keys = k.repeat_interleave(HEADS // KV_HEADS, 1)
    values = v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = q @ keys.transpose(2, 3) * SCALE
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(1, HEADS, total, 1)], -1)
        return torch.softmax(scores, -1)[..., :-1] @ values
    return torch.softmax(scores, -1) @ values


VARIANTS = {
    "window": (lambda: SlidingWindowAttention(5), {"window": 5}),
    "softcap": (lambda: EagerAttention(0.7, None), {"softcap": 0.7}),
    "softcap+window": (lambda: EagerAttention(0.7, 5), {"softcap": 0.7, "window": 5}),
    "window only, eager": (lambda: EagerAttention(None, 5), {"window": 5}),
    "sinks": (lambda: SinkAttention(None), {"sinks": True}),
    "sinks+window": (lambda: SinkAttention(5), {"sinks": True, "window": 5}),
    "sinks+softcap": (lambda: SoftCappedSinkAttention(0.7, None), {"sinks": True, "softcap": 0.7}),
    "sinks+softcap+window": (lambda: SoftCappedSinkAttention(0.7, 5), {"sinks": True, "softcap": 0.7, "window": 5}),
}


def _call(kernel, driver, q, k, v, cu, sinks, expects):
    kw = {"sinks": sinks} if "sinks" in expects else {}
    if driver == "forward":
        return kernel(q, k, v, scale=SCALE, cu_seqlens=cu, max_seqlen=max(DOC_LENS), **kw)
    if driver == "per_document":
        return per_document(kernel.attend, q, k, v, cu, scale=SCALE, **kw)
    # The CUDA path, forward only (flex attention has no CPU backward), in fp32.
    q, k, v = (t.float() for t in (q, k, v))
    if isinstance(kernel, SlidingWindowAttention):
        out, _ = flex_packed(q, k, v, cu, SCALE, kernel.window)
    elif isinstance(kernel, SinkAttention):
        out = kernel.flex(q, k, v, sinks.float(), cu, SCALE)
    else:
        out = kernel.flex(q, k, v, cu, scale=SCALE)
    return out.double()


@pytest.mark.parametrize("trailing", [0, 3], ids=["exact", "trailing-padding"])
@pytest.mark.parametrize("driver", ["forward", "per_document", "flex"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_matches_whole_row_reference(variant, driver, trailing):
    make, expects = VARIANTS[variant]
    q, k, v, cu, sinks = _inputs(trailing)
    got = _call(make(), driver, q, k, v, cu, sinks, expects)
    window, softcap = expects.get("window"), expects.get("softcap")
    want = _reference(q, k, v, cu, window=window, softcap=softcap, sinks=sinks if "sinks" in expects else None)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if driver == "flex" else {}
    torch.testing.assert_close(got, want, **tolerance)


def _attention_with_lse(q, k, v, cu, window):
    """Per-document causal (windowed) attention and each row's log-sum-exp, written out
    (differentiable, float64): what flex attention returns on CUDA."""
    outs, lses = [], []
    n_rep = HEADS // KV_HEADS
    for start, end in itertools.pairwise(cu.tolist()):
        sl = slice(start, end)
        scores = q[:, :, sl] @ k[:, :, sl].repeat_interleave(n_rep, 1).transpose(2, 3) * SCALE
        distance = torch.arange(end - start)[:, None] - torch.arange(end - start)[None, :]
        allowed = distance >= 0
        if window is not None:
            allowed &= distance < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.softmax(scores, -1) @ v[:, :, sl].repeat_interleave(n_rep, 1))
        lses.append(torch.logsumexp(scores, -1))
    return torch.cat(outs, 2), torch.cat(lses, 2)


@pytest.mark.parametrize("window", [None, 5])
def test_sink_fold_from_the_log_sum_exp_matches_the_extra_softmax_column(window):
    """``out * sigmoid(lse - sink)`` is HF's softmax over the scores and the sink, values
    and gradients (q, k, v and the sinks): the CUDA path's only sink arithmetic."""
    q, k, v, cu, sinks = _inputs()
    leaves = [t.requires_grad_(True) for t in (q, k, v, sinks)]
    out, lse = _attention_with_lse(q, k, v, cu, window)
    got = fold_sinks(out, lse, sinks)
    want = _reference(q, k, v, cu, window=window, sinks=sinks)
    torch.testing.assert_close(got, want)
    weights = torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view_as(got)
    got_grads = torch.autograd.grad((got * weights).sum(), leaves)
    want_grads = torch.autograd.grad((want * weights).sum(), leaves)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_flex_log_sum_exp_is_the_natural_log_of_the_scaled_scores():
    """The fold needs flex's log-sum-exp in the scores' own units (natural log, scale applied)."""
    q, k, v, cu, _ = (t.float() if t.is_floating_point() else t for t in _inputs())
    _, lse = flex_packed(q, k, v, cu, SCALE, 5)
    _, want = _attention_with_lse(q.double(), k.double(), v.double(), cu, 5)
    torch.testing.assert_close(lse.double(), want, rtol=1e-5, atol=1e-5)


def test_cuda_takes_compiled_flex_and_the_cpu_eager():
    """Uncompiled flex attention materialises the scores: the CUDA path's pair is compiled
    (once per process), the CPU path (its tests) runs the functions themselves."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = flex_functions(True)
    assert [fn._torchdynamo_orig_callable for fn in compiled] == [flex_attention, create_block_mask]
    assert flex_functions(True) is compiled
    assert flex_functions(False) == (flex_attention, create_block_mask)


@pytest.fixture
def torch_kernel(monkeypatch):
    """Install a stand-in as ``torch.nn.attention.varlen.varlen_attn`` (and re-read its keywords)."""
    import torch.nn.attention.varlen as torch_varlen

    varlen_standins.CALLS.clear()

    def install(standin):
        monkeypatch.setattr(torch_varlen, "varlen_attn", standin)
        attention.flash_varlen_keywords.cache_clear()

    yield install
    attention.flash_varlen_keywords.cache_clear()


@pytest.mark.parametrize("version", ["2.11", "2.13"])
def test_sliding_window_flash_call_matches_reference_on_each_torch(torch_kernel, version):
    """The window's flash call, as each torch version that takes a window is asked: 2.11
    has no enable_gqa (key/value heads repeated), 2.13 has it. Gradients included."""
    torch_kernel(varlen_standins.VERSIONS[version])
    q, k, v, cu, _ = _inputs()
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    got = SlidingWindowAttention(5).flash(q, k, v, cu, max(DOC_LENS), SCALE)
    assert [c["version"] for c in varlen_standins.CALLS] == [version]
    assert varlen_standins.CALLS[0]["window_size"] == (4, 0)
    want = _reference(q, k, v, cu, window=5)
    torch.testing.assert_close(got, want)
    weights = torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view_as(got)
    got_grads = torch.autograd.grad((got * weights).sum(), leaves)
    want_grads = torch.autograd.grad((want * weights).sum(), leaves)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_flash_window_needs_a_torch_whose_kernel_takes_one(torch_kernel):
    """torch 2.10's kernel takes no window: the sliding window does not ask it (CUDA runs
    compiled flex instead); 2.11 and 2.13 take one."""
    for version, window in (("2.10", False), ("2.11", True), ("2.13", True)):
        torch_kernel(varlen_standins.VERSIONS[version])
        assert ({"window_size", "scale"} <= attention.flash_varlen_keywords()) is window, version


@pytest.mark.parametrize(("softcap", "window"), [(0.7, None), (0.7, 5), (None, 5)])
def test_flex_path_matches_reference(softcap, window):
    """The CUDA path's block mask (documents, causality, window) and soft-cap score_mod,
    run forward on CPU (flex attention has no CPU backward)."""
    q, k, v, cu, _ = _inputs(trailing=3)
    q, k, v = (t.float() for t in (q, k, v))
    got = EagerAttention(softcap, window).flex(q, k, v, cu, scale=SCALE)
    want = _reference(q.double(), k.double(), v.double(), cu, window=window, softcap=softcap)
    torch.testing.assert_close(got, want.float())


def _hf_module(sinks: torch.Tensor) -> types.SimpleNamespace:
    return types.SimpleNamespace(sinks=sinks, num_key_value_groups=HEADS // KV_HEADS, training=False)


@pytest.mark.parametrize("family", ["granite_swa", "gpt_oss"])
@pytest.mark.parametrize("window", [None, 5])
def test_sinks_match_transformers_eager(family, window):
    """SinkAttention on each document equals the family's own eager attention function
    (granite_swa rescales by sigmoid(lse - sink); gpt_oss adds a softmax column)."""
    module = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    q, k, v, cu, sinks = (t.float() if t.is_floating_point() else t for t in _inputs())
    got = SinkAttention(window)(q, k, v, sinks=sinks, scale=SCALE, cu_seqlens=cu, max_seqlen=max(DOC_LENS))
    bounds = cu.tolist()
    for start, end in itertools.pairwise(bounds):
        n = end - start
        distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        allowed = distance >= 0
        if window is not None:
            allowed &= distance < window
        mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
        want, _ = module.eager_attention_forward(
            _hf_module(sinks), q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], mask, scaling=SCALE
        )
        torch.testing.assert_close(got[:, :, start:end], want.transpose(1, 2))


def test_sliding_window_counts_the_query_itself():
    """A window of 1 sees only the token itself: the output is v (HF: distance < window)."""
    q, k, v, cu, _ = _inputs()
    out = SlidingWindowAttention(1)(q, k, v, scale=SCALE, cu_seqlens=cu, max_seqlen=max(DOC_LENS))
    torch.testing.assert_close(out, v.repeat_interleave(HEADS // KV_HEADS, 1))


ALIBI_HEADS, ALIBI_KV_HEADS = 6, 3  # not a power of two: the slopes' second sequence is used


def _alibi_inputs(trailing: int = 0):
    g = torch.Generator().manual_seed(1)
    total = sum(DOC_LENS) + trailing
    q = torch.randn(1, ALIBI_HEADS, total, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(1, ALIBI_KV_HEADS, total, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(1, ALIBI_KV_HEADS, total, HEAD_DIM, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(DOC_LENS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def _alibi_reference(q, k, v, cu, slopes, window=None, softcap=None):
    """The whole packed row: same document, causal (within the last ``window`` tokens, when
    given), and each head's slope times the key's position within its document (Bloom's
    form: the query's own position is a per-row constant softmax ignores), added after
    the ``softcap`` when given."""
    total = q.shape[2]
    pos = torch.arange(total)
    bounds = torch.cat([cu.long(), torch.tensor([total])]) if int(cu[-1]) < total else cu.long()
    doc = torch.searchsorted(bounds, pos, right=True) - 1
    in_doc = pos - bounds[doc]
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    n_rep = ALIBI_HEADS // ALIBI_KV_HEADS
    scores = q @ k.repeat_interleave(n_rep, 1).transpose(2, 3) * SCALE
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + slopes.double().view(1, -1, 1, 1) * in_doc.double().view(1, 1, 1, -1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v.repeat_interleave(n_rep, 1)


@pytest.mark.parametrize("n_heads", range(1, 65))
def test_alibi_slopes_are_bloom_and_mpt_slopes(n_heads):
    """One formula is both families' slopes, for every head count (powers of two and not)."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    mpt = pytest.importorskip("transformers.models.mpt.modeling_mpt")
    slopes = alibi_slopes(n_heads)
    torch.testing.assert_close(slopes, bloom._get_alibi_slopes(n_heads, torch.device("cpu")), rtol=0, atol=0)
    # MPT's tensor is slope * (key - (L - 1)): the key one before the last has -slope.
    mpt_slopes = -mpt.build_mpt_alibi_tensor(n_heads, 3)[:, 0, -2]
    torch.testing.assert_close(slopes, mpt_slopes, rtol=1e-6, atol=0)


ALIBI_VARIANTS = {
    "alibi": (AlibiAttention, {}),
    "alibi+window1": (lambda: WindowedAlibiAttention(1), {"window": 1}),
    "alibi+window5": (lambda: WindowedAlibiAttention(5), {"window": 5}),
    "alibi+softcap": (lambda: SoftCappedAlibiAttention(0.7), {"softcap": 0.7}),
    "alibi+softcap+window5": (lambda: SoftCappedAlibiAttention(0.7, 5), {"softcap": 0.7, "window": 5}),
}


@pytest.mark.parametrize("variant", list(ALIBI_VARIANTS))
@pytest.mark.parametrize("trailing", [0, 3], ids=["exact", "trailing-padding"])
@pytest.mark.parametrize("driver", ["forward", "per_document", "flex"])
def test_alibi_matches_whole_row_reference(driver, trailing, variant):
    """Positions restart at every document: each document alone gets the bias it would get
    unpacked. The flex path (CUDA's) runs forward on CPU here. With a window,
    WindowedAlibiAttention also hides the keys behind it; SoftCappedAlibiAttention caps the
    scores before the bias."""
    q, k, v, cu = _alibi_inputs(trailing)
    slopes = alibi_slopes(ALIBI_HEADS)
    make, expects = ALIBI_VARIANTS[variant]
    kernel = make()
    if driver == "forward":
        got = kernel(q, k, v, slopes=slopes, scale=SCALE, cu_seqlens=cu, max_seqlen=max(DOC_LENS))
    elif driver == "per_document":
        got = per_document(kernel.attend, q, k, v, cu, slopes=slopes, scale=SCALE)
    else:
        got = kernel.flex(q.float(), k.float(), v.float(), slopes, cu, SCALE).double()
    want = _alibi_reference(q, k, v, cu, slopes, **expects)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if driver == "flex" else {}
    torch.testing.assert_close(got, want, **tolerance)


def test_alibi_matches_bloom_attention_on_one_document():
    """Against Bloom's own alibi tensor (slope * key position) added to the scores."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    q, k, v, _ = _alibi_inputs()
    n = DOC_LENS[0]
    q, k, v = (t[:, :, :n].float() for t in (q, k, v))
    alibi = bloom.build_alibi_tensor(torch.ones(1, n), ALIBI_HEADS, torch.float32).view(1, ALIBI_HEADS, 1, n)
    n_rep = ALIBI_HEADS // ALIBI_KV_HEADS
    scores = q @ k.repeat_interleave(n_rep, 1).transpose(2, 3) * SCALE + alibi
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(scores, -1) @ v.repeat_interleave(n_rep, 1)
    got = AlibiAttention()(
        q, k, v, slopes=alibi_slopes(ALIBI_HEADS), scale=SCALE, cu_seqlens=torch.tensor([0, n]), max_seqlen=n
    )
    torch.testing.assert_close(got, want)
