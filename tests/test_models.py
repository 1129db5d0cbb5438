"""What a --model value means: the default real model, generated presets, any directory; and
what `fetch-model` refuses."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from splitserve import models
from splitserve.models import PACKAGED, resolve_model


def test_the_default_is_smollm2_and_a_missing_one_says_how_to_fetch_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="splitserve fetch-model smollm2"):
        resolve_model(None)  # a server process never downloads on its own
    d = models.packaged_dir("smollm2")
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    assert resolve_model(None) == resolve_model("smollm2") == str(d)


def test_fetch_refuses_a_gguf_that_is_not_the_pinned_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve.fetch import ensure_gguf, gguf_path

    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "cache"))
    m = PACKAGED["smollm2"]
    wheel = tmp_path / "fake-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(m.member, b"GGUF but not that one")
    with pytest.raises(RuntimeError, match="sha256"):
        ensure_gguf(m, wheel, lambda _msg: None)
    assert not gguf_path(m).exists()  # nothing unchecked is left where it would be trusted
