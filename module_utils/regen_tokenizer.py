"""Tokenizer facts: the real loader first, the raw files when it cannot load.

Runs on the target host in the inspected venv's interpreter. The standard library is enough for the
raw-files path; `transformers` (and whatever the tokenizer's remote code imports, e.g. `tiktoken`) is
used when importable, and when it is not the facts record exactly why and what to install where.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import importlib
import importlib.util
import io
import json
import os
import re
import shutil
import sys
import tempfile

from .regen_families import THINKING_SWITCHES, text_config

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
VOCAB_FILES = (
    "tiktoken.model",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
    "vocab.txt",
)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
NAMED_TOKENS = ("bos", "eos", "pad", "unk", "mask")

# What a special token is for, recognized by its text across the families regen knows.
ROLE_PATTERNS = (
    (
        "end_of_turn",
        re.compile(
            r"im_end|eot_id|\[EOT\]|end_of_turn|^<\|end\|>$|^<\|return\|>$|end▁of▁sentence"
            r"|^<\|endoftext\|>$"
        ),
    ),
    (
        "role_marker",
        re.compile(
            r"im_user|im_assistant|im_system|im_start|im_middle|start_header_id|end_header_id"
            r"|^<\|(user|assistant|system|start|message|channel)\|>$|｜(User|Assistant)｜"  # noqa: RUF001
        ),
    ),
    ("think", re.compile(r"^</?think>$|◁/?think▷|^<\|/?thinking\|>$")),
    ("tool", re.compile(r"tool_call|tool▁call|tool_output|tool▁output|tool_response|<\|call\|>")),
    ("reserved", re.compile(r"reserved", re.IGNORECASE)),
)
MASK_NAMES = re.compile(r"^(<\|MASK\|>|\[MASK\]|<mask>|<\|mask\|>)$", re.IGNORECASE)

DEFAULT_SAMPLE_MESSAGES = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "The capital of Italy is Rome."},
]


class TokenizerError(Exception):
    """Stops fact gathering; the message names the file and the fix."""


# A config's vocab_size is often padded past the tokenizer's last id (to a multiple of 64/128/256 for the
# kernels, or with spare rows: DeepSeek-V3 leaves 465, Qwen3 267). A gap beyond this many ids (or 1% of the
# table, whichever is larger) is not padding: the tokenizer files most likely belong to another model.
VOCAB_PADDING_ALLOWANCE = 1024


def vocab_disagreement(total, config_vocab_size):
    """Pure: why the tokenizer's id count and config.json's vocab_size disagree beyond padding, or None.

    More tokenizer ids than embedding rows is always wrong (those ids have no embedding); fewer is padding
    up to VOCAB_PADDING_ALLOWANCE ids or 1% of the table.
    """
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (total, config_vocab_size)):
        return None
    if total > config_vocab_size:
        return (
            f"the tokenizer has {total} token ids but config.json's vocab_size is {config_vocab_size}: ids "
            f"{config_vocab_size}..{total - 1} have no row in the embedding table; check that the tokenizer "
            "files belong to this model"
        )
    allowance = max(VOCAB_PADDING_ALLOWANCE, config_vocab_size // 100)
    gap = config_vocab_size - total
    if gap > allowance:
        return (
            f"config.json's vocab_size {config_vocab_size} exceeds the tokenizer's {total} token ids by "
            f"{gap}, more than padding explains (up to {allowance}); check that the tokenizer files belong "
            "to this model"
        )
    return None


def unreadable_remedy(model_dir):
    """The one-line fix when no tokenizer facts can be read from `model_dir`."""
    return (
        "put the model's tokenizer files (tokenizer_config.json with tiktoken.model or tokenizer.json, and "
        f"chat_template.jinja where the model has one) into {model_dir}, or fix the file named in the "
        "reason, then re-run the introspect stage (ansible-playbook regen.yml --tags introspect)"
    )


def unknown_tokenizer_facts(model_dir, error, venv=None, config_vocab_size=None):
    """Pure: the tokenizer document when no tokenizer facts can be read (missing or unreadable files).

    Every value is unknown (null), never a guess: `available` is false and `unavailable` says why and how to
    fix it, so the plan marks what depends on the tokenizer as unknown instead of planning "none".
    """
    reason = str(error)
    remedy = unreadable_remedy(model_dir)
    return {
        "loaded_with": None,
        "available": False,
        "unavailable": {"reason": reason, "remedy": remedy},
        "tokenizer_class": None,
        "remote_code": [],
        "files": [],
        "vocab_kind": None,
        "vocab": {"base": None, "added": None, "total": None, "config_vocab_size": config_vocab_size,
                  "disagreement": None},
        "named": {},
        "tokens": [],
        "end_of_turn": [],
        "role_markers": [],
        "think_tokens": [],
        "tool_tokens": [],
        "reserved": {"count": None, "first_id": None, "last_id": None},
        "mask_token": {"token": None, "id": None, "needs_new_token": None, "reason": f"unknown: {reason}"},
        "chat_template": dict(analyze_chat_template(None, None), length=None, unknown=True),
        "model_max_length": None,
        "rendered_sample": None,
        "load": {
            "attempted": False,
            "ok": False,
            "error_type": type(error).__name__,
            "error": reason,
            "missing_modules": [],
            "remedy": remedy,
            "python": sys.executable,
            "venv": venv or sys.prefix,
        },
        "agreement": None,
        "warnings": [f"tokenizer facts unknown: {reason}; {remedy}"],
    }


# --------------------------------------------------------------------------------------------------
# Raw files
# --------------------------------------------------------------------------------------------------


def _read_json(path, what):
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as exc:
        raise TokenizerError(f"{path} cannot be read: {exc.strerror or exc}") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        where = ""
        if getattr(exc, "lineno", None):
            where = f" at line {exc.lineno} column {exc.colno}"
        raise TokenizerError(f"{path} is not valid JSON{where} ({exc}); fetch {what} again") from None


def _token_content(value):
    """tokenizer_config stores a token as a string or as an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def parse_tiktoken_ranks(path):
    """Validate a tiktoken BPE rank file ("<base64 token> <rank>" per line); return (count, max_rank)."""
    count = 0
    max_rank = -1
    seen = set()
    try:
        handle = open(path, "rb")  # noqa: SIM115 (closed by the with-block below; open errors handled here)
    except OSError as exc:
        raise TokenizerError(f"{path} cannot be read: {exc.strerror or exc}") from None
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            parts = line.split()
            problem = None
            if len(parts) != 2:
                problem = f"expected '<base64 token> <rank>', found {len(parts)} fields"
            else:
                try:
                    base64.b64decode(parts[0], validate=True)
                except (binascii.Error, ValueError):
                    problem = "the token is not valid base64"
                if problem is None and not parts[1].isdigit():
                    problem = "the rank {!r} is not a non-negative integer".format(
                        parts[1][:20].decode("latin-1")
                    )
            if problem:
                raise TokenizerError(
                    f"{path} is corrupt at line {number}: {problem}; "
                    "fetch tiktoken.model again from the model repository"
                )
            rank = int(parts[1])
            if rank in seen:
                raise TokenizerError(
                    f"{path} is corrupt at line {number}: rank {rank} appears twice; "
                    "fetch tiktoken.model again"
                )
            seen.add(rank)
            count += 1
            max_rank = max(max_rank, rank)
    if count == 0:
        raise TokenizerError(f"{path} is empty; fetch tiktoken.model again from the model repository")
    return count, max_rank


def _tokenizer_json_facts(path):
    data = _read_json(path, "tokenizer.json")
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: top level must be an object; fetch tokenizer.json again")
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    vocab = model.get("vocab")
    base_ids = {}
    if isinstance(vocab, dict):
        base_ids = {k: v for k, v in vocab.items() if isinstance(v, int)}
        base = (max(base_ids.values()) + 1) if base_ids else 0
    elif isinstance(vocab, list):
        base = len(vocab)
    else:
        base = 0
    added = {}
    for entry in data.get("added_tokens") or []:
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("id"), int)
            and isinstance(entry.get("content"), str)
        ):
            added[entry["id"]] = {"content": entry["content"], "special": bool(entry.get("special", False))}
    return base, added, base_ids, model.get("type")


def find_chat_template(model_dir, tokenizer_config):
    """(template text, source file) or (None, None)."""
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(), "chat_template.jinja"
    path = os.path.join(model_dir, "chat_template.json")
    if os.path.isfile(path):
        data = _read_json(path, "chat_template.json")
        if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
            return data["chat_template"], "chat_template.json"
    template = tokenizer_config.get("chat_template") if isinstance(tokenizer_config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next((v for v in named.values() if isinstance(v, str)), None)
    if isinstance(template, str):
        return template, TOKENIZER_CONFIG
    return None, None


def analyze_chat_template(text, source):
    """Pure: sha256, syntax check (with jinja2 when importable), variables and the thinking switch."""
    if text is None:
        return {
            "source": None,
            "sha256": None,
            "length": 0,
            "thinking_switch": None,
            "variables": [],
            "parse_error": None,
        }
    facts = {
        "source": source,
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "length": len(text),
        "thinking_switch": None,
        "variables": [],
        "parse_error": None,
    }
    variables = None
    try:
        import jinja2
        import jinja2.meta
    except ImportError:
        jinja2 = None
    if jinja2 is not None:
        try:
            ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
            variables = set(jinja2.meta.find_undeclared_variables(ast))
        except jinja2.TemplateSyntaxError as exc:
            facts["parse_error"] = f"{source} line {exc.lineno}: {exc.message}"
    if variables is None:
        # No parser (or a broken template): find identifiers inside {{ }} / {% %} blocks.
        variables = set()
        for block in re.findall(r"{[{%](.*?)[%}]}", text, flags=re.S):
            variables.update(re.findall(r"(?<![\w.'\"])([A-Za-z_]\w*)", block))
    facts["variables"] = sorted(
        v for v in variables if v not in ("true", "false", "none", "loop", "namespace")
    )
    # The registry's switches, in its order (the boolean ones before reasoning_effort).
    facts["thinking_switch"] = next((name for name in THINKING_SWITCHES if name in variables), None)
    return facts


def classify_token(content):
    return [role for role, pattern in ROLE_PATTERNS if pattern.search(content)]


def summarize_special_tokens(tokens):
    """tokens: {id: content} of special/added tokens -> the facts' special-token section."""
    listed = []
    reserved = []
    by_role = {"end_of_turn": [], "role_marker": [], "think": [], "tool": []}
    for token_id in sorted(tokens):
        content = tokens[token_id]
        roles = classify_token(content)
        if "reserved" in roles:
            reserved.append(token_id)
            continue
        listed.append({"id": token_id, "content": content, "roles": roles})
        for role in roles:
            if role in by_role:
                by_role[role].append({"id": token_id, "content": content})
    return {
        "tokens": listed,
        "end_of_turn": by_role["end_of_turn"],
        "role_markers": by_role["role_marker"],
        "think_tokens": by_role["think"],
        "tool_tokens": by_role["tool"],
        "reserved": {
            "count": len(reserved),
            "first_id": reserved[0] if reserved else None,
            "last_id": reserved[-1] if reserved else None,
        },
    }


def choose_mask_token(named, specials, reserved_ids, template_text, total, config_vocab_size):
    """Pure: a mask-token candidate for DFlash and the one-line reason."""
    mask = named.get("mask")
    if mask and mask.get("id") is not None:
        return {
            "token": mask["content"],
            "id": mask["id"],
            "needs_new_token": False,
            "reason": "the tokenizer defines mask_token {}".format(mask["content"]),
        }
    for token_id in sorted(specials):
        if MASK_NAMES.match(specials[token_id]):
            return {
                "token": specials[token_id],
                "id": token_id,
                "needs_new_token": False,
                "reason": f"special token {specials[token_id]} exists (id {token_id})",
            }
    template_text = template_text or ""
    for token_id in reserved_ids:
        content = specials[token_id]
        if content not in template_text:
            return {
                "token": content,
                "id": token_id,
                "needs_new_token": False,
                "reason": f"reserved special token {content} (id {token_id}) is never emitted "
                "by the chat template",
            }
    if config_vocab_size and total is not None and config_vocab_size > total:
        return {
            "token": None,
            "id": total,
            "needs_new_token": False,
            "reason": f"id {total} lies in the embedding table (vocab_size {config_vocab_size}) "
            "but no token maps to it",
        }
    return {
        "token": "<|MASK|>",
        "id": None,
        "needs_new_token": True,
        "reason": "no mask, reserved or unused id: add <|MASK|> as a special token and resize embeddings",
    }


def read_raw(model_dir, config_vocab_size=None):
    """Facts from the files alone (no tokenizer library)."""
    if not os.path.isdir(model_dir):
        raise TokenizerError(f"tokenizer directory {model_dir} does not exist; check the model path")
    present = [
        name
        for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, *VOCAB_FILES, *TEMPLATE_FILES)
        if os.path.isfile(os.path.join(model_dir, name))
    ]
    vocab_files = [name for name in VOCAB_FILES if name in present]
    if not vocab_files and TOKENIZER_CONFIG not in present:
        raise TokenizerError(
            "{} holds no tokenizer files (looked for {} and {}); download the tokenizer files with the "
            "model".format(model_dir, TOKENIZER_CONFIG, ", ".join(VOCAB_FILES))
        )
    warnings = []
    config = {}
    if TOKENIZER_CONFIG in present:
        config = _read_json(os.path.join(model_dir, TOKENIZER_CONFIG), TOKENIZER_CONFIG)
        if not isinstance(config, dict):
            raise TokenizerError(
                f"{os.path.join(model_dir, TOKENIZER_CONFIG)}: top level must be an object; fetch it again"
            )
    smap = {}
    if SPECIAL_TOKENS_MAP in present:
        loaded = _read_json(os.path.join(model_dir, SPECIAL_TOKENS_MAP), SPECIAL_TOKENS_MAP)
        smap = loaded if isinstance(loaded, dict) else {}
    base = None
    base_ids = {}
    added = {}
    vocab_kind = None
    if "tiktoken.model" in vocab_files:
        count, max_rank = parse_tiktoken_ranks(os.path.join(model_dir, "tiktoken.model"))
        base, vocab_kind = max_rank + 1, "tiktoken"
        if count != max_rank + 1:
            warnings.append(f"tiktoken.model ranks are not contiguous ({count} ranks, highest {max_rank})")
    elif "tokenizer.json" in vocab_files:
        base, added, base_ids, model_type = _tokenizer_json_facts(os.path.join(model_dir, "tokenizer.json"))
        vocab_kind = "tokenizer.json:%s" % (model_type or "unknown")
    elif vocab_files:
        vocab_kind = vocab_files[0]
        warnings.append(f"{vocab_files[0]} is not read by the raw-files path; base vocabulary size unknown")
    else:
        warnings.append(
            "no vocabulary file ({}); base vocabulary size unknown".format(", ".join(VOCAB_FILES))
        )
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for key, entry in decoder.items():
            content = _token_content(entry)
            if content is not None and str(key).isdigit():
                special = bool(entry.get("special", True)) if isinstance(entry, dict) else True
                added[int(key)] = {"content": content, "special": special}
    content_to_id = {v["content"]: k for k, v in added.items()}
    named = {}
    for name in NAMED_TOKENS:
        content = _token_content(smap.get(name + "_token")) or _token_content(config.get(name + "_token"))
        if content is None:
            continue
        token_id = content_to_id.get(content, base_ids.get(content))
        named[name] = {"content": content, "id": token_id}
        if token_id is None:
            warnings.append(f"{name}_token {content} has no id in the tokenizer files")
    extra = config.get("additional_special_tokens") or smap.get("additional_special_tokens") or []
    specials = {k: v["content"] for k, v in added.items() if v["special"]}
    for content in extra if isinstance(extra, list) else []:
        content = _token_content(content)
        if content in content_to_id:
            specials[content_to_id[content]] = content
    for entry in named.values():
        if entry["id"] is not None:
            specials.setdefault(entry["id"], entry["content"])
    all_ids = list(added) + ([base - 1] if base else [])
    total = (max(all_ids) + 1) if all_ids else None
    template_text, template_source = find_chat_template(model_dir, config)
    auto_map = config.get("auto_map") if isinstance(config.get("auto_map"), dict) else {}
    auto_tok = auto_map.get("AutoTokenizer")
    remote = [v for v in (auto_tok if isinstance(auto_tok, list) else [auto_tok]) if isinstance(v, str)]
    return {
        "tokenizer_class": config.get("tokenizer_class")
        if isinstance(config.get("tokenizer_class"), str)
        else (remote[0].split(".")[-1] if remote else None),
        "remote_code": remote,
        "files": present,
        "vocab_kind": vocab_kind,
        "vocab": {
            "base": base,
            "added": sum(1 for k in added if base is None or k >= base),
            "total": total,
            "config_vocab_size": config_vocab_size,
        },
        "named": named,
        "_specials": specials,
        "_template_text": template_text,
        "chat_template_source": template_source,
        "model_max_length": config.get("model_max_length")
        if isinstance(config.get("model_max_length"), int)
        else None,
        "warnings": warnings,
    }


# --------------------------------------------------------------------------------------------------
# The real loader
# --------------------------------------------------------------------------------------------------


def _remote_code_imports(model_dir, files):
    """Top-level imports of the tokenizer's remote-code files that this interpreter cannot find."""
    missing = []
    for ref in files:
        module_file = os.path.join(model_dir, ref.split(".")[0] + ".py")
        if not os.path.isfile(module_file):
            continue
        with open(module_file, encoding="utf-8", errors="replace") as handle:
            source = handle.read()
        for name in re.findall(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", source, flags=re.M):
            if name in missing or name in sys.builtin_module_names or name == "__future__":
                continue
            try:
                found = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):
                found = False
            if not found and not os.path.isfile(os.path.join(model_dir, name + ".py")):
                missing.append(name)
    return missing


def describe_load_error(exc, model_dir, remote_files, venv, remedy_variable):
    """Pure-ish: error_type, message, missing_modules and a one-line remedy for a failed load."""
    missing = []
    seen = set()
    current = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        name = getattr(current, "name", None)
        if isinstance(current, ModuleNotFoundError) and name:
            missing.append(name.split(".")[0])
        match = re.search(r"not found in your environment: ([\w\-., ]+?)\. Run", str(current))
        if match:
            missing.extend(p.strip() for p in match.group(1).split(",") if p.strip())
        current = current.__cause__ or current.__context__
    if not missing and isinstance(exc, ImportError):
        missing = _remote_code_imports(model_dir, remote_files)
    missing = list(dict.fromkeys(missing))
    message = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__
    if missing:
        names = ", ".join(missing)
        remedy = "{} {} not installed in {}; add {} to {}".format(
            names,
            "is" if len(missing) == 1 else "are",
            venv,
            "it" if len(missing) == 1 else "them",
            remedy_variable,
        )
    else:
        remedy = (
            f"AutoTokenizer.from_pretrained({model_dir}) failed with {type(exc).__name__}: {message}; "
            "check the tokenizer files"
        )
    return {"error_type": type(exc).__name__, "error": message, "missing_modules": missing, "remedy": remedy}


def load_with_library(model_dir, trust_remote_code, sample_messages, switch):
    """Load with AutoTokenizer; returns library facts (raises whatever the loader raises)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # Remote tokenizer code may print; a module's stdout must stay pure JSON.
    with contextlib.redirect_stdout(io.StringIO()):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        facts = {"tokenizer_class": type(tok).__name__, "named": {}, "_specials": {}}
        try:
            facts["total"] = len(tok)
        except Exception:  # some remote tokenizers do not implement __len__
            facts["total"] = None
        facts["base"] = getattr(tok, "vocab_size", None)
        for name in NAMED_TOKENS:
            content = getattr(tok, name + "_token", None)
            if isinstance(content, str):
                token_id = tok.convert_tokens_to_ids(content)
                facts["named"][name] = {
                    "content": content,
                    "id": token_id if isinstance(token_id, int) else None,
                }
        decoder = getattr(tok, "added_tokens_decoder", {}) or {}
        for token_id, token in decoder.items():
            if getattr(token, "special", True):
                facts["_specials"][int(token_id)] = str(token)
        for content in getattr(tok, "all_special_tokens", []) or []:
            token_id = tok.convert_tokens_to_ids(content)
            if isinstance(token_id, int):
                facts["_specials"].setdefault(token_id, content)
        template = getattr(tok, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        facts["_template_text"] = template if isinstance(template, str) else None
        facts["rendered_sample"] = None
        if facts["_template_text"] and sample_messages:
            # Rendered with thinking on when a boolean switch turns it on (not with an effort level).
            kwargs = {switch: True} if THINKING_SWITCHES.get(switch) is True else {}
            text = tok.apply_chat_template(sample_messages, tokenize=False, **kwargs)
            ids = tok.apply_chat_template(sample_messages, tokenize=True, **kwargs)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            facts["rendered_sample"] = {
                "text": text,
                "token_count": len(ids),
                "template_kwargs": kwargs,
                "messages": len(sample_messages),
            }
    return facts


# --------------------------------------------------------------------------------------------------
# Putting it together
# --------------------------------------------------------------------------------------------------


def _config_vocab_size(model_dir):
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    value = text_config(config).get("vocab_size", config.get("vocab_size"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _finish(base_facts, specials, template_text, total, config_vocab_size):
    summary = summarize_special_tokens(specials)
    reserved_ids = [i for i in sorted(specials) if "reserved" in classify_token(specials[i])]
    base_facts.update(summary)
    base_facts["mask_token"] = choose_mask_token(
        base_facts["named"], specials, reserved_ids, template_text, total, config_vocab_size
    )
    return base_facts


def compare_paths(library, raw):
    """Fields both paths can see, and where they disagree (empty list = agreement)."""
    disagreements = []
    checks = [
        ("vocab.total", library["vocab"]["total"], raw["vocab"]["total"]),
        ("chat_template.sha256", library["chat_template"]["sha256"], raw["chat_template"]["sha256"]),
        (
            "chat_template.thinking_switch",
            library["chat_template"]["thinking_switch"],
            raw["chat_template"]["thinking_switch"],
        ),
        ("mask_token.id", library["mask_token"]["id"], raw["mask_token"]["id"]),
    ]
    for name in NAMED_TOKENS:
        lib = library["named"].get(name, {}).get("id")
        raw_id = raw["named"].get(name, {}).get("id")
        if lib is not None or raw_id is not None:
            checks.append((f"named.{name}.id", lib, raw_id))
    lib_ids = {t["id"]: t["content"] for t in library["tokens"]}
    raw_ids = {t["id"]: t["content"] for t in raw["tokens"]}
    checks.append(("special token ids", sorted(lib_ids), sorted(raw_ids)))
    for field, lib, raw_value in checks:
        if lib is None or raw_value is None:
            continue
        if lib != raw_value:
            disagreements.append({"field": field, "library": lib, "raw_files": raw_value})
    return disagreements


def gather(
    model_dir,
    mode="auto",
    trust_remote_code=True,
    remedy_variable="regen_serving_packages",
    sample_messages=None,
    venv=None,
    unreadable="raise",
):
    """The tokenizer facts document.

    When the tokenizer files are missing or unreadable, raises TokenizerError (`unreadable="raise"`, and
    always in `library` mode) or returns `unknown_tokenizer_facts` (`unreadable="unknown"`), so the facts of
    a config-only model directory are still written.
    """
    venv = venv or sys.prefix
    sample_messages = DEFAULT_SAMPLE_MESSAGES if sample_messages is None else sample_messages
    config_vocab_size = _config_vocab_size(model_dir)
    try:
        doc = _gather(model_dir, mode, trust_remote_code, remedy_variable, sample_messages, venv,
                      config_vocab_size)
    except TokenizerError as exc:
        if unreadable != "unknown" or mode == "library":
            raise
        return unknown_tokenizer_facts(model_dir, exc, venv, config_vocab_size)
    # Only a vocabulary read from a vocabulary file (or the library) counts: added tokens alone are a floor.
    counted = doc["loaded_with"] == "library" or doc["vocab"]["base"] is not None
    disagreement = vocab_disagreement(doc["vocab"]["total"], config_vocab_size) if counted else None
    doc["vocab"]["disagreement"] = disagreement
    if disagreement:
        doc["warnings"].append(f"vocabulary: {disagreement}")
    return doc


def _gather(model_dir, mode, trust_remote_code, remedy_variable, sample_messages, venv, config_vocab_size):
    raw = read_raw(model_dir, config_vocab_size)
    raw_template = analyze_chat_template(raw["_template_text"], raw["chat_template_source"])
    raw_doc = {
        "loaded_with": "raw_files",
        "available": True,
        "tokenizer_class": raw["tokenizer_class"],
        "remote_code": raw["remote_code"],
        "files": raw["files"],
        "vocab_kind": raw["vocab_kind"],
        "vocab": raw["vocab"],
        "named": raw["named"],
        "chat_template": raw_template,
        "model_max_length": raw["model_max_length"],
        "rendered_sample": None,
        "load": {
            "attempted": False,
            "ok": False,
            "error_type": None,
            "error": None,
            "missing_modules": [],
            "remedy": None,
            "python": sys.executable,
            "venv": venv,
        },
        "agreement": None,
        "warnings": list(raw["warnings"]),
    }
    _finish(raw_doc, raw["_specials"], raw["_template_text"], raw["vocab"]["total"], config_vocab_size)
    if raw_template["parse_error"]:
        raw_doc["warnings"].append("chat template does not parse: {}".format(raw_template["parse_error"]))
    if mode == "raw_files":
        return raw_doc
    raw_doc["load"]["attempted"] = True
    # Remote tokenizer code is copied into HF_MODULES_CACHE; a private temporary one leaves no trace on the
    # host (check mode included) and never serves stale code from an earlier model.
    cache = None
    if "transformers" not in sys.modules and "HF_MODULES_CACHE" not in os.environ:
        cache = tempfile.mkdtemp(prefix="regen-hf-modules-")
        os.environ["HF_MODULES_CACHE"] = cache
    try:
        lib = load_with_library(
            model_dir, trust_remote_code, sample_messages, raw_template["thinking_switch"]
        )
    except Exception as exc:  # the loader's failure is data here: it becomes load.error_* facts
        raw_doc["load"].update(describe_load_error(exc, model_dir, raw["remote_code"], venv, remedy_variable))
        if mode == "library":
            raise TokenizerError(
                "AutoTokenizer could not load {}: {}".format(model_dir, raw_doc["load"]["remedy"])
            ) from None
        raw_doc["warnings"].append(
            "tokenizer library failed ({}); facts read from the raw files".format(raw_doc["load"]["remedy"])
        )
        return raw_doc
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    template = analyze_chat_template(lib["_template_text"], raw["chat_template_source"] or "tokenizer")
    doc = dict(raw_doc)
    doc.update(
        {
            "loaded_with": "library",
            "tokenizer_class": lib["tokenizer_class"],
            # `base` stays the rank/model-vocab count of the files: tokenizer classes disagree on what their
            # own vocab_size means (Kimi's counts the reserved specials), so it is reported separately.
            "vocab": {
                "base": raw["vocab"]["base"],
                "added": raw["vocab"]["added"],
                "total": lib["total"],
                "config_vocab_size": config_vocab_size,
                "library_vocab_size": lib["base"] if isinstance(lib["base"], int) else None,
            },
            "named": lib["named"],
            "chat_template": template,
            "rendered_sample": lib["rendered_sample"],
            "warnings": list(raw["warnings"]),
        }
    )
    doc["load"] = dict(raw_doc["load"], ok=True)
    _finish(doc, lib["_specials"], lib["_template_text"], lib["total"], config_vocab_size)
    if template["parse_error"]:
        doc["warnings"].append("chat template does not parse: {}".format(template["parse_error"]))
    doc["agreement"] = compare_paths(doc, raw_doc)
    for item in doc["agreement"]:
        doc["warnings"].append(
            "library and raw files disagree on {}: {!r} vs {!r}".format(
                item["field"], item["library"], item["raw_files"]
            )
        )
    return doc
