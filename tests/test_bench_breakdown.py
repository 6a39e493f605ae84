"""The forward's "item times" words (ops.moe_forward, timing mode 32): mok_jax.bench.breakdown's reading of them, on
words made here (the u64 fields split into (low, high) uint32 words, the first start kept as its complement), and
their place in the scratch."""
import numpy as np
import pytest

from mok_jax import _native, memory
from mok_jax.bench.breakdown import item_times
from mok_jax.config import KernelConfig
from mok_jax.ops.moe_forward import ITEM_TIME_FIELDS, ITEM_TIME_KINDS, item_times_offset, scratch_bytes

T0 = 5_000_000_000  # globaltimer ns past 2^32: the high words matter


def _words(fields: dict) -> np.ndarray:
    f = np.zeros((len(ITEM_TIME_KINDS), len(ITEM_TIME_FIELDS)), np.uint64)
    for kind, (busy, waited, items, first, last) in fields.items():
        f[ITEM_TIME_KINDS.index(kind)] = [busy, waited, items, ~np.uint64(first), last]
    return np.stack([f & np.uint64(0xFFFFFFFF), f >> np.uint64(32)], -1).astype(np.uint32)


def test_item_times_per_cta_and_from_the_first_start():
    w = _words({"consumers": (2_000_000, 0, 2, T0, T0 + 1_000_000),
                "dispatch": (300_000, 100_000, 3, T0 + 500, T0 + 400_000),
                "down": (1_000_000, 50_000, 8, T0 + 200_000, T0 + 900_000)})
    t = item_times([w])
    assert list(t) == ["dispatch", "down", "consumers"]  # kinds without items are left out, the plan's order kept
    assert t["dispatch"] == {"items": 3, "busy ms per CTA": 0.15, "waited ms per CTA": 0.05, "first start us": 0.5,
                             "last end us": 400.0}
    assert t["down"]["busy ms per CTA"] == 0.5 and t["down"]["first start us"] == 200.0
    assert t["consumers"]["last end us"] == 1000.0 and t["consumers"]["items"] == 2


def test_item_times_takes_the_median_of_the_calls():
    calls = [_words({"consumers": (2_000_000 * m, 0, 2, T0, T0 + 1_000_000 * m),
                     "reduce": (100_000 * m, 0, 4, T0 + 10_000, T0 + 20_000 * m)}) for m in (1, 3, 2)]
    t = item_times(calls)
    assert t["reduce"]["busy ms per CTA"] == 0.1 and t["reduce"]["last end us"] == 40.0
    assert t["consumers"]["busy ms per CTA"] == 2.0


def test_item_times_refuses_words_without_a_run():
    with pytest.raises(ValueError, match="item times"):
        item_times([_words({})])


@pytest.mark.skipif(_native.library() is None, reason="the scratch layout comes from libmok_ffi.so")
@pytest.mark.parametrize("ep, tokens, granularity", [(1, 2048, 2048), (1, 600, 512), (2, 300, 512), (16, 256, 512)])
def test_item_times_lie_in_the_sync_region_of_the_scratch(ep, tokens, granularity):
    """The place the library gives for the item times (mok_moe_item_times_offset) is inside the forward scratch's
    sync region as mok_jax.memory counts it: after every region before it, and with all its words before the
    region's end (at EP 16 the rank's parameters follow the region)."""
    kernel = KernelConfig(granularity=granularity, comm_items_fwd=8)
    shape = dict(tokens=tokens, hidden=512, inter=256, shared_inter=256, top_k=4, local_experts=4, ep=ep)
    total = scratch_bytes(kernel=kernel, **shape)
    terms = memory._forward(ep, tokens, 512, 256, 256, 4, 4, kernel)
    assert sum(terms.values()) == total
    sync_end = total - terms["rank_params"]
    at = item_times_offset(kernel=kernel, **shape)
    assert sync_end - terms["sync"] <= at and at + len(ITEM_TIME_KINDS) * len(ITEM_TIME_FIELDS) * 8 <= sync_end
    assert at % 8 == 0  # u64 words


def test_kernel_periods_from_launch_to_launch():
    """The trace's forward kernels, out of order and among other events: their durations and the ms from one launch
    to the next, in time order (what a call spends beside the kernel is the period less the duration)."""
    from mok_jax.bench.breakdown import _kernel_periods, _kernel_times

    events = [{"ph": "X", "name": "void mok::moe::forward_kernel<false, false>", "ts": ts, "dur": 2400.0}
              for ts in (5600.0, 0.0, 2800.0)]
    events += [{"ph": "X", "name": "Memset", "ts": 2500.0, "dur": 5.0}, {"ph": "i", "name": "forward_kernel", "ts": 1.0}]
    assert _kernel_times(events, "forward_kernel") == [2.4, 2.4, 2.4]
    assert _kernel_periods(events, "forward_kernel") == [2.8, 2.8]
    assert _kernel_periods(events[:1], "forward_kernel") == []


def test_kernel_events_are_the_devices():
    """A jax.profiler trace also names the host's launches after the kernel (a few us each, at the host's pace, ahead
    of the device): with the trace's process names, only the "/device:..." processes' events count."""
    from mok_jax.bench.breakdown import _kernel_periods, _kernel_times

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}}]
    kernel = "void mok::moe::forward_kernel<false, false>"
    device = [{"ph": "X", "pid": 1, "name": kernel, "ts": 100.0 + 2406.0 * i, "dur": 2400.0} for i in range(3)]
    host = [{"ph": "X", "pid": 7, "name": kernel, "ts": 500.0 * i, "dur": 10.0} for i in range(3)]
    events = meta + host + device
    assert _kernel_times(events, "forward_kernel") == [2.4, 2.4, 2.4]
    assert [round(p, 3) for p in _kernel_periods(events, "forward_kernel")] == [2.406, 2.406]
    assert len(_kernel_times(host + device, "forward_kernel")) == 6  # no process names: every event


def test_table_prints_the_item_times_of_both_orders():
    """--items on a model with a shared expert times both orders of the shared expert's down tiles (timing mode 32,
    and 32 + 64 "shared down early"): the table prints each one's rows under its own header."""
    from mok_jax.bench.breakdown import table

    row = {"ms": 2.5, "sm_mhz": 1980.0, "sm_mhz_min": 1980.0, "watts": 300.0}
    late = {"shared down": {"items": 448, "busy ms per CTA": 0.088, "waited ms per CTA": 0.001,
                            "first start us": 1465.9, "last end us": 1600.3}}
    early = {"shared down": {**late["shared down"], "waited ms per CTA": 0.066}}
    case = {"model": "kimi-k2", "experts": 12, "tokens": 2048, "flops": 1.6e12, "kernel": "KernelConfig()",
            "rows": {"mok": row, "mok, item times": row, "mok, item times, shared down early": {**row, "ms": 2.55}},
            "item times": late, "item times, shared down early": early}
    lines = table({"cases": [case]}, header=False).splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("| item kind")]
    assert [lines[i].split(")")[0] for i in heads] == ["| item kind (item times",
                                                       "| item kind (item times, shared down early"]
    assert lines[heads[0] + 2].startswith("| shared down | 448 | 0.088 | 0.001 |")
    assert lines[heads[1] + 2].startswith("| shared down | 448 | 0.088 | 0.066 |")
    assert any(line.startswith("| mok, item times, shared down early | 2.550 | +0.050 |") for line in lines)
