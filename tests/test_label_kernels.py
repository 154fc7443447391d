"""The label cache's C++ ops (kernels/cpu_labels.cpp) against their torch twins: kvc::label_scores against
approx_scores_torch (fp32 and 4-bit packed labels, both group reductions, head/slot slices as strided views)
and kvc::label_write against LabelCache.write_torch (bit for bit, 4-bit quantization included)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import needs_cpp  # noqa: E402

from cache.labels import LabelCache  # noqa: E402
from kernels import approx_scores, approx_scores_torch, quantize_labels_4bit  # noqa: E402
from kernels.cpu import label_scores_cpu, label_write_cpu  # noqa: E402

pytestmark = needs_cpp


def labels_of(B, H, cap, C, bits, gen):
    """A label cache layer [B, H, cap, C] filled with random keys' channels (4-bit: packed, scale, minimum)."""
    x = torch.randn(B, H, cap, C, generator=gen) * 3
    if bits == 16:
        return x, None, None
    return quantize_labels_4bit(x)


@pytest.mark.parametrize("bits", [4, 16])
@pytest.mark.parametrize("C", [8, 6, 16])          # 8: the one-word fast path (C/2 = 4 bytes); 6, 16: the loop
@pytest.mark.parametrize("Hq,H", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("group", ["kv", "query"])
def test_label_scores_equal_twin(bits, C, Hq, H, group):
    gen = torch.Generator().manual_seed(C * 100 + Hq)
    B, cap, S = 2, 67, 61
    lab, sc, mn = labels_of(B, H, cap, C, bits, gen)
    q = torch.randn(B, Hq, C, generator=gen)
    view = lambda t: None if t is None else t[:, :, :S]       # noqa: E731  (a slot slice: strided)
    want = approx_scores_torch(q, view(lab), view(sc), view(mn), group=group)
    got = label_scores_cpu(q, view(lab), view(sc), view(mn), group == "kv")
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 16])
def test_label_scores_of_a_head_slice(bits):
    """The first h KV heads as a view of the cache (HShare's selecting heads) score as a copy of them does."""
    gen = torch.Generator().manual_seed(3)
    B, H, G, cap, C, h = 3, 4, 2, 40, 8, 2
    lab, sc, mn = labels_of(B, H, cap, C, bits, gen)
    q = torch.randn(B, h * G, C, generator=gen)
    cut = lambda t: None if t is None else t[:, :h, :33]       # noqa: E731
    own = lambda t: None if t is None else cut(t).contiguous()  # noqa: E731
    got = label_scores_cpu(q, cut(lab), cut(sc), cut(mn), True)
    want = approx_scores_torch(q, own(lab), own(sc), own(mn), group="kv")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_approx_scores_takes_the_kernel_and_masks_after():
    gen = torch.Generator().manual_seed(5)
    lab, sc, mn = labels_of(2, 3, 50, 8, 4, gen)
    q = torch.randn(2, 9, 8, generator=gen)
    length = torch.tensor([50, 31])
    kw = dict(group="kv", length=length, n_sink=4, n_recent=3)
    want = approx_scores(q, lab, sc, mn, backend="torch", **kw)
    got = approx_scores(q, lab, sc, mn, backend="cpp", **kw)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def label_cache(B, H, cap, C, bits):
    cache = LabelCache(bits)
    cache.build(1)
    gen = torch.Generator().manual_seed(11)
    keys = torch.randn(B, H, cap, 64, generator=gen)
    channels = torch.stack([torch.randperm(64, generator=gen)[:C] for _ in range(H)])
    cache.fill(0, keys, channels, cap)
    return cache, channels


def cache_state(cache):
    return [t[0].clone() for t in (cache.labels, cache.scale, cache.minimum) if t[0] is not None]


@pytest.mark.parametrize("bits", [4, 16])
@pytest.mark.parametrize("per_row", [False, True])
def test_label_write_equals_twin_bit_for_bit(bits, per_row):
    B, H, cap, C = 3, 4, 20, 8
    kernel, channels = label_cache(B, H, cap, C, bits)
    twin, _ = label_cache(B, H, cap, C, bits)
    gen = torch.Generator().manual_seed(bits + per_row)
    for step in range(12):
        k = torch.randn(B, H, 1, 64, generator=gen) * (10 ** (step % 4 - 2))   # small to large magnitudes
        if step == 3:
            k[0, 1] = 0.75                                                   # a constant label: scale 0
        if step == 4:
            k[1] = torch.randint(-8, 8, (H, 1, 64), generator=gen) / 4.0     # exact fp16 values: the round-down edge
        slot = torch.randint(0, cap, (B, H), generator=gen) if per_row else step + 5
        label_write_cpu(k, channels, kernel.labels[0], kernel.scale[0], kernel.minimum[0], slot)
        twin.write_torch(0, k, channels, slot)
        for got, want in zip(cache_state(kernel), cache_state(twin)):
            assert torch.equal(got, want), f"step {step}"


def test_label_write_quantizes_as_quantize_labels_4bit_for_every_channel_count():
    """Odd magnitudes and many tokens: the minimum rounded down, the scale up, codes half to even."""
    gen = torch.Generator().manual_seed(7)
    for C in (2, 6, 8, 16):
        B, H, cap = 64, 2, 3
        cache, channels = label_cache(B, H, cap, C, 4)
        k = torch.randn(B, H, 1, 64, generator=gen) * torch.logspace(-3, 3, B)[:, None, None, None]
        label_write_cpu(k, channels, cache.labels[0], cache.scale[0], cache.minimum[0], 1)
        lab = k.gather(-1, channels.view(1, H, 1, C).expand(B, H, 1, C))
        packed, sc, mn = quantize_labels_4bit(lab)
        assert torch.equal(cache.labels[0][:, :, 1:2], packed)
        assert torch.equal(cache.scale[0][:, :, 1:2], sc)
        assert torch.equal(cache.minimum[0][:, :, 1:2], mn)


def test_label_write_refuses_bad_slots_and_channels():
    cache, channels = label_cache(1, 2, 4, 8, 4)
    k = torch.randn(1, 2, 1, 64)
    with pytest.raises(RuntimeError, match="slot out of range"):
        label_write_cpu(k, channels, cache.labels[0], cache.scale[0], cache.minimum[0], 4)
    with pytest.raises(RuntimeError, match="channel out of range"):
        label_write_cpu(k, channels + 64, cache.labels[0], cache.scale[0], cache.minimum[0], 0)
    with pytest.raises(RuntimeError, match="scale/minimum"):        # fewer slots of scales than of labels
        label_write_cpu(k, channels, cache.labels[0], cache.scale[0][:, :, :2], cache.minimum[0][:, :, :2], 3)


def test_the_kernels_are_traced_by_torch_compile():
    """Fake shapes registered: a compiled function calling both ops runs and equals eager."""
    cache, channels = label_cache(2, 3, 16, 8, 4)
    q = torch.randn(2, 9, 8)
    k = torch.randn(2, 3, 1, 64)

    def step(q, k, slot):
        label_write_cpu(k, channels, cache.labels[0], cache.scale[0], cache.minimum[0], slot)
        return label_scores_cpu(q, cache.labels[0][:, :, :slot + 1], cache.scale[0][:, :, :slot + 1],
                                cache.minimum[0][:, :, :slot + 1], True)

    want = step(q, k, 9)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, k, 9)
    torch.testing.assert_close(got, want)
