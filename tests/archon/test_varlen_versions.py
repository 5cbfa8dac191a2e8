"""The flash varlen call site of ``archon_models.attention``, driven on CPU with stand-ins
carrying each torch version's ``varlen_attn`` signature and semantics (tests/varlen_standins.py).

The call site runs only on CUDA, so the suite never reached it, and a keyword one torch
version lacks (``enable_gqa`` on 2.11) crashed every package on a GPU. Here the device and
dtype gates are opened for the CPU and the installed kernel is replaced by a stand-in:
each supported version's call must reach the kernel (not a fallback) and match SDPA,
gradients included; a signature the code cannot drive falls back to SDPA and says so.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

from archon_models.attention import VarlenAttentionWrapper, varlen, varlen_attn
from tests import varlen_standins

DOC_LENS = [5, 1, 9, 3]
N_HEADS, HEAD_DIM = 4, 8


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.fixture
def kernel(monkeypatch):
    """Install a stand-in as ``torch.nn.attention.varlen.varlen_attn`` and open the flash
    gates for CPU fp32/fp64; returns a function that installs the given version."""
    import torch.nn.attention.varlen as torch_varlen

    monkeypatch.setattr(varlen, "_FLASH_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(varlen, "_FLASH_DTYPES", (torch.float32, torch.float64))
    varlen_standins.CALLS.clear()

    def install(standin):
        monkeypatch.setattr(torch_varlen, "varlen_attn", standin)
        varlen.flash_varlen_features.cache_clear()

    yield install
    varlen.flash_varlen_features.cache_clear()


def _reference(q, k, v, lengths, scale):
    """SDPA on each document alone, ``[1, H, T, D]``, in float64."""
    out, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True, scale=scale, enable_gqa=True
            )
        )
        start += n
    return torch.cat(out, dim=2)


def _qkv(n_kv_heads: int, total: int):
    g = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(1, heads, total, HEAD_DIM, generator=g, requires_grad=True)
        for heads in (N_HEADS, n_kv_heads, n_kv_heads)
    )


def test_stand_in_for_the_installed_torch_has_its_exact_signature():
    """The stand-in of the installed version is checked against the real function, so the
    stand-ins cannot drift from what torch ships."""
    from torch.nn.attention.varlen import varlen_attn as installed

    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if version not in varlen_standins.VERSIONS:
        pytest.fail(f"torch {torch.__version__} has no stand-in in tests/varlen_standins.py: add its signature")

    def shape(fn):  # names, kinds and defaults; annotations are strings in the stand-ins
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(varlen_standins.VERSIONS[version]) == shape(installed)


@pytest.mark.parametrize("scale", [None, 0.3], ids=["default-scale", "explicit-scale"])
@pytest.mark.parametrize("n_kv_heads", [N_HEADS, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("version", list(varlen_standins.VERSIONS))
def test_every_supported_torch_reaches_its_kernel_and_matches_sdpa(kernel, version, n_kv_heads, scale):
    kernel(varlen_standins.VERSIONS[version])
    total = sum(DOC_LENS)
    q, k, v = _qkv(n_kv_heads, total)
    out = VarlenAttentionWrapper()(q, k, v, scale=scale, cu_seqlens=_cu(DOC_LENS), max_seqlen=max(DOC_LENS))
    calls = [c for c in varlen_standins.CALLS if c["version"] == version]
    assert calls, f"the flash call site never reached torch {version}'s kernel"

    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _reference(q64, k64, v64, DOC_LENS, scale)
    want_grads = torch.autograd.grad(want, (q64, k64, v64), grad_out.double())
    torch.testing.assert_close(out, want.float())
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected.float())


def test_each_version_is_asked_in_its_own_keywords(kernel):
    """2.10 gets is_causal and a pre-scaled query; 2.11 a causal window and the scale;
    2.13 also enable_gqa instead of repeated key/value heads."""
    q, k, v = (t.detach() for t in _qkv(2, sum(DOC_LENS)))
    for version in varlen_standins.VERSIONS:
        kernel(varlen_standins.VERSIONS[version])
        VarlenAttentionWrapper()(q, k, v, scale=0.3, cu_seqlens=_cu(DOC_LENS), max_seqlen=max(DOC_LENS))
    by_version = {c["version"]: c for c in varlen_standins.CALLS}
    assert by_version["2.10"] == {"version": "2.10", "is_causal": True}
    assert by_version["2.11"] == {"version": "2.11", "scale": 0.3, "window_size": (-1, 0)}
    assert by_version["2.13"] == {"version": "2.13", "scale": 0.3, "window_size": (-1, 0), "enable_gqa": True}


def test_trailing_tokens_past_the_last_document_attend_as_one_more(kernel):
    """Flash computes no token past ``cu_seqlens[-1]``: the wrapper closes the row with one
    more document, as the per-document path does."""
    kernel(varlen_standins.varlen_attn_2_13)
    q, k, v = (t.detach() for t in _qkv(2, sum(DOC_LENS) + 3))
    out = VarlenAttentionWrapper()(q, k, v, cu_seqlens=_cu(DOC_LENS), max_seqlen=max(DOC_LENS))
    torch.testing.assert_close(out, _reference(q, k, v, [*DOC_LENS, 3], None))


def test_token_major_api_is_not_causal_unless_asked(kernel):
    kernel(varlen_standins.varlen_attn_2_11)
    g = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(sum(DOC_LENS), N_HEADS, HEAD_DIM, generator=g) for _ in range(3))
    cu = _cu(DOC_LENS)
    out = varlen_attn(query, key, value, cu, cu, max(DOC_LENS), max(DOC_LENS), is_causal=False)
    assert varlen_standins.CALLS[-1]["window_size"] == (-1, -1)
    start = 0
    for n in DOC_LENS:
        sl = slice(start, start + n)
        want = torch.nn.functional.scaled_dot_product_attention(
            query[sl].transpose(0, 1), key[sl].transpose(0, 1), value[sl].transpose(0, 1)
        ).transpose(0, 1)
        torch.testing.assert_close(out[sl], want)
        start += n


def test_a_signature_it_cannot_drive_falls_back_to_sdpa_and_says_so(kernel, caplog):
    kernel(varlen_standins.varlen_attn_unknown)
    q, k, v = (t.detach() for t in _qkv(2, sum(DOC_LENS)))
    with caplog.at_level(logging.WARNING, logger=varlen.__name__):
        out = VarlenAttentionWrapper()(q, k, v, cu_seqlens=_cu(DOC_LENS), max_seqlen=max(DOC_LENS))
    assert not varlen_standins.CALLS, "a kernel whose signature has no causal keyword was called"
    assert "takes neither window_size nor is_causal" in caplog.text
    torch.testing.assert_close(out, _reference(q, k, v, DOC_LENS, None))


def test_a_torch_without_the_kernel_runs_per_document(monkeypatch):
    monkeypatch.setattr(varlen, "_installed_kernel", lambda: None)
    varlen.flash_varlen_features.cache_clear()
    try:
        assert varlen.flash_varlen_features() is None
        q = torch.zeros(1, N_HEADS, 4, HEAD_DIM, dtype=torch.bfloat16)
        assert not varlen._use_flash(q)
    finally:
        varlen.flash_varlen_features.cache_clear()
