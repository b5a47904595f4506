"""Drive ComfyUI's own frontend (served by the real test server) in headless Chromium.

Helpers for tests/browser: launching the system Chromium, one page of the
frontend (1.32.9 as ComfyUI 0.3.75 ships it, 1.49.6 as 0.33.0 does) with its
console recorded, opening a shipped workflow through the
Templates dialog (the way a user does), reading the loaded graph back, queueing
from the Run button, and keeping a screenshot and the console log under
``test-artifacts/browser/`` when a check fails.

Nothing here downloads a browser: Chromium is Debian's (``/usr/bin/chromium``,
or ``QWEN_EDIT_CHROMIUM``), and the page may only talk to the test server:
every request elsewhere is aborted (or refused first by the page's own CSP) and
recorded in the console log.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = Path(os.environ.get("QWEN_EDIT_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1600, "height": 1000}

# Server-side user settings written before the page opens. TutorialCompleted: a new user's first load
# opens the Templates dialog over a blank workflow (a race with our own opening of it); the test opens
# it itself. The other three are the frontend's defaults, set explicitly because the checks rely on them:
# the workflow schema check (a failure shows a warning toast), and the missing-nodes / missing-models dialogs.
SETTINGS = {
    "Comfy.TutorialCompleted": True,
    "Comfy.Validation.Workflows": True,
    "Comfy.Workflow.ShowMissingNodesWarning": True,
    "Comfy.Workflow.ShowMissingModelsWarning": True,
}

# Keys of the frontend's global dialogs (each dialog's header carries its key as an element id).
DIALOG_KEYS = {
    "global-missing-nodes": "missing node types",
    "global-missing-models-warning": "missing models",
    "global-execution-error": "execution error",
    "global-error": "error",
    "global-prompt": "prompt",
}

# The frontend's UI -> API conversion (app.graphToPrompt) against our API twins: the only differences
# tolerated, each a key the server ignores (the node does not declare it):
#  - LoadImage "upload": the twin may carry "upload": "image" (what older frontends sent); 1.32.9's
#    upload button widget is not serialized, so the frontend never sends it.
#  - PreviewAny "preview": the frontend's text-display widget on PreviewAny is serialized ("preview": "");
#    PreviewAny declares only "source".
# Node titles (_meta.title) are not compared: the frontend writes display names, the twin class types;
# the server never reads them.
TWIN_ONLY_INPUTS = {("LoadImage", "upload"): "image"}
UI_ONLY_INPUTS = {("PreviewAny", "preview")}

# Where the two frontends differ, a selector names both: the first part is 1.32.9's, the second 1.49.6's.
# The Templates dialog: 1.32.9's PrimeVue dialog class; 1.49.6's dialog role around the template grid.
TEMPLATES_DIALOG = ('.workflow-template-selector-dialog, '
                    '[role="dialog"]:has([data-testid="template-workflows-content"])')
# The Run button: inside 1.32.9's split button "queue-button"; 1.49.6's "queue-button" is the button itself.
RUN_BUTTON = '[data-testid="queue-button"] button[aria-label="Run"], button[data-testid="queue-button"]'

READY_JS = """() => !!(window.app && window.app.vueAppReady && window.app.graph && window.LiteGraph
    && window.app.graph.nodes.length > 0 && document.querySelector('[data-testid="queue-button"]'))"""

GRAPH_JS = """() => {
  // ids as numbers: 1.49.6 keeps a loaded workflow's node ids as strings
  const graph = window.app.graph;
  const registered = window.LiteGraph.registered_node_types;
  const links = graph.links instanceof Map ? [...graph.links.values()] : Object.values(graph.links || {});
  return {
    nodes: graph.nodes.map(n => ({
      id: Number(n.id), type: n.type, registered: Object.prototype.hasOwnProperty.call(registered, n.type),
      has_errors: !!n.has_errors,
      inputs: (n.inputs || []).map(i => ({name: i.name, type: String(i.type),
                                          link: i.link == null ? null : Number(i.link)})),
      outputs: (n.outputs || []).map(o => ({name: o.name, type: String(o.type), links: (o.links || []).map(Number)})),
    })),
    links: links.filter(Boolean).map(l => ({id: Number(l.id), origin_id: Number(l.origin_id),
      origin_slot: l.origin_slot, target_id: Number(l.target_id), target_slot: l.target_slot, type: String(l.type)})),
  };
}"""

# 1.49.6's status cards that report success, not a problem (compared whole).
BENIGN_NOTIFICATIONS = ["Job completed"]

OVERLAYS_JS = """benign => {
  const visible = e => !!(e.offsetWidth || e.offsetHeight || e.getClientRects().length);
  return {
    dialogs: [...document.querySelectorAll('.p-dialog')].filter(visible).map(d => ({
      ids: [...d.querySelectorAll('[id]')].map(e => e.id).filter(id => id.startsWith('global-')),
      text: d.innerText.slice(0, 600)})),
    // PrimeVue toasts (both frontends); 1.49.6 also raises notifications as role="status" cards
    toasts: [...document.querySelectorAll('.p-toast-message, div[role="status"]')].filter(visible)
      .map(t => t.innerText.trim().slice(0, 600)).filter(text => text.length > 0 && !benign.includes(text)),
  };
}"""

IMAGE_SHOWN_JS = """([nodeId, filename]) => {
  const node = window.app.graph.getNodeById(nodeId) ?? window.app.graph.getNodeById(String(nodeId));
  return (node?.imgs || []).some(img => {
    const url = new URL(img.src, location.href);
    return url.pathname.endsWith('/view') && url.searchParams.get('filename') === filename
      && img.complete && img.naturalWidth > 0;
  });
}"""

TEXT_SHOWN_JS = """([nodeId, needle]) => {
  const node = window.app.graph.getNodeById(nodeId) ?? window.app.graph.getNodeById(String(nodeId));
  // PreviewAny's display widget: 'preview' in frontend 1.32, 'preview_text' in 1.49
  const widget = (node?.widgets || []).find(w => w.name === 'preview' || w.name === 'preview_text');
  if (!widget) return false;
  const shown = widget.element ? (widget.element.innerText || widget.element.value || '') : '';
  return String(widget.value ?? '').includes(needle) && (!widget.element || shown.length > 0);
}"""

NODE_STATE_JS = """nodeId => {
  const node = window.app.graph.getNodeById(nodeId) ?? window.app.graph.getNodeById(String(nodeId));
  if (!node) return {node: null};
  return {
    imgs: (node.imgs || []).map(img => ({src: img.src, complete: img.complete, width: img.naturalWidth})),
    outputs: (window.app.nodeOutputs || {})[String(nodeId)] ?? null,
    widgets: (node.widgets || []).map(w => ({name: w.name, value: String(w.value ?? '').slice(0, 200)})),
  };
}"""


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not CHROMIUM.exists():
        return f"no Chromium at {CHROMIUM} (set QWEN_EDIT_CHROMIUM; a browser is never downloaded)"
    return None


class Frontend:
    """One page of ComfyUI's frontend on ``server_url``, with its console, errors and requests recorded."""

    def __init__(self, context, server_url: str, artifact_name: str):
        self.server_url = server_url.rstrip("/")
        self.artifact_dir = ARTIFACTS / re.sub(r"[^A-Za-z0-9_.-]+", "_", artifact_name)
        shutil.rmtree(self.artifact_dir, ignore_errors=True)  # a previous failure's files would mislead
        self.log: list[str] = []
        self.started = time.monotonic()
        context.route(lambda url: not url.startswith(self.server_url + "/"), self._refuse)
        self.page = context.new_page()
        self.page.set_default_timeout(60_000)
        self.page.on("console", lambda msg: self._note(f"console.{msg.type}: {msg.text}"))
        self.page.on("pageerror", lambda err: self._note(f"pageerror: {err}"))
        self.page.on("requestfailed", lambda req: self._note(f"requestfailed: {req.method} {req.url} "
                                                             f"({req.failure})"))

    def _note(self, line: str) -> None:
        self.log.append(f"[{time.monotonic() - self.started:7.1f} s] {line}")

    def _refuse(self, route) -> None:
        self._note(f"blocked (not the test server): {route.request.method} {route.request.url}")
        route.abort("blockedbyclient")

    # --- failure artifacts ---------------------------------------------------------------------

    def save_artifacts(self) -> str:
        """Write the screenshot and the console log; return a line naming them."""
        self.artifact_dir.mkdir(parents=True, exist_ok=True)
        screenshot = self.artifact_dir / "screenshot.png"
        console = self.artifact_dir / "console.log"
        try:
            self.page.screenshot(path=str(screenshot), full_page=True, timeout=30_000)
        except Exception as exc:  # the page may be gone: keep the log anyway
            self._note(f"(screenshot failed: {exc})")
            screenshot = None
        console.write_text("\n".join(self.log) + "\n")
        return f"[artifacts: screenshot {screenshot or '(none)'}, console log {console}]"

    @contextlib.contextmanager
    def artifacts_on_failure(self) -> Iterator[None]:
        """Any failure inside becomes an AssertionError naming the saved screenshot and console log."""
        try:
            yield
        except AssertionError as exc:
            where = self.save_artifacts()
            exc.args = (f"{exc.args[0] if exc.args else ''}\n{where}", *exc.args[1:])
            raise
        except Exception as exc:
            where = self.save_artifacts()
            raise AssertionError(f"{type(exc).__name__}: {exc}\n{where}") from exc

    # --- loading -------------------------------------------------------------------------------

    def open(self) -> None:
        """Load the frontend and wait until it has built its default graph and its action bar."""
        self.page.goto(self.server_url + "/", timeout=120_000)
        self.page.wait_for_function(READY_JS, timeout=120_000, polling=250)
        self.page.wait_for_load_state("networkidle")

    def version(self) -> str:
        """The frontend's version (``window.__COMFYUI_FRONTEND_VERSION__``), e.g. ``1.49.6``."""
        return str(self.page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__"))

    def custom_templates(self) -> dict[str, list[str]]:
        """The frontend's source of custom-node templates (what its Templates dialog lists per pack)."""
        return self.page.evaluate("() => fetch('/api/workflow_templates').then(r => r.json())")

    def open_template(self, pack: str, name: str) -> dict[str, Any]:
        """Open Templates in the sidebar, pick the pack's section, click the workflow's card.

        Returns the workflow JSON the frontend fetched from ``/api/workflow_templates/<pack>/<name>.json``.
        """
        self.page.get_by_role("button", name="Templates", exact=True).click()
        dialog = self.page.locator(TEMPLATES_DIALOG).first
        dialog.wait_for()
        dialog.locator("nav").get_by_text(pack, exact=True).click()
        card = dialog.get_by_test_id(f"template-workflow-{name}")
        route = f"/api/workflow_templates/{pack}/{name}.json"
        with self.page.expect_response(lambda r: r.url.startswith(self.server_url + route)) as answer:
            card.click()
        response = answer.value
        assert response.status == 200, f"{route} answered {response.status}"
        workflow = response.json()
        dialog.wait_for(state="detached")
        ids = sorted(node["id"] for node in workflow["nodes"])
        self.page.wait_for_function("ids => JSON.stringify(window.app.graph.nodes.map(n => Number(n.id))"
                                    ".sort((a, b) => a - b))"
                                    " === JSON.stringify(ids)", arg=ids, timeout=60_000, polling=250)
        # The missing-models check and the schema check answer asynchronously (model lists are fetched).
        self.page.wait_for_load_state("networkidle")
        self.page.wait_for_timeout(500)
        return workflow

    def load_graph_data(self, workflow: dict[str, Any]) -> None:
        """Load a workflow the way an extension or a dropped file does (``app.loadGraphData``)."""
        self.page.evaluate("wf => window.app.loadGraphData(wf)", workflow)
        self.page.wait_for_load_state("networkidle")
        self.page.wait_for_timeout(500)

    # --- reading the page ----------------------------------------------------------------------

    def graph(self) -> dict[str, Any]:
        return self.page.evaluate(GRAPH_JS)

    def overlays(self) -> dict[str, list]:
        """Visible dialogs (with their global-* keys) and toasts."""
        return self.page.evaluate(OVERLAYS_JS, BENIGN_NOTIFICATIONS)

    def api_prompt(self) -> dict[str, Any]:
        """The frontend's own UI -> API conversion of the loaded graph (what Run sends as ``prompt``)."""
        return self.page.evaluate("async () => (await window.app.graphToPrompt()).output")

    def set_widgets(self, node_types: tuple[str, ...], name: str, value: Any) -> int:
        """Set widget ``name`` to ``value`` on every node of ``node_types`` (as picking it in the node's combo
        does); returns how many widgets were set."""
        return int(self.page.evaluate(
            """([types, name, value]) => {
                let count = 0;
                for (const node of window.app.graph._nodes) {
                    if (!types.includes(node.type)) continue;
                    const widget = (node.widgets || []).find(w => w.name === name);
                    if (!widget) continue;
                    widget.value = value;
                    if (widget.callback) widget.callback(value, window.app.canvas, node);
                    count += 1;
                }
                window.app.graph.setDirtyCanvas(true, true);
                return count;
            }""", [list(node_types), name, value]))

    def fit_view(self) -> None:
        """Zoom the canvas to the whole graph (the canvas draws, and so loads the images of, visible nodes only)."""
        button = self.page.locator('button[aria-label^="Fit View"]')
        if button.count() == 1:
            button.click()
        else:
            self.page.evaluate("() => window.app.extensionManager.command.execute('Comfy.Canvas.FitView')")
        self.page.wait_for_timeout(300)

    # --- running -------------------------------------------------------------------------------

    def queue_from_ui(self) -> tuple[str, dict[str, Any], str]:
        """Click Run in the action bar; return (prompt_id, the prompt the page sent, how it was queued).

        Fallback, only if the Run button cannot be found: ``app.queuePrompt(0)`` (what the button calls),
        with a warning, so that a frontend whose action bar moved still runs the rest of the checks.
        """
        button = self.page.locator(RUN_BUTTON)

        def is_post(r) -> bool:
            return (r.request.method == "POST" and r.url.startswith(self.server_url)
                    and urlparse(r.url).path in ("/api/prompt", "/prompt"))

        with self.page.expect_response(is_post, timeout=120_000) as answer:
            if button.count() == 1:
                button.click()
                how = "Run button"
            else:
                warnings.warn(f"Run button not found ({RUN_BUTTON}): "
                              "queued with app.queuePrompt(0) instead", stacklevel=2)
                self.page.evaluate("() => window.app.queuePrompt(0)")
                how = "app.queuePrompt(0) (Run button not found)"
        response = answer.value
        sent = json.loads(response.request.post_data or "{}")
        body = response.json()
        assert response.status == 200, f"the server refused the UI's prompt ({response.status}): {json.dumps(body)}"
        return body["prompt_id"], sent.get("prompt", {}), how

    def wait_for_image(self, node_id: int, filename: str, timeout_s: float = 60) -> None:
        """Wait until the node shows the image /view?filename=<filename>, loaded by the browser."""
        self._wait(IMAGE_SHOWN_JS, [node_id, filename], timeout_s, f"node {node_id} to show {filename}")

    def wait_for_text(self, node_id: int, needle: str, timeout_s: float = 60) -> None:
        """Wait until a PreviewAny node's display widget holds ``needle`` (and shows something)."""
        self._wait(TEXT_SHOWN_JS, [node_id, needle], timeout_s, f"node {node_id} to show text {needle!r}")

    def _wait(self, js: str, arg: list, timeout_s: float, what: str) -> None:
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            self.page.wait_for_function(js, arg=arg, timeout=timeout_s * 1000, polling=250)
        except PlaywrightTimeout:
            state = self.page.evaluate(NODE_STATE_JS, arg[0])
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}; the page has {json.dumps(state)}") from None


# --- checks on what the page reports (plain data, so their messages can be precise) ----------------


def graph_problems(graph: dict[str, Any], workflow: dict[str, Any]) -> list[str]:
    """Unregistered node types, dropped or added nodes, and links that are broken or rewired on load."""
    problems = []
    nodes = {node["id"]: node for node in graph["nodes"]}
    if sorted(nodes) != sorted(n["id"] for n in workflow["nodes"]):
        problems.append(f"node ids {sorted(nodes)} != the file's {sorted(n['id'] for n in workflow['nodes'])}")
    for node in graph["nodes"]:
        if not node["registered"]:
            problems.append(f"node {node['id']}: type {node['type']!r} is not registered in LiteGraph")
        if node["has_errors"]:
            problems.append(f"node {node['id']} ({node['type']}) has errors (placeholder for a missing type?)")
    links = {link["id"]: link for link in graph["links"]}
    for link in graph["links"]:
        name = f"link {link['id']}"
        origin, target = nodes.get(link["origin_id"]), nodes.get(link["target_id"])
        if origin is None or target is None:
            problems.append(f"{name}: node {link['origin_id']} -> {link['target_id']} does not exist")
            continue
        if not 0 <= link["origin_slot"] < len(origin["outputs"]):
            problems.append(f"{name}: node {origin['id']} has no output slot {link['origin_slot']}")
            continue
        if not 0 <= link["target_slot"] < len(target["inputs"]):
            problems.append(f"{name}: node {target['id']} has no input slot {link['target_slot']}")
            continue
        output, inp = origin["outputs"][link["origin_slot"]], target["inputs"][link["target_slot"]]
        if link["id"] not in output["links"]:
            problems.append(f"{name}: not listed by node {origin['id']} output {output['name']}")
        if inp["link"] != link["id"]:
            problems.append(f"{name}: node {target['id']} input {inp['name']} holds link {inp['link']}")
        if output["type"] != link["type"] or inp["type"] not in (link["type"], "*"):
            problems.append(f"{name}: types {output['type']} -> {link['type']} -> {inp['type']} do not match")
    for node in graph["nodes"]:
        for inp in node["inputs"]:
            if inp["link"] is not None and inp["link"] not in links:
                problems.append(f"node {node['id']} input {inp['name']} holds link {inp['link']}, which does not exist")
    expected = set()
    by_id = {n["id"]: n for n in workflow["nodes"]}
    for link_id, origin_id, origin_slot, target_id, target_slot, _type in workflow["links"]:
        target_inputs = by_id.get(target_id, {}).get("inputs", [])
        if origin_id not in by_id or not 0 <= target_slot < len(target_inputs):
            problems.append(f"link {link_id} of the file: {origin_id}:{origin_slot} -> {target_id}:{target_slot} "
                            "has no such node or input")
            continue
        expected.add((link_id, origin_id, origin_slot, target_id, target_inputs[target_slot]["name"]))
    loaded = set()
    for link in graph["links"]:
        target = nodes.get(link["target_id"])
        if target and 0 <= link["target_slot"] < len(target["inputs"]):
            loaded.add((link["id"], link["origin_id"], link["origin_slot"], link["target_id"],
                        target["inputs"][link["target_slot"]]["name"]))
    for missing in sorted(expected - loaded):
        problems.append(f"link {missing[0]} of the file ({missing[1]}:{missing[2]} -> {missing[3]}.{missing[4]}) "
                        "is not in the loaded graph")
    for extra in sorted(loaded - expected):
        problems.append(f"link {extra[0]} ({extra[1]}:{extra[2]} -> {extra[3]}.{extra[4]}) is not in the file")
    return problems


def overlay_problems(overlays: dict[str, list]) -> list[str]:
    problems = []
    for dialog in overlays["dialogs"]:
        kinds = [DIALOG_KEYS.get(key, key) for key in dialog["ids"]] or ["a dialog"]
        problems.append(f"{', '.join(kinds)} dialog is open: {dialog['text']!r}")
    problems += [f"toast: {text!r}" for text in overlays["toasts"]]
    return problems


def prompt_differences(ui: dict[str, Any], twin: dict[str, Any]) -> list[str]:
    """Where the frontend's API prompt differs from the API twin, less the documented exceptions."""
    differences = []
    if sorted(ui) != sorted(twin):
        differences.append(f"node ids: frontend {sorted(ui)} != twin {sorted(twin)}")
    for node_id in sorted(set(ui) & set(twin), key=int):
        ours, theirs = ui[node_id], twin[node_id]
        class_type = theirs["class_type"]
        if ours["class_type"] != class_type:
            differences.append(f"node {node_id}: class_type {ours['class_type']!r} != twin {class_type!r}")
            continue
        for key in sorted(set(ours["inputs"]) | set(theirs["inputs"])):
            if key not in ours["inputs"] and TWIN_ONLY_INPUTS.get((class_type, key), object()) == theirs["inputs"][key]:
                continue
            if key not in theirs["inputs"] and (class_type, key) in UI_ONLY_INPUTS:
                continue
            mine, want = ours["inputs"].get(key, "<absent>"), theirs["inputs"].get(key, "<absent>")
            if not same_value(mine, want):
                differences.append(f"node {node_id} ({class_type}) input {key!r}: frontend {mine!r}, twin {want!r}")
    return differences


def same_value(a: Any, b: Any) -> bool:
    """JSON equality where 1 and 1.0 agree (JavaScript writes 1.0 as 1) but True and 1 do not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    return a == b
