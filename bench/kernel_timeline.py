"""Where a forward's GPU time goes between kernels: the device timeline of one profiled call.

``timeline(prof)`` reads a finished ``torch.profiler.profile`` (CUDA activity) through its Chrome trace and
returns, over the span from the first device event to the last:

* ``span_ms``, ``busy_ms`` (kernels, memsets, copies), ``idle_ms`` (span minus busy; the gaps between
  consecutive device events on the GPU's timeline);
* ``events`` per kind (kernel / memset / memcpy) and ``tiny``: kernels shorter than 5 us, with their total time;
* ``idle_before``: idle time summed by the name of the event that follows each gap (what the GPU waited for),
  largest first;
* ``block``: the ordered events of one middle DiT block (the events between two consecutive launches of the
  attention kernel, matched by ``anchor``), each with its duration and the gap before it, in microseconds.

Used by ``bench/profile_forward.py --timeline``. Host-only arithmetic; no GPU needed to import.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict

TINY_US = 5.0
KINDS = {"kernel": "kernel", "gpu_memset": "memset", "gpu_memcpy": "memcpy"}


def device_events(trace: dict) -> list[dict]:
    """Device-side events (kernels, memsets, copies) of a Chrome trace, sorted by start: name, kind, ts, dur (us)."""
    out = []
    for e in trace.get("traceEvents", []):
        kind = KINDS.get(str(e.get("cat", "")).lower())
        if kind and "dur" in e:
            out.append({"name": e.get("name", "?"), "kind": kind, "ts": float(e["ts"]), "dur": float(e["dur"])})
    out.sort(key=lambda e: e["ts"])
    return out


def summarize(events: list[dict], anchor: str = "sdpa", top: int = 20) -> dict:
    """The statistics described in the module docstring, from :func:`device_events`' list."""
    if not events:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "events": {}, "idle_before": [], "block": []}
    span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
    busy, counts, idle_by = 0.0, defaultdict(int), defaultdict(float)
    tiny_n, tiny_us, end, gaps = 0, 0.0, events[0]["ts"], []
    for e in events:
        gap = max(e["ts"] - end, 0.0)
        gaps.append(gap)
        idle_by[e["name"][:90]] += gap
        busy += e["dur"]
        counts[e["kind"]] += 1
        if e["kind"] == "kernel" and e["dur"] < TINY_US:
            tiny_n, tiny_us = tiny_n + 1, tiny_us + e["dur"]
        end = max(end, e["ts"] + e["dur"])
    anchors = [i for i, e in enumerate(events) if anchor in e["name"].lower()]
    block = []
    if len(anchors) >= 3:
        mid = len(anchors) // 2
        for i in range(anchors[mid - 1] + 1, anchors[mid] + 1):
            e = events[i]
            block.append({"name": e["name"][:90], "kind": e["kind"], "dur_us": round(e["dur"], 2),
                          "gap_before_us": round(gaps[i], 2)})  # fmt: skip
    ranked = sorted(idle_by.items(), key=lambda kv: -kv[1])[:top]
    return {
        "span_ms": span / 1000,
        "busy_ms": busy / 1000,
        "idle_ms": (span - busy) / 1000,
        "events": dict(counts),
        "tiny": {"count": tiny_n, "ms": tiny_us / 1000},
        "idle_before": [[name, round(us / 1000, 3)] for name, us in ranked],
        "block": block,
    }


def timeline(prof, anchor: str = "sdpa") -> dict:
    """:func:`summarize` of a finished profiler's trace (written to a temporary file and read back)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return summarize(device_events(trace), anchor)


def print_summary(label: str, t: dict) -> None:
    print(f"\nTIMELINE of {label}: span {t['span_ms']:.2f} ms, busy {t['busy_ms']:.2f}, idle {t['idle_ms']:.2f}; "
          f"events {t['events']}; tiny kernels (<{TINY_US:.0f} us): {t['tiny']['count']} taking "
          f"{t['tiny']['ms']:.2f} ms")  # fmt: skip
    print("idle before (ms):")
    for name, ms in t["idle_before"][:12]:
        print(f"  {ms:7.3f}  {name}")
    print("one block (gap us, dur us, name):")
    for e in t["block"]:
        print(f"  {e['gap_before_us']:7.2f} {e['dur_us']:8.2f}  {e['kind']:6s} {e['name'][:80]}")
