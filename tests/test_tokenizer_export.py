"""`kvgate tokenizer --out DIR` (kvgate/tokenizer_export.py): transformers' `AutoTokenizer` loads the
directory offline and encodes and templates as kvgate does, for the default model (a GGUF, whose
tokenizer kvgate builds from the file's vocabulary) and the tiny test model (an HF directory)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvgate.models import load_model
from kvgate.tokenizer import TextTokenizer

TEXTS = ["Hello world", "  two  spaces\nand a newline", "naïve café: 12,345.67 ü€😀", "<|im_end|> literal"]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
]


@pytest.mark.parametrize("model", ["default", "tiny"])
def test_the_exported_directory_encodes_and_templates_as_kvgate(model, tiny_dir, tmp_path):
    """Red with the chat template left out of tokenizer_config.json (transformers: no template), and
    with the special tokens' texts looked up in the model vocabulary alone (bos/eos None)."""
    transformers = pytest.importorskip("transformers")
    from kvgate.tokenizer_export import export_tokenizer

    name = str(tiny_dir) if model == "tiny" else "default"
    written = export_tokenizer(name, str(tmp_path / "tok"))
    assert {p.name for p in written} >= {"tokenizer.json", "tokenizer_config.json"}
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    ours = TextTokenizer(load_model(name).tokenizer)
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text), text
    for chat in CHATS:
        theirs = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert theirs == ours.render_chat(chat, add_generation_prompt=True)
    info = ours.info
    assert hf.eos_token == ours.token_text(info.eos_token_id)
    if info.bos_token_id is not None:
        assert hf.bos_token == ours.token_text(info.bos_token_id)


def test_the_command_writes_the_directory(tiny_dir, tmp_path):
    """The subcommand prints the files it wrote (red with it missing from the parser)."""
    out = subprocess.run(
        [sys.executable, "-m", "kvgate", "tokenizer", "--model", str(tiny_dir), "--out", str(tmp_path / "t")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert str(tmp_path / "t" / "tokenizer_config.json") in out.stdout


def test_an_out_path_that_is_a_file_is_one_error_line(tiny_dir, tmp_path):
    """QA pass 15: a traceback. Red without the check (FileExistsError's traceback)."""
    (tmp_path / "f").write_text("x")
    out = subprocess.run(
        [sys.executable, "-m", "kvgate", "tokenizer", "--model", str(tiny_dir), "--out", str(tmp_path / "f")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-1500:]
    assert "is a file, not a directory" in out.stderr
