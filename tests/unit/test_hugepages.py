"""kt_cli.ops.hugepages: the ranges it asks for, and that the kernel then backs the
weights with huge pages (read back from /proc/self/smaps), contents unchanged."""

import mmap
import os
import sys
from pathlib import Path

import pytest
import torch

from kt_cli.ops import hugepages

MB = 1 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _kernel_version() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


class FakeTensor:
    """a contiguous CPU tensor's address and size, without the memory"""

    device = torch.device("cpu")

    def __init__(self, ptr: int, n_bytes: int):
        self.ptr, self.n = ptr, n_bytes

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 1


def test_spans_widen_to_huge_pages_and_join_neighbours():
    tensors = [FakeTensor(10 * MB + 5, 100), FakeTensor(3 * MB, MB), FakeTensor(4 * MB + 1, 10),
               FakeTensor(20 * MB, 0)]
    assert hugepages.spans(tensors) == [(2 * MB, 6 * MB), (10 * MB, 12 * MB)]


def _huge_kb_in(start: int, end: int) -> int:
    """AnonHugePages of the mappings overlapping [start, end), from /proc/self/smaps"""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux") or _kernel_version() < (6, 1),
                    reason="MADV_COLLAPSE needs Linux 6.1 or later")
@pytest.mark.skipif(not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
                    reason="this kernel has transparent huge pages off ([never]) or none")
def test_collapse_backs_the_tensor_with_huge_pages(monkeypatch):
    monkeypatch.delenv("KT_HUGEPAGES", raising=False)
    # a fresh mapping, written once: 4 KB pages (under THP "madvise"), unlike heap memory an
    # earlier collapse in this process may have left in huge pages
    region = mmap.mmap(-1, 16 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.int8)
    t.copy_(torch.randint(-128, 128, (16 * MB,), dtype=torch.int8))
    expected = t.clone()
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    before = _huge_kb_in(start, end)
    if "[always]" in THP_SETTING.read_text() and before > 0:
        pytest.skip("THP is [always] here: the pages were huge from the first write")
    hugepages.collapse([t])
    assert _huge_kb_in(start, end) - before >= 12 * 1024    # at least 6 of the 2 MB pages inside
    assert torch.equal(t, expected)
    del t


def test_disabled_asks_for_nothing(monkeypatch):
    monkeypatch.setenv("KT_HUGEPAGES", "0")
    calls = []
    monkeypatch.setattr(hugepages, "spans", lambda tensors: calls.append(tensors) or [])
    hugepages.collapse([torch.zeros(4 * MB, dtype=torch.int8)])
    assert calls == []


def test_dense_layers_ask_for_their_weights_in_huge_pages(monkeypatch):
    from kt_cli.layers.linear import Linear, Target
    from kt_weights.layout import Format, quantize_reference
    asked = []
    monkeypatch.setattr(hugepages, "collapse", lambda tensors: asked.append(tensors))
    w = quantize_reference(torch.randn(64, 128), Format.I4, 32, symmetric=False)
    linear = Linear(w, None, Target(torch.device("cpu"), torch.float32))
    held = {t.data_ptr() for t in (linear.qweight.data, linear.qweight.scale, linear.qweight.min)}
    assert len(asked) == 1 and {t.data_ptr() for t in asked[0]} == held


def test_llm_collapses_every_streamed_weight_again_after_the_trim(monkeypatch, tmp_path):
    """glibc's trim at the end of loading splits the huge pages that freed temporaries shared
    with the weights; LLM asks for all of them once more after it (dense kernel layouts and
    routed experts alike)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "e2e"))
    from tiny_models import build_tiny

    from kt_cli import LLM, hardware
    from kt_cli.layers.linear import Linear
    from kt_cli.layers.moe import MoEBlock
    events = []
    monkeypatch.setattr(hardware, "release_freed_memory", lambda: events.append("trim"))
    monkeypatch.setattr(hugepages, "collapse", lambda tensors: events.append({t.data_ptr() for t in tensors}))
    llm = LLM(build_tiny("qwen3_moe", tmp_path / "m"), ctx=64, max_batch=1)
    model = llm.engine.runner.model
    dense = {t.data_ptr() for m in model.modules() if isinstance(m, Linear) and m.qweight is not None
             for t in m.qweight.tensors()}
    experts = {t.data_ptr() for m in model.modules() if isinstance(m, MoEBlock) for t in m.cpu.tensors()}
    assert dense and experts
    after_trim = events[events.index("trim") + 1:]
    assert after_trim and after_trim[-1] == dense | experts
