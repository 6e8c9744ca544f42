"""regen.tokenization.loader: the tokenizer digest covers what renders a sample (the chat template too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from regen.errors import JobError
from regen.tokenization.loader import check_tokenizer_dir, tokenizer_digest


def test_a_chat_template_edit_changes_the_tokenizer_digest(tmp_path: Path) -> None:
    # Before the loader had a module of its own, a second TOKENIZER_FILES in the tokenize job shadowed the
    # digest's list, and the digest left out chat_template.jinja and tokenizer_config.json.
    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    before = tokenizer_digest(tmp_path)
    assert tokenizer_digest(tmp_path) == before
    (tmp_path / "chat_template.jinja").write_text("<|user|>{{ messages[0].content }}")
    edited = tokenizer_digest(tmp_path)
    assert edited != before
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<bos>"}')
    assert tokenizer_digest(tmp_path) != edited


def test_a_directory_without_tokenizer_files_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(JobError, match="holds no tokenizer files"):
        check_tokenizer_dir(str(tmp_path))
    with pytest.raises(JobError, match="no such directory"):
        check_tokenizer_dir(str(tmp_path / "missing"))
