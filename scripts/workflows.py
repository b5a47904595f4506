"""The single source of the shipped workflows, and the generator of both formats.

Each preset is a small graph described once, here. ``python scripts/workflows.py``
writes, for every preset:

- ``example_workflows/<name>.json``: the UI format ComfyUI's frontend loads
  (its template browser lists this folder), with ``properties.models`` saying
  where each weight file comes from;
- ``example_workflows/api/<name>.json``: the API-format twin for scripts;
- ``example_workflows/<name>.jpg``: a thumbnail drawn from the graph.

``python scripts/workflows.py --check`` fails if any written file differs from
what the source generates (the test suite runs it).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "example_workflows"
API_DIR = OUT_DIR / "api"

DIT = "qwen_image_edit_2509_bf16.safetensors"
TEXT_ENCODER = "qwen_2.5_vl_7b.safetensors"
TEXT_ENCODER_FP8 = "qwen_2.5_vl_7b_fp8_scaled.safetensors"
VAE = "qwen_image_vae.safetensors"
LIGHTNING_4 = "Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16.safetensors"
LIGHTNING_8 = "Qwen-Image-Edit-2509-Lightning-8steps-V1.0-bf16.safetensors"
INPUT_IMAGE = "qwen_edit_example.png"
PROMPT = "Replace the sky with a warm sunset and keep everything else unchanged."

HF = "https://huggingface.co"
MODEL_SOURCES = {
    DIT: ("diffusion_models", f"{HF}/Comfy-Org/Qwen-Image-Edit_ComfyUI/resolve/main/split_files/diffusion_models/"
          f"{DIT}"),
    TEXT_ENCODER: ("text_encoders", f"{HF}/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/text_encoders/"
                   f"{TEXT_ENCODER}"),
    TEXT_ENCODER_FP8: ("text_encoders", f"{HF}/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/text_encoders/"
                       f"{TEXT_ENCODER_FP8}"),
    VAE: ("vae", f"{HF}/Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/vae/{VAE}"),
    LIGHTNING_4: ("loras", f"{HF}/lightx2v/Qwen-Image-Lightning/resolve/main/Qwen-Image-Edit-2509/{LIGHTNING_4}"),
    LIGHTNING_8: ("loras", f"{HF}/lightx2v/Qwen-Image-Lightning/resolve/main/Qwen-Image-Edit-2509/{LIGHTNING_8}"),
}

# Output slots per node type (name, type), in order; inputs that are links (name, type).
OUTPUTS = {
    "LoadImage": [("IMAGE", "IMAGE"), ("MASK", "MASK")],
    "QwenEditHopper_Load": [("pipe", "QWEN_EDIT"), ("info", "STRING")],
    "QwenEditHopper_FuseLoRA": [("pipe", "QWEN_EDIT"), ("report", "STRING")],
    "QwenEditHopper_ApplyFP8": [("pipe", "QWEN_EDIT"), ("report", "STRING"), ("model", "MODEL")],
    "QwenEditHopper_Compile": [("pipe", "QWEN_EDIT"), ("info", "STRING"), ("model", "MODEL")],
    "QwenEditHopper_Parallel": [("pipe", "QWEN_EDIT"), ("info", "STRING")],
    "QwenEditHopper_Sampler": [("image", "IMAGE"), ("info", "STRING")],
    "QwenEditHopper_Benchmark": [("chart", "IMAGE"), ("table", "STRING")],
    "SaveImage": [],
    "PreviewImage": [],
    "PreviewAny": [],
    "UNETLoader": [("MODEL", "MODEL")],
    "CLIPLoader": [("CLIP", "CLIP")],
    "VAELoader": [("VAE", "VAE")],
    "ModelSamplingAuraFlow": [("MODEL", "MODEL")],
    "TextEncodeQwenImageEditPlus": [("CONDITIONING", "CONDITIONING")],
    "VAEEncode": [("LATENT", "LATENT")],
    "KSampler": [("LATENT", "LATENT")],
    "VAEDecode": [("IMAGE", "IMAGE")],
}
LINK_INPUTS = {
    "QwenEditHopper_FuseLoRA": [("pipe", "QWEN_EDIT")],
    "QwenEditHopper_ApplyFP8": [("pipe", "QWEN_EDIT"), ("model", "MODEL")],
    "QwenEditHopper_Compile": [("pipe", "QWEN_EDIT"), ("model", "MODEL")],
    "QwenEditHopper_Parallel": [("pipe", "QWEN_EDIT")],
    "QwenEditHopper_Sampler": [("pipe", "QWEN_EDIT"), ("image", "IMAGE"), ("image_2", "IMAGE"),
                               ("image_3", "IMAGE")],
    "QwenEditHopper_Benchmark": [("pipe_1", "QWEN_EDIT"), ("image", "IMAGE"), ("pipe_2", "QWEN_EDIT"),
                                 ("pipe_3", "QWEN_EDIT"), ("pipe_4", "QWEN_EDIT")],
    "SaveImage": [("images", "IMAGE")],
    "PreviewImage": [("images", "IMAGE")],
    "PreviewAny": [("source", "*")],
    "ModelSamplingAuraFlow": [("model", "MODEL")],
    "TextEncodeQwenImageEditPlus": [("clip", "CLIP"), ("vae", "VAE"), ("image1", "IMAGE"), ("image2", "IMAGE"),
                                    ("image3", "IMAGE")],
    "VAEEncode": [("pixels", "IMAGE"), ("vae", "VAE")],
    "KSampler": [("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                 ("latent_image", "LATENT")],
    "VAEDecode": [("samples", "LATENT"), ("vae", "VAE")],
}
CONTROL_AFTER_GENERATE = ("seed", "noise_seed")
"""Number widgets the frontend follows with a 'control after generate' value in widgets_values (its rule is by
input name, whatever the node declares)."""


@dataclass
class Node:
    id: int
    type: str
    widgets: dict[str, Any] = field(default_factory=dict)
    links: dict[str, tuple[int, int]] = field(default_factory=dict)
    pos: tuple[int, int] = (0, 0)
    title: str | None = None


@dataclass
class Workflow:
    name: str
    title: str
    description: str
    nodes: list[Node]

    def node(self, node_id: int) -> Node:
        return next(n for n in self.nodes if n.id == node_id)


def _loader(node_id: int, pos, text_encoder: str = TEXT_ENCODER, attention: str = "auto", host_blocks: int = 0
            ) -> Node:
    return Node(node_id, "QwenEditHopper_Load", {
        "diffusion_model": DIT, "text_encoder": text_encoder, "vae": VAE,
        "diffusers_folder": "(none: use the three files)", "variant": "auto", "attention": attention,
        "where_unsupported": "refuse", "host_blocks": host_blocks,
    }, pos=pos)


def _sampler(node_id: int, pos, pipe: tuple[int, int], steps: int = 40, cfg: float = 0.0) -> Node:
    return Node(node_id, "QwenEditHopper_Sampler", {
        "prompt": PROMPT, "negative_prompt": " ", "seed": 42, "steps": steps, "cfg": cfg, "width": 0,
        "height": 0, "scheduler": "auto", "reference_megapixels": 1.0,
    }, links={"pipe": pipe, "image": (1, 0)}, pos=pos)


LOW_VRAM_HOST_BLOCKS = 24
"""DiT blocks the low VRAM workflow keeps in host memory: 7.6 GiB of fp8 weights off the GPU (measured on an H100
through the server: prompts peak at 17.7-18.2 GiB on the card, the first one included, 1.04-1.05 s per step against
0.98 with 10 blocks)."""

FASTEST_LAYERS = "attn+mlp+mod compute"
"""Measured on an H200: faster than the default preset and more accurate
(docs/decisions/0001-fp8-rowwise-linears.md)."""


def _fp8(node_id: int, pos, pipe: tuple[int, int], backend: str, layers: str = "attn+mlp", source: str = "pipe",
         attention: str = "comfyui", model_block: str = "comfyui") -> Node:
    """Apply TE-FP8 on a pipe, or with ``source="model"`` on a ComfyUI MODEL (its ``attention`` and ``model_block``
    then apply)."""
    return Node(node_id, "QwenEditHopper_ApplyFP8", {
        "backend": backend, "te_recipe": "current", "fp8_format": "E4M3", "amax_history_len": 16,
        "amax_compute_algo": "max", "layers": layers, "modulation": "fp8 storage", "fast_accum": True,
        "gemm_kernel": "cublaslt", "where_unsupported": "refuse", "attention": attention, "model_block": model_block,
    }, links={source: pipe}, pos=pos)


def _compile(node_id: int, pos, pipe: tuple[int, int], cuda_graphs: bool = False, source: str = "pipe") -> Node:
    """Compile Model on a pipe, or with ``source="model"`` on a ComfyUI MODEL."""
    widgets = {"mode": "default", "dynamic": True, "warmup": False, "warmup_size": 1024, "cuda_graphs": cuda_graphs}
    return Node(node_id, "QwenEditHopper_Compile", widgets, links={source: pipe}, pos=pos)


def _lora(node_id: int, pos, pipe: tuple[int, int], name: str) -> Node:
    return Node(node_id, "QwenEditHopper_FuseLoRA", {"lora_name": name, "strength": 1.0},
                links={"pipe": pipe}, pos=pos)


def _image(node_id: int = 1, pos=(0, 420)) -> Node:
    return Node(node_id, "LoadImage", {"image": INPUT_IMAGE}, pos=pos)


def _save(node_id: int, pos, source: tuple[int, int], prefix: str) -> Node:
    return Node(node_id, "SaveImage", {"filename_prefix": prefix}, links={"images": source}, pos=pos)


def preset_bf16_baseline() -> Workflow:
    return Workflow("qwen_edit_bf16_baseline", "bf16 baseline",
                    "Reference quality and speed: bf16 weights, eager PyTorch, SDPA attention, 40 steps, true CFG.",
                    [_image(), _loader(2, (0, 0)), _sampler(3, (420, 0), (2, 0)),
                     _save(4, (840, 0), (3, 0), "qwen_edit_bf16")])


def preset_te_fp8() -> Workflow:
    return Workflow("qwen_edit_te_fp8", "TE-FP8",
                    "FP8 compute through NVIDIA Transformer Engine (current scaling) on Hopper.",
                    [_image(), _loader(2, (0, 0)), _fp8(3, (420, 0), (2, 0), "te"),
                     _sampler(4, (840, 0), (3, 0)), _save(5, (1260, 0), (4, 0), "qwen_edit_te_fp8")])


def preset_fastest() -> Workflow:
    return Workflow("qwen_edit_fastest", "fastest",
                    "The fastest correct combination measured on one Hopper GPU: row-wise FP8 scaled-mm for attention, "
                    "MLP and modulation linears with fast accumulation through the pack's workspace-free cuBLASLt "
                    "call, cuDNN FP8 attention (needs "
                    "nvidia-cudnn-frontend), compiled blocks with whole-forward CUDA graphs, batched true CFG.",
                    [_image(), _loader(2, (0, 0), attention="cudnn_fp8"),
                     _fp8(3, (420, 0), (2, 0), "scaled_mm_rowwise", FASTEST_LAYERS),
                     _compile(4, (840, 0), (3, 0), cuda_graphs=True), _sampler(5, (1260, 0), (4, 0)),
                     _save(6, (1680, 0), (5, 0), "qwen_edit_fastest")])


def preset_fastest_2gpu() -> Workflow:
    parallel = Node(5, "QwenEditHopper_Parallel", {"cfg_parallel": True, "ulysses": "1", "gpus": ""},
                    links={"pipe": (4, 0)}, pos=(1260, 0))
    return Workflow("qwen_edit_fastest_2gpu", "fastest on 2 GPUs",
                    "The fastest preset with CFG-parallel: the prompt's and the negative prompt's forwards of each "
                    "step on two GPUs of this host (one worker process each, one exchange per step).",
                    [_image(), _loader(2, (0, 0), attention="cudnn_fp8"),
                     _fp8(3, (420, 0), (2, 0), "scaled_mm_rowwise", FASTEST_LAYERS),
                     _compile(4, (840, 0), (3, 0), cuda_graphs=True), parallel,
                     _sampler(6, (1680, 0), (5, 0)), _save(7, (2100, 0), (6, 0), "qwen_edit_fastest_2gpu")])


def preset_lora_fused() -> Workflow:
    return Workflow("qwen_edit_lora_fused", "LoRA fused",
                    "A LoRA fused into the bf16 weights (exactly removable), then FP8: fusion always comes first.",
                    [_image(), _loader(2, (0, 0)), _lora(3, (420, 0), (2, 0), LIGHTNING_8),
                     _fp8(4, (840, 0), (3, 0), "scaled_mm_rowwise"), _sampler(5, (1260, 0), (4, 0), steps=8),
                     _save(6, (1680, 0), (5, 0), "qwen_edit_lora")])


def preset_lightning_4step() -> Workflow:
    return Workflow("qwen_edit_lightning_4step", "Lightning 4-step",
                    "Lightning 4-step LoRA (scheduler and cfg 1 chosen automatically), the fastest preset's FP8 "
                    "linears and cuDNN FP8 attention, compiled.",
                    [_image(), _loader(2, (0, 0), attention="cudnn_fp8"), _lora(3, (420, 0), (2, 0), LIGHTNING_4),
                     _fp8(4, (840, 0), (3, 0), "scaled_mm_rowwise", FASTEST_LAYERS), _compile(5, (1260, 0), (4, 0)),
                     _sampler(6, (1680, 0), (5, 0), steps=4), _save(7, (2100, 0), (6, 0), "qwen_edit_lightning")])


def preset_low_vram() -> Workflow:
    return Workflow("qwen_edit_low_vram", "low VRAM",
                    "FP8 weight storage (bf16 compute), the fp8_scaled text encoder, and the last "
                    f"{LOW_VRAM_HOST_BLOCKS} DiT blocks kept in host memory (copied to the GPU each forward): under "
                    "20 GiB of GPU memory at 1 megapixel.",
                    [_image(), _loader(2, (0, 0), text_encoder=TEXT_ENCODER_FP8, host_blocks=LOW_VRAM_HOST_BLOCKS),
                     _fp8(3, (420, 0), (2, 0), "weight_only"), _sampler(4, (840, 0), (3, 0)),
                     _save(5, (1260, 0), (4, 0), "qwen_edit_low_vram")])


def preset_benchmark() -> Workflow:
    bench = Node(6, "QwenEditHopper_Benchmark", {
        "prompt": PROMPT, "steps": 8, "warmup": 1, "repeats": 2, "width": 0, "height": 0, "seed": 42, "cfg": 4.0,
        "reference_megapixels": 1.0,
    }, links={"pipe_1": (2, 0), "image": (1, 0), "pipe_2": (3, 0), "pipe_3": (5, 0)}, pos=(1260, 0))
    return Workflow("qwen_edit_benchmark", "benchmark",
                    "Compares presets side by side on one loaded base: seconds per step and image, peak VRAM, "
                    "PSNR/SSIM against the first (bf16) variant.",
                    [_image(), _loader(2, (0, 0)), _fp8(3, (420, 200), (2, 0), "te"),
                     _fp8(4, (420, 500), (2, 0), "scaled_mm_rowwise", FASTEST_LAYERS), _compile(5, (840, 500), (4, 0)),
                     bench,
                     Node(7, "PreviewImage", links={"images": (6, 0)}, pos=(1680, 0)),
                     Node(8, "PreviewAny", links={"source": (6, 1)}, pos=(1680, 400))])


CORE_SHIFT = 3.1
"""ModelSamplingAuraFlow's shift in ComfyUI's own Qwen-Image-Edit-2509 workflow."""


def preset_comfy_model_fp8() -> Workflow:
    """ComfyUI core's Qwen-Image-Edit-2509 graph with Apply TE-FP8 and Compile Model on its MODEL."""
    fp8 = _fp8(6, (840, 0), (5, 0), "scaled_mm_rowwise", FASTEST_LAYERS, source="model", attention="cudnn_fp8",
               model_block="pack fused")
    compile_node = _compile(7, (1260, 0), (6, 2), source="model")
    encode = {"clip": (3, 0), "vae": (4, 0), "image1": (1, 0)}
    return Workflow("qwen_edit_comfy_model_fp8", "ComfyUI core nodes + FP8",
                    "ComfyUI's own Qwen-Image-Edit-2509 graph (UNETLoader, CLIPLoader, TextEncodeQwenImageEditPlus, "
                    "ModelSamplingAuraFlow, KSampler) with Apply TE-FP8 and Compile Model on its MODEL: the fastest "
                    "preset's row-wise FP8 linears, cuDNN FP8 attention, the pack's fused block through ComfyUI's "
                    "block-replacement hook and compiled blocks, for KSampler and any "
                    "other MODEL node. LoRAs loaded with LoraLoaderModelOnly before Apply TE-FP8 are applied to the "
                    "bf16 weights, then quantized. The edit has the input picture's size.",
                    [_image(1, (0, 700)),
                     Node(2, "UNETLoader", {"unet_name": DIT, "weight_dtype": "default"}, pos=(0, 0)),
                     Node(3, "CLIPLoader", {"clip_name": TEXT_ENCODER_FP8, "type": "qwen_image", "device": "default"},
                          pos=(0, 250)),
                     Node(4, "VAELoader", {"vae_name": VAE}, pos=(0, 500)),
                     Node(5, "ModelSamplingAuraFlow", {"shift": CORE_SHIFT}, links={"model": (2, 0)},
                          pos=(420, 0)),
                     fp8, compile_node,
                     Node(8, "TextEncodeQwenImageEditPlus", {"prompt": PROMPT}, links=dict(encode), pos=(420, 300),
                          title="Prompt"),
                     Node(9, "TextEncodeQwenImageEditPlus", {"prompt": ""}, links=dict(encode), pos=(420, 600),
                          title="Negative prompt"),
                     Node(10, "VAEEncode", links={"pixels": (1, 0), "vae": (4, 0)}, pos=(840, 700)),
                     Node(11, "KSampler", {"seed": 42, "steps": 40, "cfg": 4.0, "sampler_name": "euler",
                                           "scheduler": "simple", "denoise": 1.0},
                          links={"model": (7, 2), "positive": (8, 0), "negative": (9, 0), "latent_image": (10, 0)},
                          pos=(1680, 0)),
                     Node(12, "VAEDecode", links={"samples": (11, 0), "vae": (4, 0)}, pos=(2100, 0)),
                     _save(13, (2100, 300), (12, 0), "qwen_edit_comfy_model_fp8")])


PRESETS: list[Callable[[], Workflow]] = [
    preset_bf16_baseline, preset_te_fp8, preset_fastest, preset_fastest_2gpu, preset_lora_fused,
    preset_lightning_4step, preset_low_vram, preset_benchmark, preset_comfy_model_fp8,
]


def widget_values(node: Node) -> list[Any]:
    values = []
    for name, value in node.widgets.items():
        values.append(value)
        if name in CONTROL_AFTER_GENERATE:
            values.append("fixed")
    if node.type == "LoadImage":
        values.append("image")
    return values


def models_of(workflow: Workflow) -> list[dict[str, str]]:
    models = []
    for node in workflow.nodes:
        for value in node.widgets.values():
            if isinstance(value, str) and value in MODEL_SOURCES:
                directory, url = MODEL_SOURCES[value]
                models.append({"name": value, "url": url, "directory": directory})
    return models


def to_ui(workflow: Workflow) -> dict[str, Any]:
    """The frontend's workflow format (litegraph, version 0.4)."""
    links, link_ids = [], {}
    for node in workflow.nodes:
        for input_name, (source_id, slot) in node.links.items():
            link_id = len(links) + 1
            source_type = OUTPUTS[workflow.node(source_id).type][slot][1]
            links.append([link_id, source_id, slot, node.id, _input_slot(node, input_name), source_type])
            link_ids[(node.id, input_name)] = link_id
    ui_nodes = []
    for order, node in enumerate(workflow.nodes):
        inputs = [{"name": name, "type": kind, "link": link_ids.get((node.id, name))}
                  for name, kind in _linked_inputs(node)]
        outputs = []
        for slot, (name, kind) in enumerate(OUTPUTS[node.type]):
            outputs.append({"name": name, "type": kind, "slot_index": slot,
                            "links": [link[0] for link in links if link[1] == node.id and link[2] == slot]})
        properties: dict[str, Any] = {"Node name for S&R": node.type}
        node_models = list(models_of(Workflow("", "", "", [node])))
        if node_models:
            properties["models"] = node_models
        ui_nodes.append({
            "id": node.id, "type": node.type, "pos": list(node.pos), "size": [380, 260], "flags": {},
            "order": order, "mode": 0, "inputs": inputs, "outputs": outputs, "properties": properties,
            "widgets_values": widget_values(node), **({"title": node.title} if node.title else {}),
        })
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"qwen-edit-hopper/{workflow.name}")), "revision": 0,
        "last_node_id": max(n.id for n in workflow.nodes),
        "last_link_id": len(links), "nodes": ui_nodes, "links": links, "groups": [], "config": {},
        "extra": {"ds": {"scale": 0.8, "offset": [40, 40]}, "info": {"title": workflow.title,
                                                                       "description": workflow.description}},
        "version": 0.4, "models": models_of(workflow),
    }


def _linked_inputs(node: Node) -> list[tuple[str, str]]:
    """Link inputs the frontend shows on this node: connected ones plus the node's non-optional sockets."""
    declared = LINK_INPUTS.get(node.type, [])
    return [(name, kind) for name, kind in declared if name in node.links]


def _input_slot(node: Node, input_name: str) -> int:
    return [name for name, _ in _linked_inputs(node)].index(input_name)


def to_api(workflow: Workflow) -> dict[str, Any]:
    """ComfyUI's API prompt format: {node_id: {class_type, inputs}}."""
    prompt = {}
    for node in workflow.nodes:
        inputs: dict[str, Any] = dict(node.widgets)
        for name, (source_id, slot) in node.links.items():
            inputs[name] = [str(source_id), slot]
        prompt[str(node.id)] = {"class_type": node.type, "inputs": inputs,
                                "_meta": {"title": node.title or node.type}}
    return prompt


def thumbnail(workflow: Workflow) -> bytes:
    """A JPEG sketch of the graph: one box per node, arrows for links."""
    from PIL import Image, ImageDraw

    scale, pad = 0.22, 20
    width = int(max(n.pos[0] for n in workflow.nodes) * scale) + 2 * pad + 90
    height = int(max(n.pos[1] for n in workflow.nodes) * scale) + 2 * pad + 50
    image = Image.new("RGB", (max(width, 320), max(height, 180)), (32, 34, 40))
    draw = ImageDraw.Draw(image)
    boxes = {}
    for node in workflow.nodes:
        x, y = pad + node.pos[0] * scale, pad + node.pos[1] * scale
        boxes[node.id] = (x, y, x + 84, y + 40)
    for node in workflow.nodes:
        for source_id, _slot in node.links.values():
            sx = boxes[source_id]
            tx = boxes[node.id]
            draw.line([(sx[2], (sx[1] + sx[3]) / 2), (tx[0], (tx[1] + tx[3]) / 2)], fill=(140, 180, 240), width=2)
    for node in workflow.nodes:
        ours = node.type.startswith("QwenEditHopper_")
        draw.rectangle(boxes[node.id], fill=(70, 90, 140) if ours else (70, 70, 70), outline=(200, 200, 200))
        label = node.type.replace("QwenEditHopper_", "")[:13]
        draw.text((boxes[node.id][0] + 4, boxes[node.id][1] + 14), label, fill=(240, 240, 240))
    draw.text((pad, image.height - 16), workflow.title, fill=(240, 200, 120))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


def rendered() -> dict[Path, bytes]:
    files = {}
    for preset in PRESETS:
        workflow = preset()
        files[OUT_DIR / f"{workflow.name}.json"] = (json.dumps(to_ui(workflow), indent=2) + "\n").encode()
        files[API_DIR / f"{workflow.name}.json"] = (json.dumps(to_api(workflow), indent=2) + "\n").encode()
        files[OUT_DIR / f"{workflow.name}.jpg"] = thumbnail(workflow)
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the written files differ from the source")
    args = parser.parse_args()
    files = rendered()
    if args.check:
        stale = [str(p.relative_to(ROOT)) for p, data in files.items()
                 if p.suffix == ".json" and (not p.exists() or p.read_bytes() != data)]
        if stale:
            print("workflows out of date (run python scripts/workflows.py):", *stale, sep="\n  ")
            return 1
        return 0
    API_DIR.mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        path.write_bytes(data)
        print("wrote", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
