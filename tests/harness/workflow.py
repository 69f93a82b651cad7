"""Convert workflows between ComfyUI's UI format (``nodes``/``links``, what the editor saves
and ``example_workflows/`` holds) and the API format ``POST /prompt`` takes.

Both directions need the server's ``/object_info`` to know which inputs are widgets and in
which order their values are stored (``widgets_values``). A seed-like INT input with
``control_after_generate`` is followed by one extra value ("fixed", "randomize", ...) in
``widgets_values``, as the frontend stores it.
"""
from __future__ import annotations

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SKIPPED_TYPES = {"Note", "MarkdownNote"}


def _input_specs(info: dict):
    """Yield (name, type, options, is_widget) for a node's required then optional inputs."""
    order = info.get("input_order") or {s: list(info["input"].get(s, {})) for s in ("required", "optional")}
    for section in ("required", "optional"):
        for name in order.get(section, []):
            spec = info["input"].get(section, {}).get(name)
            if spec is None:
                continue
            typ = spec[0]
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            is_widget = (isinstance(typ, list) or typ in WIDGET_TYPES) and not opts.get("forceInput")
            yield name, ("COMBO" if isinstance(typ, list) else typ), opts, is_widget


def ui_to_api(ui: dict, object_info: dict) -> dict:
    """UI-format workflow → API-format prompt ``{node_id: {"class_type", "inputs"}}``.

    Muted (mode 2) nodes and notes are dropped; bypassed (mode 4) nodes pass their first input
    of the matching type through; Reroute nodes are resolved. Raises KeyError naming a node
    type the server does not know.
    """
    nodes = {str(n["id"]): n for n in ui["nodes"]}
    links = {l[0]: l for l in ui.get("links", [])}  # id → [id, from, from_slot, to, to_slot, type]

    def source(link_id):
        """Follow a link back through Reroutes and bypassed nodes to [node_id, slot]."""
        _, frm, slot, _, _, typ = links[link_id][:6]
        n = nodes[str(frm)]
        if n["type"] == "Reroute" or n.get("mode") == 4:
            for inp in n.get("inputs", []):
                if inp.get("link") is not None and (n["type"] == "Reroute" or inp.get("type") == typ):
                    return source(inp["link"])
            return None
        return [str(frm), slot]

    api = {}
    for nid, n in nodes.items():
        if n["type"] in SKIPPED_TYPES or n["type"] == "Reroute" or n.get("mode") in (2, 4):
            continue
        if n["type"] not in object_info:
            raise KeyError(f"node {nid}: type {n['type']!r} is not known to this ComfyUI (missing custom node?)")
        info = object_info[n["type"]]
        linked = {i["name"]: i.get("link") for i in n.get("inputs", [])}
        values = list(n.get("widgets_values") or [])
        if isinstance(n.get("widgets_values"), dict):  # some nodes store a name→value dict
            values = None
        inputs, vi = {}, 0
        for name, typ, opts, is_widget in _input_specs(info):
            if is_widget:
                if values is None:
                    val = n["widgets_values"].get(name)
                else:
                    val = values[vi] if vi < len(values) else opts.get("default")
                    vi += 1
                    if opts.get("control_after_generate"):
                        vi += 1
                if linked.get(name) is not None:
                    src = source(linked[name])
                    if src is not None:
                        inputs[name] = src
                elif val is not None:
                    inputs[name] = val
            elif linked.get(name) is not None:
                src = source(linked[name])
                if src is not None:
                    inputs[name] = src
        api[nid] = {"class_type": n["type"], "inputs": inputs, "_meta": {"title": n.get("title", n["type"])}}
    return api


def api_to_ui(api: dict, object_info: dict, titles: dict | None = None) -> dict:
    """API-format prompt → UI-format workflow (for authoring ``example_workflows/``).

    Nodes are laid out left to right by graph depth. Round-trips: ``ui_to_api(api_to_ui(p))``
    equals ``p`` (without ``_meta``).
    """
    titles = titles or {}
    ids = sorted(api, key=int)
    depth: dict[str, int] = {}

    def d(nid):
        if nid not in depth:
            ups = [v[0] for v in api[nid]["inputs"].values() if isinstance(v, list)]
            depth[nid] = 1 + max((d(u) for u in ups), default=-1)
        return depth[nid]

    for nid in ids:
        d(nid)
    rows: dict[int, int] = {}
    links, out_links = [], {}
    ui_nodes = []
    for order, nid in enumerate(sorted(ids, key=lambda i: (depth[i], int(i)))):
        node = api[nid]
        info = object_info[node["class_type"]]
        inputs, widgets = [], []
        for name, typ, opts, is_widget in _input_specs(info):
            val = node["inputs"].get(name)
            if is_widget:
                widgets.append(val if not isinstance(val, list) else opts.get("default"))
                if opts.get("control_after_generate"):
                    widgets.append("fixed")
                if isinstance(val, list):
                    inputs.append({"name": name, "type": typ, "widget": {"name": name}, "link": None, "_src": val})
            else:
                inputs.append({"name": name, "type": typ, "link": None, "_src": val if isinstance(val, list) else None})
        col = depth[nid]
        row = rows.get(col, 0)
        rows[col] = row + 1
        outputs = [{"name": nm, "type": t, "links": [], "slot_index": i}
                   for i, (nm, t) in enumerate(zip(info.get("output_name", info["output"]), info["output"]))]
        ui_nodes.append({"id": int(nid), "type": node["class_type"], "pos": [50 + 380 * col, 50 + 260 * row],
                         "size": [340, 120 + 26 * len(widgets)], "flags": {}, "order": order, "mode": 0,
                         "inputs": inputs, "outputs": outputs,
                         "properties": {"Node name for S&R": node["class_type"]}, "widgets_values": widgets,
                         **({"title": titles[nid]} if nid in titles else {})})
    by_id = {str(n["id"]): n for n in ui_nodes}
    for n in ui_nodes:
        for slot, inp in enumerate(n["inputs"]):
            src = inp.pop("_src")
            if src is None:
                continue
            link_id = len(links) + 1
            frm = by_id[str(src[0])]
            typ = frm["outputs"][src[1]]["type"]
            links.append([link_id, int(src[0]), src[1], n["id"], slot, typ])
            inp["link"] = link_id
            frm["outputs"][src[1]]["links"].append(link_id)
    return {"last_node_id": max(int(i) for i in ids), "last_link_id": len(links), "nodes": ui_nodes,
            "links": links, "groups": [], "config": {}, "extra": {}, "version": 0.4}


def strip_meta(api: dict) -> dict:
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in api.items()}
