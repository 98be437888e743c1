"""The native paged-decode kernel: against plain attention, inside a mixed step, and how it is built and chosen."""

from __future__ import annotations

import logging
import platform
import random

import pytest
import torch

from workers.config import CacheConfig, ConfigError, EngineConfig
from workers.engine import native_attention
from workers.engine.attention import SequenceSlice, build_attention_metadata, paged_attention
from workers.engine.model_runner import ModelRunner
from workers.engine.native_attention import DecodeBatch, kernel_supports, load_kernel


@pytest.fixture(scope="module")
def kernel() -> native_attention.NativeDecodeKernel:
    built = load_kernel()
    assert built is not None, "the kernel must build here: CI has a C compiler"
    return built


@pytest.fixture(scope="module", params=[8, 16])
def kernel_at_width(request, tmp_path_factory) -> native_attention.NativeDecodeKernel:
    """The kernel built with 8-float (AVX2) or 16-float (AVX-512) vectors, whichever this CPU has:
    each width must compute the same attention (wider vectors than the CPU's only run slower)."""
    flags = native_attention.build_flags() + (f"-DLANES={request.param}",)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp(f"lanes{request.param}")))
        patch.setattr(native_attention, "build_flags", lambda: flags)
        built = load_kernel.__wrapped__()
    assert built is not None and built.path.name.startswith("paged_decode-")
    return built


def reference_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """query (H, D), keys/values (L, KVH, D) -> (H, D), in float64."""
    group = query.shape[0] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)  # (L, H, D)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", query.double(), keys) / query.shape[1] ** 0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values).float()


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(8, 4, 32, 16), (4, 4, 16, 16), (8, 2, 64, 32), (6, 2, 48, 16), (4, 1, 128, 16)],
)
def test_kernel_matches_attention_over_each_sequence(
    kernel_at_width, num_heads, num_kv_heads, head_dim, block_size
):
    kernel = kernel_at_width
    rng = random.Random(head_dim)
    generator = torch.Generator().manual_seed(head_dim)
    # Lengths around run (16) and block boundaries, one long; a lone decode splits its KV heads across threads.
    lengths = [1, 15, 16, 17, 31, 32, 33, 47, 300, 5, block_size, block_size + 1]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    # Queries as the model makes them: a view of q beside k, so rows are strided; rows out of order.
    qk = torch.randn(len(lengths) + 3, num_heads + num_kv_heads, head_dim, generator=generator)
    query = qk[:, :num_heads]
    rows = rng.sample(range(query.shape[0]), len(lengths))
    out = torch.full((query.shape[0], num_heads, head_dim), float("nan"))

    for count in (len(lengths), 1):
        kernel(query, key_cache, value_cache, DecodeBatch.build(rows[:count], tables[:count], lengths[:count]), out)
        for row, table, length in zip(rows[:count], tables, lengths):
            keys = key_cache[table].flatten(0, 1)[:length]  # (L, KVH, D)
            values = value_cache[table].flatten(0, 1)[:length]
            torch.testing.assert_close(out[row], reference_decode(query[row], keys, values), rtol=0, atol=2e-6)
    untouched = sorted(set(range(query.shape[0])) - set(rows))
    assert torch.isnan(out[untouched]).all()


def test_mixed_step_through_the_kernel_puts_every_row_in_place(kernel):
    block_size, num_heads, num_kv_heads, head_dim, num_blocks = 16, 4, 2, 16, 64
    generator = torch.Generator().manual_seed(3)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    free = list(range(num_blocks))
    random.Random(3).shuffle(free)
    # Decodes around a prefill chunk that starts a prompt and one that continues one.
    shapes = [(40, 1), (0, 20), (3, 1), (17, 9), (70, 1), (15, 1)]
    sequences = [SequenceSlice(s, q, [free.pop() for _ in range(-(-(s + q) // block_size))]) for s, q in shapes]
    num_tokens = sum(q for _, q in shapes)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)
    caches = (key_cache.clone(), value_cache.clone())

    native = build_attention_metadata(sequences, block_size, torch.device("cpu"), decode_kernel=kernel)
    assert native.decode_batch is not None and native.decode_batch.rows.tolist() == [0, 21, 31, 32]
    output = paged_attention(query, key, value, key_cache, value_cache, native)
    sdpa = build_attention_metadata(sequences, block_size, torch.device("cpu"))
    expected = paged_attention(query, key, value, *caches, sdpa)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-5)
    assert torch.equal(key_cache, caches[0]) and torch.equal(value_cache, caches[1])  # the step's K/V stored alike


def test_a_step_without_decodes_needs_no_kernel_call(kernel):
    metadata = build_attention_metadata([SequenceSlice(0, 5, [2])], 16, torch.device("cpu"), decode_kernel=kernel)
    assert metadata.decode_batch is None and metadata.prefills


def test_without_a_compiler_the_engine_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("PATH", "/nonexistent")
    with caplog.at_level(logging.WARNING, logger=native_attention.__name__):
        assert native_attention.load_kernel.__wrapped__() is None
    assert "no C compiler" in caplog.text


def test_a_failed_build_names_the_compiler_error(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    broken = tmp_path / "paged_decode.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native_attention, "SOURCE", broken)
    with caplog.at_level(logging.WARNING, logger=native_attention.__name__):
        assert native_attention.load_kernel.__wrapped__() is None
    assert "exited 1" in caplog.text and "unavailable" in caplog.text
    assert list((tmp_path / "disagg" / "kernels").iterdir()) == []  # no partial file left behind


def test_a_built_kernel_is_reused_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = native_attention.shutil.which("cc") or native_attention.shutil.which("gcc")
    built = native_attention._build(compiler)
    assert built.parent == tmp_path / "disagg" / "kernels"
    # A second engine finds it: no compiler runs (this one would fail).
    assert native_attention._build("/nonexistent/cc") == built


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the capability limits are x86 compiler flags")
def test_the_kernel_is_built_for_the_instruction_set_torch_runs_with(monkeypatch, tmp_path):
    """ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU must give an AVX2 kernel (and its own cache entry)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = native_attention.shutil.which("cc") or native_attention.shutil.which("gcc")
    built = {}
    for capability in ("AVX512", "AVX2"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        built[capability] = native_attention._build(compiler)
        assert native_attention.build_flags()[: len(native_attention.FLAGS)] == native_attention.FLAGS
    assert "-mno-avx512f" in native_attention.build_flags()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert "-mno-avx512f" not in native_attention.build_flags()
    assert built["AVX512"] != built["AVX2"]


def test_kernel_shapes():
    assert kernel_supports(32, 16) and kernel_supports(128, 32)
    assert not kernel_supports(8, 16) and not kernel_supports(32, 4)


def test_decode_attention_is_validated_and_explains_a_refusal(tiny_model_dir):
    with pytest.raises(ConfigError, match="engine.decode_attention: must be auto, native or sdpa"):
        EngineConfig(model=str(tiny_model_dir), decode_attention="flash").validate()
    small_blocks = EngineConfig(model=str(tiny_model_dir), device="cpu", decode_attention="native",
                                cache=CacheConfig(block_size=4, num_blocks=16))
    with pytest.raises(ConfigError, match=r"engine.decode_attention: 'native' requested but .* multiples of 16"):
        ModelRunner(small_blocks)
    bf16 = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="bfloat16", decode_attention="native",
                        cache=CacheConfig(num_blocks=16))
    with pytest.raises(ConfigError, match="float32 on the CPU only"):
        ModelRunner(bf16)
    cache = CacheConfig(num_blocks=16)
    assert ModelRunner(EngineConfig(model=str(tiny_model_dir), device="cpu", cache=cache)).decode_kernel is not None
    sdpa = EngineConfig(model=str(tiny_model_dir), device="cpu", cache=cache, decode_attention="sdpa")
    assert ModelRunner(sdpa).decode_kernel is None
