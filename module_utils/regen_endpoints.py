"""Where the serve stage's servers answer: read back from the records it wrote on the controller.

The serving role records each server and router it runs in `<artifacts>/serving/<host>-<instance>/
state.json`: `{"state": "running", "kind": "server"|"router", "endpoint": URL, "served_model_name": ...}`
while it runs (a stopped one is `{"state": "stopped"}`). A stage run alone (`--tags generate`) finds the
endpoints there instead of taking a default port: a running router wins over the servers behind it, as
in the serve stage's own run. Pure functions over the parsed documents; the module reads the files.
"""

from __future__ import annotations

STATE_FILE = "state.json"
KINDS = ("router", "server")


def _model_names(records):
    return [doc["served_model_name"] for doc in records.values() if doc.get("served_model_name")]


def recorded_endpoints(states):
    """{endpoints, served_model_name, kind, records} from `states` ({record name: state.json document}).

    Only running records that name an endpoint count (a capture server records none: it serves no API
    for generation); the running routers' endpoints when there are any, else the servers'. `records`
    names the records the endpoints came from, sorted; empty when none serves.
    """
    running = {
        name: doc for name, doc in sorted((states or {}).items())
        if isinstance(doc, dict) and doc.get("state") == "running" and doc.get("endpoint")
    }
    # a router serves what the servers behind it serve: its name comes from them when it records none
    for kind in KINDS:
        chosen = {name: doc for name, doc in running.items() if doc.get("kind", "server") == kind}
        if chosen:
            endpoints = list(dict.fromkeys(doc["endpoint"] for doc in chosen.values()))
            names = _model_names(chosen) or (_model_names(running) if kind == "router" else [])
            return {
                "endpoints": endpoints,
                "served_model_name": names[0] if names else None,
                "kind": kind,
                "records": sorted(chosen),
            }
    return {"endpoints": [], "served_model_name": None, "kind": None, "records": []}
