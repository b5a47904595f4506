"""Assertions about a real server's answer to a bad prompt, shared by the bad-input tests."""

from __future__ import annotations

import numpy as np
import pytest
from comfy_server import PromptFailedError, PromptRejectedError
from prompts import edit_prompt, read_image


def execution_error(comfy, prompt) -> str:
    """Run a prompt that must fail while executing; return ComfyUI's exception message."""
    with pytest.raises(PromptFailedError) as failed:
        comfy.run(prompt)
    error = failed.value.event("execution_error")
    assert error is not None, failed.value.messages
    return error["exception_message"]


def failing_node(comfy, prompt) -> tuple[str, str]:
    """Run a prompt that must fail while executing; return (the failing node's class, the exception message)."""
    with pytest.raises(PromptFailedError) as failed:
        comfy.run(prompt)
    error = failed.value.event("execution_error")
    assert error is not None, failed.value.messages
    return error["node_type"], error["exception_message"]


def rejected(comfy, prompt) -> str:
    """Queue a prompt that must fail validation; return all error text."""
    with pytest.raises(PromptRejectedError) as refused:
        comfy.queue(prompt)
    return refused.value.messages()


def assert_server_still_works(comfy, picture, baseline=None):
    """The next ordinary edit completes (and gives exactly ``baseline`` when given); returns its image."""
    entry = comfy.run(edit_prompt(picture, seed=99, prefix="after_bad"))
    image = read_image(comfy.output_files(entry)[0])
    if baseline is not None:
        assert np.array_equal(image, baseline)
    return image
