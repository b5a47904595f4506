"""ComfyUI model calls as KSampler makes them, for the GPU tests that call a MODEL without a sampler."""

from __future__ import annotations


def sampler_model_options(patcher) -> dict:
    """A copy of ComfyUI MODEL ``patcher``'s model options as KSampler hands them to the model: its own options with
    its wrappers and callbacks merged into ``transformer_options`` (``comfy.sampler_helpers.prepare_model_patcher``
    does this; without them no compile or block-replacement wrapper runs)."""
    import comfy.model_patcher
    import comfy.patcher_extension

    model_options = comfy.model_patcher.create_model_options_clone(patcher.model_options)
    options = model_options.setdefault("transformer_options", {})
    comfy.patcher_extension.merge_nested_dicts(options.setdefault("wrappers", {}), patcher.wrappers, copy_dict1=False)
    comfy.patcher_extension.merge_nested_dicts(options.setdefault("callbacks", {}), patcher.callbacks,
                                               copy_dict1=False)
    return model_options
