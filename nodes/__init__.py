"""ComfyUI glue (V3 schema): inputs, tooltips, validation messages, progress and interrupt."""
