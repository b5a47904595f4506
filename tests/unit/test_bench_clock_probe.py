"""bench/clock_probe.py's parsing of nvidia-smi samples and its per-phase summary (the GPU part runs on the device)."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import clock_probe


def test_samples_are_parsed_and_summarized_by_phase():
    text = "\n".join([
        "2026/11/21 15:30:51.000, 1980, 2619, 120.50, 40",
        "2026/11/21 15:30:51.500, 1755, 2619, 699.90, 55",
        "garbage line",
        "2026/11/21 15:30:52.000, 1620, 2619, 700.00, 57",
        "2026/11/21 15:30:52.500, [N/A], 2619, 650.00, 57",
    ])  # fmt: skip
    samples = clock_probe.parse_samples(text)
    assert len(samples) == 3  # the garbage line and the [N/A] clock are skipped
    start = dt.datetime(2026, 11, 21, 15, 30, 51, 250000).timestamp()
    end = dt.datetime(2026, 11, 21, 15, 30, 52, 250000).timestamp()
    phase = clock_probe.summarize(samples, start, end)
    assert phase["samples"] == 2
    assert phase["sm_mhz_median"] == (1755 + 1620) / 2 and phase["sm_mhz_min"] == 1620
    assert phase["power_w_max"] == 700.0 and phase["mem_mhz_median"] == 2619
    assert clock_probe.summarize(samples, end + 10, end + 20) == {"samples": 0}
