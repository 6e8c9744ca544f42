"""tokenizer_info: the demo model on both paths (and their agreement), real configs, broken inputs."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "configs"

from ansible.module_utils import regen_tokenizer
from ansible.module_utils.regen_tokenizer import (
    TokenizerError,
    analyze_chat_template,
    describe_load_error,
    gather,
)

from tests.helpers.modules import run_module


@pytest.fixture(scope="module")
def demo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return request.getfixturevalue("demo_model_dir")
    except pytest.FixtureLookupError:
        from regen.demo.build import build

        out = tmp_path_factory.mktemp("demo") / "regen-demo-kimi"
        build(out)
        return out


@pytest.fixture(scope="module")
def raw_facts(demo: Path) -> dict:
    return gather(str(demo), mode="raw_files")


@pytest.fixture(scope="module")
def library_facts(demo: Path) -> dict:
    return gather(str(demo), mode="auto")


def _comparable(facts: dict) -> dict:
    return {
        "total": facts["vocab"]["total"],
        "named": facts["named"],
        "tokens": facts["tokens"],
        "end_of_turn": facts["end_of_turn"],
        "role_markers": facts["role_markers"],
        "think_tokens": facts["think_tokens"],
        "reserved": facts["reserved"],
        "mask_token": facts["mask_token"],
        "chat_template": facts["chat_template"],
    }


def test_raw_files_match_the_files(demo: Path, raw_facts: dict) -> None:
    ranks = [line for line in (demo / "tiktoken.model").read_bytes().splitlines() if line.strip()]
    config = json.loads((demo / "config.json").read_text())
    tok_config = json.loads((demo / "tokenizer_config.json").read_text())
    decoder = {int(k): v["content"] for k, v in tok_config["added_tokens_decoder"].items()}
    assert raw_facts["loaded_with"] == "raw_files" and raw_facts["load"]["attempted"] is False
    assert raw_facts["vocab"]["base"] == len(ranks)
    assert raw_facts["vocab"]["total"] == len(ranks) + len(decoder) == config["text_config"]["vocab_size"]
    for name in ("bos", "eos", "pad", "unk"):
        entry = raw_facts["named"][name]
        assert decoder[entry["id"]] == entry["content"] == tok_config[name + "_token"]
    template = (demo / "chat_template.jinja").read_text()
    assert raw_facts["chat_template"]["source"] == "chat_template.jinja"
    assert raw_facts["chat_template"]["sha256"] == hashlib.sha256(template.encode()).hexdigest()
    assert raw_facts["chat_template"]["thinking_switch"] == "thinking"
    assert {t["content"] for t in raw_facts["think_tokens"]} == {"<think>", "</think>"}
    assert "<|im_end|>" in {t["content"] for t in raw_facts["end_of_turn"]}
    assert "<|im_assistant|>" in {t["content"] for t in raw_facts["role_markers"]}
    mask = raw_facts["mask_token"]
    assert mask["needs_new_token"] is False and decoder[mask["id"]] == mask["token"]
    assert "reserved" in mask["token"] and mask["token"] not in template
    assert raw_facts["reserved"]["count"] == sum("reserved" in c for c in decoder.values())


def test_library_loads_and_agrees_with_raw_files(library_facts: dict, raw_facts: dict) -> None:
    assert library_facts["loaded_with"] == "library" and library_facts["load"]["ok"] is True
    assert library_facts["tokenizer_class"] == "TikTokenTokenizer"
    assert library_facts["agreement"] == []
    assert _comparable(library_facts) == _comparable(raw_facts)
    sample = library_facts["rendered_sample"]
    assert sample["template_kwargs"] == {"thinking": True} and sample["messages"] == 4
    for message in regen_tokenizer.DEFAULT_SAMPLE_MESSAGES:
        assert message["content"] in sample["text"]
    assert sample["text"].count("<|im_end|>") == 4 and sample["token_count"] > 20


def test_fallback_in_a_venv_without_tiktoken(
    demo: Path, raw_facts: dict, python_without_tiktoken: Path
) -> None:
    code = (
        "import json, sys, ansible.module_utils as mu; mu.__path__.append(sys.argv[1]); "
        "from ansible.module_utils import regen_tokenizer as t; "
        "print(json.dumps(t.gather(sys.argv[2])))"
    )
    result = subprocess.run(
        [str(python_without_tiktoken), "-c", code, str(ROOT / "module_utils"), str(demo)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    facts = json.loads(result.stdout)
    venv = str(python_without_tiktoken.parent.parent)
    assert facts["loaded_with"] == "raw_files"
    assert facts["load"]["attempted"] is True and facts["load"]["ok"] is False
    assert facts["load"]["missing_modules"] == ["tiktoken"]
    assert facts["load"]["remedy"] == f"tiktoken is not installed in {venv}; add it to regen_serving_packages"
    assert facts["load"]["error_type"] in ("ImportError", "ModuleNotFoundError")
    assert _comparable(facts) == _comparable(raw_facts)


def test_gpt_oss_real_tokenizer_config() -> None:
    facts = gather(str(FIXTURES / "gpt-oss-120b"), mode="raw_files")
    assert facts["named"]["eos"] == {"content": "<|return|>", "id": 200002}
    assert {t["content"] for t in facts["end_of_turn"]} >= {"<|return|>", "<|end|>"}
    assert facts["mask_token"]["id"] == 200000 and facts["mask_token"]["token"] == "<|reserved_200000|>"
    assert facts["vocab"]["config_vocab_size"] == 201088


def test_deepseek_template_has_no_switch() -> None:
    facts = gather(str(FIXTURES / "deepseek-v3"), mode="raw_files")
    template = facts["chat_template"]
    assert (template["source"], template["thinking_switch"], template["parse_error"]) == (
        "tokenizer_config.json",
        None,
        None,
    )
    assert "messages" in template["variables"]
    assert any("no vocabulary file" in w for w in facts["warnings"])


@pytest.mark.parametrize(
    ("snippet", "switch"),
    [
        (
            "{%- if enable_thinking is defined and enable_thinking is false %}<think></think>{%- endif %}",
            "enable_thinking",
        ),
        ("{% if thinking %}<think>{% else %}<think></think>{% endif %}", "thinking"),
        (
            "{{ messages[0].content }}{% set reasoning = reasoning_effort | default('medium') %}",
            "reasoning_effort",
        ),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ],
)
def test_thinking_switch_detection(snippet: str, switch: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert analyze_chat_template(snippet, "t")["thinking_switch"] == switch
    monkeypatch.setitem(sys.modules, "jinja2", None)  # the target venv may lack jinja2: regex fallback
    assert analyze_chat_template(snippet, "t")["thinking_switch"] == switch


def test_describe_load_error_from_transformers_message() -> None:
    exc = ImportError(
        "This modeling file requires the following packages that were not found in your environment: "
        "tiktoken. Run `pip install tiktoken`"
    )
    described = describe_load_error(exc, "/m", [], "/root/venv_sglang", "regen_serving_packages")
    assert described["missing_modules"] == ["tiktoken"]
    assert (
        described["remedy"]
        == "tiktoken is not installed in /root/venv_sglang; add it to regen_serving_packages"
    )


def test_describe_other_load_error() -> None:
    described = describe_load_error(ValueError("bad merges"), "/m", [], "/v", "x")
    assert described["missing_modules"] == [] and "ValueError: bad merges" in described["remedy"]


# --- broken inputs ------------------------------------------------------------------------------------


def _copy(demo: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(demo, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    return dest


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        gather(str(tmp_path / "nope"), mode="raw_files")


def test_no_tokenizer_files(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "qwen3-8b" / "config.json", tmp_path / "config.json")
    with pytest.raises(TokenizerError, match=r"holds no tokenizer files .*tokenizer_config.json"):
        gather(str(tmp_path))


def test_corrupt_tiktoken_model_names_file_and_line(demo: Path, tmp_path: Path) -> None:
    model = _copy(demo, tmp_path)
    lines = (model / "tiktoken.model").read_bytes().splitlines(keepends=True)
    lines[9] = b"%%%not-base64 9\n"
    (model / "tiktoken.model").write_bytes(b"".join(lines))
    with pytest.raises(TokenizerError) as err:
        gather(str(model))  # auto: the library fails on it too, then the raw path names the problem
    assert f"{model / 'tiktoken.model'} is corrupt at line 10" in str(err.value)
    assert "fetch tiktoken.model again" in str(err.value)


def test_truncated_tokenizer_config(demo: Path, tmp_path: Path) -> None:
    model = _copy(demo, tmp_path)
    text = (model / "tokenizer_config.json").read_text()
    (model / "tokenizer_config.json").write_text(text[:200])
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json is not valid JSON at line \d+"):
        gather(str(model), mode="raw_files")


def test_chat_template_that_does_not_parse_is_a_warning(demo: Path, tmp_path: Path) -> None:
    model = _copy(demo, tmp_path)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}\n{% if %}")
    facts = gather(str(model), mode="raw_files")
    assert facts["chat_template"]["parse_error"].startswith("chat_template.jinja line 2")
    assert any("chat template does not parse" in w for w in facts["warnings"])
    assert facts["named"]["eos"]["id"] is not None  # the other facts are still there


def test_module_fail_json_for_no_tokenizer_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = {"path": str(tmp_path), "mode": "raw_files", "require_files": True}
    result = run_module("tokenizer_info", args, capsys)
    assert result["failed"] is True and "holds no tokenizer files" in result["msg"]


def test_module_without_tokenizer_files_returns_unknown_facts_with_the_remedy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copy(FIXTURES / "kimi-k2.5" / "config.json", tmp_path / "config.json")
    result = run_module("tokenizer_info", {"path": str(tmp_path)}, capsys)
    assert not result.get("failed"), result
    facts = result["tokenizer"]
    assert facts["available"] is False and facts["loaded_with"] is None
    assert "holds no tokenizer files" in facts["unavailable"]["reason"]
    assert f"into {tmp_path}" in facts["unavailable"]["remedy"]
    # Nothing is guessed: every tokenizer-dependent value is unknown, not "none".
    assert facts["mask_token"]["id"] is None and facts["mask_token"]["reason"].startswith("unknown: ")
    assert facts["chat_template"]["thinking_switch"] is None and facts["chat_template"]["unknown"] is True
    assert facts["vocab"]["config_vocab_size"] == 163840 and facts["vocab"]["total"] is None
    assert any("tokenizer facts unknown" in w for w in facts["warnings"])


def test_library_mode_still_fails_without_tokenizer_files(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "qwen3-8b" / "config.json", tmp_path / "config.json")
    with pytest.raises(TokenizerError, match="holds no tokenizer files"):
        gather(str(tmp_path), mode="library", unreadable="unknown")


def test_a_corrupt_tokenizer_is_unknown_with_the_file_named(demo: Path, tmp_path: Path) -> None:
    model = _copy(demo, tmp_path)
    (model / "tokenizer_config.json").write_text("{")
    facts = gather(str(model), mode="auto", unreadable="unknown")
    assert facts["available"] is False
    assert "tokenizer_config.json is not valid JSON" in facts["unavailable"]["reason"]


@pytest.mark.parametrize(
    ("total", "config_vocab_size", "problem"),
    [
        (163840, 163840, None),  # Kimi: 163,584 ranks + 256 reserved specials fill the table exactly
        (151669, 151936, None),  # Qwen3: padded to a multiple of 128
        (128815, 129280, None),  # DeepSeek-V3: 465 spare rows
        (163840, 129280, "have no row in the embedding table"),  # a Kimi tokenizer with a DeepSeek config
        (128256, 151936, "more than padding explains"),  # a Llama 3 tokenizer with a Qwen config
    ],
)
def test_vocabulary_disagreement_beyond_padding(
    total: int, config_vocab_size: int, problem: str | None
) -> None:
    found = regen_tokenizer.vocab_disagreement(total, config_vocab_size)
    assert (found is None) if problem is None else (problem in found)


def test_a_tokenizer_of_another_model_is_a_warning_in_the_facts(demo: Path, tmp_path: Path) -> None:
    model = _copy(demo, tmp_path)
    config = json.loads((model / "config.json").read_text())
    real = config["text_config"]["vocab_size"]
    config["text_config"]["vocab_size"] = real - 8  # the tokenizer now has ids past the embedding table
    (model / "config.json").write_text(json.dumps(config))
    facts = gather(str(model), mode="raw_files")
    assert "no row in the embedding table" in (facts["vocab"]["disagreement"] or "")
    assert any(w.startswith("vocabulary: ") for w in facts["warnings"])
    clean = gather(str(_copy(demo, tmp_path / "clean")), mode="raw_files")
    assert clean["vocab"]["disagreement"] is None
