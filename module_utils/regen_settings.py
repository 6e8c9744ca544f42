"""The settings each stage reads from the plan: one table, one resolver.

Every row says, for one stage and one setting, where the value comes from in the plan (`plan`: paths in
the plan's values, the first present one wins), the role variable that overrides it (`variable`), and what
happens when neither gives one (`missing`: None fails naming the variable; a `Default` is a value
documented here with its reason). Roles never redo "override, else plan, else a number" in Jinja: each
makes one `stage_settings_info` call and reads `settings` (and `sources`: where each value came from and
why).

Adding a plan-backed setting is one row here plus one role variable (defaults, argument_specs, and the
role's `stage_settings_info` call passes it); docs/settings.md walks through it and
tests/unit/test_settings.py keeps that recipe honest.
"""

from __future__ import annotations

from collections import namedtuple

from .regen_disagg import CAPTURE_CONTEXT_HEADROOM, capture_context_length
from .regen_plan import nested, plan_entry, plan_values, unknown_entries

# A documented value for a setting that neither the variable nor the plan gives.
Default = namedtuple("Default", ["value", "reason"])

# kind: how a value is checked (and a string from `-e name=64` read): a positive int, a mapping, or an int
# that may be null (null: the job does without).
Setting = namedtuple(
    "Setting", ["stage", "name", "variable", "plan", "kind", "doc", "missing", "derive", "note"]
)


class SettingsError(Exception):
    """A setting has no value (no variable, no plan entry, no default), or the call is malformed."""


def _prompt_tokens(budget, inputs):
    """Prompt tokens the evaluation keeps: what the length budget leaves after the new tokens (at least 1)."""
    return max(int(budget) - int(inputs["max_new_tokens"]), 1)


def _note_max_tokens(value, plan, _inputs):
    length = plan.get("length") or {}
    return (
        f"completions_max_tokens={value} overrides the plan's length budget (max_tokens "
        f"{length.get('max_tokens')} of a budget of {length.get('budget')} tokens; set regen_length_budget "
        "to change them together)"
    )


def _note_concurrency(value, plan, _inputs):
    planned = nested(plan, "generation", "concurrency")
    return (
        f"completions_concurrency={value} overrides the plan's {planned} requests in flight (sized to its "
        "KV pool)"
    )


def _note_tokenize_length(value, plan, inputs):
    cut = "truncated" if inputs.get("truncation") == "truncate" else "dropped"
    return (
        f"tokenized_data_max_length (regen_max_length) = {value} overrides the plan's length budget of "
        f"{nested(plan, 'length', 'budget')} tokens: samples longer than {value} are {cut}; set "
        "regen_length_budget instead to change every stage together"
    )


def _note_training_length(value, plan, _inputs):
    return (
        f"drafter_training_max_length={value} overrides the plan's length budget of "
        f"{nested(plan, 'length', 'budget')} tokens for capture and training (samples longer are cut); set "
        "regen_length_budget instead to change every stage together"
    )


def _row(stage, name, variable, plan, kind, doc, missing=None, derive=None, note=None):
    return Setting(stage, name, variable, tuple(plan), kind, doc, missing, derive, note)


_KWARGS_DOC = (
    "chat_template_kwargs the chat template is rendered with (the plan's: the family's thinking switch)"
)

SETTINGS = (
    # generate (roles/completions)
    _row("generate", "max_tokens", "completions_max_tokens", ["length.max_tokens"], "int",
         "max_tokens of each assistant turn: the plan's length budget", note=_note_max_tokens),
    _row("generate", "concurrency", "completions_concurrency",
         ["serving.sweep.concurrency", "generation.concurrency"], "int",
         "requests in flight per endpoint: the layout sweep's measured best, else the plan's KV-pool "
         "arithmetic", note=_note_concurrency),
    _row("generate", "chat_template_kwargs", "completions_chat_template_kwargs",
         ["generation.chat_template_kwargs"], "mapping", _KWARGS_DOC),
    # tokenize (roles/tokenized_data)
    _row("tokenize", "max_length", "tokenized_data_max_length", ["length.budget"], "int",
         "tokens per sample: the plan's length budget", note=_note_tokenize_length),
    _row("tokenize", "mask_token_id", "tokenized_data_mask_token_id", ["drafter.mask_token_id"],
         "optional_int",
         "the drafter's mask token, checked to occur in no sample",
         missing=Default(None, "no facts name a mask token: the tokenize job checks none")),
    _row("tokenize", "chat_template_kwargs", "tokenized_data_chat_template_kwargs",
         ["generation.chat_template_kwargs"], "mapping", _KWARGS_DOC),
    # train (roles/drafter_training)
    _row("train", "max_length", "drafter_training_max_length", ["length.budget"], "int",
         "capture and training max_length: the plan's length budget", note=_note_training_length),
    # capture (roles/capture_server)
    _row("capture", "max_length", "capture_server_max_length", ["length.budget"], "int",
         "tokens per captured sample: the plan's length budget (the train stage passes its own)"),
    # evaluate (roles/drafter_evaluation)
    _row("evaluate", "prompt_max_tokens", "drafter_evaluation_prompt_max_tokens", ["length.budget"], "int",
         "prompt tokens kept: the plan's length budget less drafter_evaluation_max_new_tokens",
         derive=_prompt_tokens),
    _row("evaluate", "chat_template_kwargs", "drafter_evaluation_chat_template_kwargs",
         ["generation.chat_template_kwargs"], "mapping", _KWARGS_DOC),
)

# What a row's `derive` needs from the call (`inputs`), by stage.
INPUTS = {"evaluate": ("max_new_tokens",), "tokenize": ("truncation",)}

# Values computed from a stage's resolved settings (never overridden themselves): name -> (function, reason).
DERIVED = {
    "capture": {
        "context_length": (
            lambda settings: capture_context_length(settings["max_length"]),
            f"max_length + CAPTURE_CONTEXT_HEADROOM ({CAPTURE_CONTEXT_HEADROOM}): SGLang rejects a prompt of "
            "context_length - 6 tokens or more (SpecForge's SGLANG_CAPTURE_CONTEXT_HEADROOM)",
        ),
    },
}

STAGES = tuple(dict.fromkeys(row.stage for row in SETTINGS))


def rows(stage):
    """The table's rows of one stage."""
    return [row for row in SETTINGS if row.stage == stage]


def _checked(row, value, origin):
    """`value` as the row's kind; a string such as `-e regen_max_length=64` gives is read as a number."""
    if row.kind in ("int", "optional_int"):
        if value is None and row.kind == "optional_int":
            return None
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        least = 0 if row.kind == "optional_int" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise SettingsError(f"{row.variable}: {origin} gives {value!r}, not a positive number of tokens")
        return value
    if value is None:  # a plan entry that is present and null: the plan decided to send none
        return {}
    if not isinstance(value, dict):
        raise SettingsError(f"{row.variable}: {origin} gives {value!r}, not a mapping")
    return value


def _from_plan(row, plan):
    """(path, value, reason) of the first of the row's plan paths that the plan holds, else None."""
    values = plan_values(plan)
    for path in row.plan:
        section, key, *rest = path.split(".")
        present, value, reason = plan_entry(plan.get(section) if isinstance(plan, dict) else None, key)
        if present and rest:
            value = nested(values, section, key, *rest)
            present = value is not None
        if present:
            return path, value, reason
    return None


def resolve(stage, plan, overrides, inputs=None, partial=False):
    """Each setting of `stage`: {name: {value, source, variable, plan_path, reason}}, plus notes.

    plan: the facts' `plan` (entries {value, reason}); overrides: {variable: value or None} for every row
    of the stage (a missing key is an error: the role's call must pass each); inputs: what `derive`
    needs. A setting without a value raises SettingsError naming every such variable, or with partial
    (check mode before the plan exists) is returned as null with the failure as its reason.

    Returns (resolved, notes, unresolved): notes say where an override differs from the plan.
    """
    if stage not in STAGES:
        raise SettingsError(f"unknown stage {stage!r}: one of {', '.join(STAGES)}")
    plan = plan if isinstance(plan, dict) else {}
    overrides = dict(overrides or {})
    inputs = dict(inputs or {})
    table = rows(stage)
    expected = {row.variable for row in table}
    absent = sorted(expected - set(overrides))
    extra = sorted(set(overrides) - expected)
    if absent or extra:
        raise SettingsError(
            f"stage {stage}: the call must pass exactly its override variables {sorted(expected)}"
            + (f"; missing {absent}" if absent else "") + (f"; not in the table {extra}" if extra else "")
        )
    lacking = [name for name in INPUTS.get(stage, ()) if inputs.get(name) is None]
    if lacking:
        raise SettingsError(f"stage {stage}: inputs {lacking} are needed")
    unknown = unknown_entries(plan)
    values = plan_values(plan)
    resolved, notes, unresolved = {}, [], []
    for row in table:
        given = overrides[row.variable]
        found = _from_plan(row, plan)
        entry = {"variable": row.variable, "plan_path": found[0] if found else row.plan[0]}
        if given is not None:
            value = _checked(row, given, "the variable")
            entry.update(value=value, source="override", reason=f"set by {row.variable}")
            if row.note is not None and found is not None and found[1] is not None and value != _checked(
                row, found[1], "the plan"
            ):
                notes.append(row.note(value, values, inputs))
        elif (found is not None and found[0] not in unknown
              and (found[1] is not None or row.kind == "mapping")):
            value = _checked(row, found[1], f"the plan's {found[0]}")
            reason = found[2] or f"the plan's {found[0]}"
            if row.derive is not None:
                value = row.derive(value, inputs)
                reason = f"{row.doc} ({found[0]}: {found[1]}; {reason})"
            entry.update(value=value, source="plan", reason=reason)
        elif row.missing is not None and not any(path in unknown for path in row.plan):
            entry.update(value=row.missing.value, source="default", reason=row.missing.reason)
        else:
            gap = next((unknown[path] for path in row.plan if path in unknown), None)
            why = (
                f"the plan's {row.plan[0]} is unknown ({gap.get('reason')}): {gap.get('remedy')}; "
                f"or set {row.variable}"
                if gap else
                f"{row.variable} is not set and the plan has no {' or '.join(row.plan)} (run the introspect "
                f"stage first, or set {row.variable})"
            )
            entry.update(value=None, source="unresolved", reason=why)
            unresolved.append(f"{row.name}: {why}")
        resolved[row.name] = entry
    if unresolved and not partial:
        raise SettingsError(f"stage {stage}: " + "; ".join(unresolved))
    for name, (function, reason) in DERIVED.get(stage, {}).items():
        settings = {key: item["value"] for key, item in resolved.items()}
        value = None if any(v is None for v in settings.values()) else function(settings)
        resolved[name] = {"value": value, "source": "derived", "variable": None, "plan_path": None,
                          "reason": reason}
    return resolved, notes, unresolved
