"""Thirty prompts back to back: all complete, nothing lost, resident memory stays flat."""

from __future__ import annotations

from prompts import edit_prompt, write_image


def test_thirty_prompts_complete_and_memory_stays_within_ten_percent(fresh_comfy):
    picture = write_image(fresh_comfy.input_dir / "many.png", 64, 64, seed=2)
    first_id = fresh_comfy.queue(edit_prompt(picture, seed=1000, prefix="many"))
    fresh_comfy.wait(first_id)
    after_first = fresh_comfy.rss_bytes()
    ids = [fresh_comfy.queue(edit_prompt(picture, seed=1001 + i, prefix="many")) for i in range(29)]
    entries = [fresh_comfy.wait(prompt_id, timeout=900) for prompt_id in ids]
    after_last = fresh_comfy.rss_bytes()
    written = sorted(p.name for entry in entries for p in fresh_comfy.output_files(entry))
    assert len(written) == 29 and len(set(written)) == 29, "an image was lost or overwritten"
    assert all(path.exists() for entry in entries for path in fresh_comfy.output_files(entry))
    growth = (after_last - after_first) / after_first
    assert growth < 0.10, f"resident memory grew {growth:.1%} ({after_first >> 20} -> {after_last >> 20} MiB)"
