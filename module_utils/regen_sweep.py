"""The layout sweep's plan side: which layouts to measure, which cannot run here, and what its report
changes in the plan.

Pure functions over the facts, the simulator's ranking (regen_simulator) and the sweep's report
(`artifacts/sweep/report.json`, written by `regen.jobs.sweep report`). The sweep role asks
`sweep_layouts` for its list; `apply_report` is how the plan "then uses" the measured recommendation:
the serving values it names replace the plan's own (each with the measurement as its reason, the
derived value kept beside it), unless the inventory overrides them, and only when the report was
measured for this model on this kind of host.
"""

from __future__ import annotations

import copy
import re

GIB = 1024**3
# Settings a layout may carry; the first group are plan values of `serving` (the others are server knobs
# the plan has no entry for, recorded in plan.serving.sweep for the serving role).
PLAN_SERVING_KEYS = (
    "tp_size",
    "ep_size",
    "pp_size",
    "dp_size",
    "attn_dp_size",
    "attention_backend",
    "mem_fraction_static",
)
SERVER_KEYS = ("moe_a2a_backend", "environment", "extra_args")
LAYOUT_KEYS = ("name", *PLAN_SERVING_KEYS, *SERVER_KEYS)
PARALLEL_KEYS = ("tp_size", "ep_size", "pp_size", "dp_size", "attn_dp_size")
_FLAGS = {
    "tp_size": "--tp-size",
    "ep_size": "--ep-size",
    "pp_size": "--pp-size",
    "dp_size": "--dp-size",
    "attn_dp_size": "--attn-dp-size",
    "attention_backend": "--attention-backend",
    "mem_fraction_static": "--mem-fraction-static",
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
PLAN_LAYOUT = "plan"


class LayoutError(ValueError):
    """A layout the user wrote that cannot be read; the message names it and what to fix."""


def _int(settings, key):
    value = settings.get(key)
    return 1 if value is None else int(value)


def check_layouts(layouts, variable="layout_sweep_layouts"):
    """Validate the inventory's layouts (names unique and file-safe, only known keys, ints >= 1)."""
    if not isinstance(layouts, list):
        raise LayoutError(
            f"{variable} must be a list of layouts, e.g. [{{name: tp8-ep8, tp_size: 8, ep_size: 8}}]"
        )
    seen = set()
    for index, layout in enumerate(layouts):
        if not isinstance(layout, dict):
            raise LayoutError(f"{variable}[{index}] is not a mapping")
        name = layout.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise LayoutError(
                f"{variable}[{index}].name must be a short name of letters, digits, '.', '_' "
                f"or '-' (it names files), got {name!r}"
            )
        if name in seen or (name == PLAN_LAYOUT and layout.get("_source") != "plan"):
            raise LayoutError(
                f"{variable}: the layout name {name!r} is used twice (or is the reserved "
                f"{PLAN_LAYOUT!r}, the plan's own layout)"
            )
        seen.add(name)
        unknown = sorted(set(layout) - set(LAYOUT_KEYS) - {"_source"})
        if unknown:
            raise LayoutError(
                f"{variable}[{index}] ({name}): unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(LAYOUT_KEYS)}"
            )
        for key in ("tp_size", "ep_size", "pp_size", "dp_size", "attn_dp_size"):
            value = layout.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise LayoutError(
                    f"{variable}[{index}] ({name}).{key} must be an integer >= 1, got {value!r}"
                )
    return layouts


def feasibility(settings, architecture, gpu, plan_serving=None):
    """(feasible, reason) of one layout on this host, by the plan's memory arithmetic.

    GPUs: tp x pp x dp must be visible. Memory: the weights split over tp x pp must fit the static share
    of one GPU (mem_fraction_static, the plan's unless the layout sets it), leaving room for KV cache;
    the plan's own KV sizing is not repeated here: SGLang sizes its pool from what is left, and the
    server's start-up (or the sweep's measurement) says the rest.
    """
    plan_serving = plan_serving or {}
    gpu = gpu or {}
    count = int(gpu.get("count") or 0)
    tp, pp, dp = _int(settings, "tp_size"), _int(settings, "pp_size"), _int(settings, "dp_size")
    ep, attn_dp = _int(settings, "ep_size"), _int(settings, "attn_dp_size")
    if count == 0:
        if max(tp, pp, dp, ep, attn_dp) > 1:
            return False, (
                "no GPU on this host: the CPU server runs one process, so tp/ep/pp/dp/attn-dp "
                "above 1 cannot be served here"
            )
        return True, "one CPU process"
    need = tp * pp * dp
    if need > count:
        return False, f"needs {need} GPUs (tp {tp} x pp {pp} x dp {dp}), the host has {count}"
    if tp % ep:
        return False, f"ep {ep} does not divide tp {tp} (SGLang splits the experts of the TP group)"
    if attn_dp > 1 and tp % attn_dp:
        return False, f"attn-dp {attn_dp} does not divide tp {tp}"
    weights = (architecture or {}).get("weight_bytes")
    per_gpu = gpu.get("memory_per_gpu_bytes") or 0
    fraction = settings.get("mem_fraction_static") or plan_serving.get("mem_fraction_static") or 0.85
    if weights and per_gpu:
        share = weights / (tp * pp)
        usable = per_gpu * float(fraction)
        if share > usable:
            return False, (
                f"weights {share / GIB:.1f} GiB per GPU at tp {tp} x pp {pp} exceed the "
                f"{usable / GIB:.1f} GiB static share of one {per_gpu / GIB:.1f} GiB GPU "
                f"(mem_fraction_static {float(fraction):.2f}): no room for any KV cache"
            )
        return True, (
            f"weights {share / GIB:.1f} GiB per GPU leave {(usable - share) / GIB:.1f} GiB of the "
            f"static share for KV cache"
        )
    return True, "weight size unknown: the server's start-up decides"


def plan_layout_settings(plan_serving):
    """The plan's own serving choice as layout settings (only the values above their defaults)."""
    plan_serving = plan_serving or {}
    settings = {}
    for key in ("tp_size", "ep_size", "pp_size", "dp_size", "attn_dp_size"):
        value = plan_serving.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            settings[key] = value
    return settings


def _estimate_for(settings, simulation):
    from .regen_simulator import match_estimate

    if not simulation:
        return {"output_tokens_per_s": None, "reason": "the simulator did not run"}
    if not simulation.get("covered"):
        return {"output_tokens_per_s": None, "reason": simulation.get("reason")}
    found = match_estimate(simulation.get("candidates"), settings)
    if found is None:
        return {
            "output_tokens_per_s": None,
            "reason": "not among the simulator's top candidates for this length budget",
        }
    return dict(found, source=simulation.get("tool"))


def sweep_layouts(
    requested, plan_serving, simulation, architecture, gpu, *, include_plan=True, simulator_top=3
):
    """The layouts the sweep measures, in order, each with its feasibility and the simulator's estimate.

    `requested`: the inventory's list (empty: the simulator's `simulator_top` best candidates). The plan's
    own choice comes first when `include_plan`. Duplicates (same settings) are measured once, under the
    first name. Returns a list of `{name, settings, source, feasible, reason, estimate}`.
    """
    check_layouts(list(requested or []))
    entries = []
    if include_plan:
        entries.append(
            {"name": PLAN_LAYOUT, "settings": plan_layout_settings(plan_serving), "source": "plan"}
        )
    if requested:
        for layout in requested:
            entries.append(
                {
                    "name": layout["name"],
                    "settings": {k: v for k, v in layout.items() if k in LAYOUT_KEYS and k != "name"},
                    "source": "inventory",
                }
            )
    elif simulation and simulation.get("covered"):
        for candidate in (simulation.get("candidates") or [])[:simulator_top]:
            entries.append(
                {
                    "name": candidate["name"],
                    "settings": dict(candidate["settings"]),
                    "source": f"simulator rank {candidate['rank']}",
                }
            )
    out, seen = [], {}
    for entry in entries:
        key = repr(sorted((k, repr(v)) for k, v in entry["settings"].items()))
        if key in seen:
            seen[key]["also"] = [*seen[key].get("also", []), entry["name"]]
            continue
        feasible, reason = feasibility(entry["settings"], architecture, gpu, plan_serving)
        entry.update(feasible=feasible, reason=reason, estimate=_estimate_for(entry["settings"], simulation))
        seen[key] = entry
        out.append(entry)
    return out


def report_applies(report, architecture, gpu, backend):
    """(applies, reason): whether a sweep report was measured for this model and this kind of host."""
    if not isinstance(report, dict) or not report:
        return False, "no layout sweep report (playbooks/sweep.yml writes artifacts/sweep/report.json)"
    inputs = report.get("inputs") or {}
    rec = report.get("recommended") or {}
    if not rec.get("layout"):
        return False, f"the sweep recommended no layout: {rec.get('reason')}"
    identity = inputs.get("model_identity") or {}
    mine = model_identity(architecture)
    if identity and identity != mine:
        return False, (
            f"the sweep measured another model ({identity.get('model_type')}, "
            f"{identity.get('num_layers')} layers): run the sweep again for this one"
        )
    gpus = int((gpu or {}).get("count") or 0)
    if inputs.get("gpu_count") is not None and int(inputs["gpu_count"]) != gpus:
        return False, f"the sweep ran on {inputs['gpu_count']} GPU(s), this host has {gpus}: run it again"
    if inputs.get("backend") and backend and inputs["backend"] != backend:
        return False, f"the sweep measured the {inputs['backend']} server, this run serves with {backend}"
    return True, "measured by the layout sweep"


def model_identity(architecture):
    """What identifies the model a sweep measured (the config's shape, not its path)."""
    arch = architecture or {}
    return {
        key: arch.get(key)
        for key in ("model_type", "num_layers", "hidden_size", "vocab_size", "weight_bytes")
    }


def apply_report(plan, report, overrides=None, architecture=None, gpu=None, backend=None):
    """The plan with the sweep's recommendation applied; adds `serving.sweep` either way.

    A recommended plan value replaces the plan's own unless the inventory overrides it
    (model_facts_plan_overrides.serving.<key>); `serving.sweep.value` holds the recommended layout, its
    settings (server knobs such as environment included) and concurrency, for the serving and generate
    roles. Returns a new plan; the input is not modified.
    """
    plan = copy.deepcopy(plan)
    serving = plan.setdefault("serving", {})
    applies, why = report_applies(report, architecture, gpu, backend)
    if not applies:
        serving["sweep"] = {"value": None, "reason": why + "; the plan's own rules decide"}
        return plan
    rec = report["recommended"]
    settings = dict(rec.get("settings") or {})
    overridden = set(((overrides or {}).get("serving") or {}).keys())
    applied, kept = [], []
    reason = (
        f"measured by the layout sweep: {rec['layout']} at concurrency {rec['concurrency']} gave "
        f"{rec['output_tokens_per_s']:g} output tokens/s (artifacts/sweep/report.json)"
    )
    for key in PLAN_SERVING_KEYS:
        if key in settings:
            value = settings[key]
        elif key in PARALLEL_KEYS and rec["layout"] != PLAN_LAYOUT:
            value = 1  # a layout that leaves a parallel size unset means 1, not "the plan's"
        else:
            continue
        if key in overridden:
            kept.append(key)
            continue
        entry = serving.get(key)
        derived = entry.get("value") if isinstance(entry, dict) else entry
        if derived == value or (derived is None and value == 1):
            continue
        serving[key] = {"value": value, "reason": reason, "derived": derived}
        applied.append(key)
    if applied and isinstance(serving.get("sglang_args"), dict):
        args = _rewrite_args(
            serving["sglang_args"].get("value") or [], {k: serving[k]["value"] for k in applied}
        )
        serving["sglang_args"] = {
            "value": args,
            "reason": "the values above as SGLang flags (after the sweep)",
        }
    note = (
        f"{why}: {rec['layout']} ({rec['reason']})"
        + (f"; applied to {', '.join(applied)}" if applied else "; the plan's values already match")
        + (f"; kept the inventory's {', '.join(kept)}" if kept else "")
    )
    serving["sweep"] = {
        "value": {
            "layout": rec["layout"],
            "settings": settings,
            "concurrency": rec["concurrency"],
            "output_tokens_per_s": rec["output_tokens_per_s"],
            "applied": applied,
            "inputs_digest": report.get("inputs_digest"),
        },
        "reason": note,
    }
    return plan


def _rewrite_args(args, values):
    """SGLang flags with these plan values replaced (a size of 1 drops its flag, as the plan writes it)."""
    out = list(args)
    for key, value in values.items():
        flag = _FLAGS[key]
        if flag in out:
            at = out.index(flag)
            del out[at : at + 2]
        if value is not None and not (key in PARALLEL_KEYS and key != "tp_size" and value == 1):
            out += [flag, str(value)]
    return out
