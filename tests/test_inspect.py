"""``meshnode model inspect`` and docs/models.md (issue 22, item 3).

The command runs as a user runs it (a separate process) on the default model,
on tiny models of a MoE and of a refused layer count, and on files that are no
model; docs/models.md's architecture tables are what the table in
meshnode/gguf/archtable/ says, and its command blocks run as written.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from meshnode.gguf import archdoc
from meshnode.gguf.archtable import POLICIES, REFUSED
from tests.conftest import cli
from tests.tiny import make
from tests.tinymodels import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_inspect_default_model(model: Path) -> None:
    done = cli("model", "inspect", str(model))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"architecture\s+llama\n", out)
    assert re.search(r"layers\s+30\n", out)
    assert re.search(r"parameters\s+134\.\d\dM\n", out)
    assert re.search(r"experts\s+none \(dense\)", out)
    assert re.search(r"context\s+8192 \(training\)", out)
    assert re.search(r"chat template\s+yes", out)
    assert "29 of 29 exact" in out
    d = json.loads(cli("model", "inspect", str(model), "--json").stdout)
    assert d["architecture"] == "llama"
    assert d["layers"] == 30
    assert d["size_bytes"] == model.stat().st_size
    assert d["chat_template"] is True
    assert [b["after_layer"] for b in d["boundaries"]] == list(range(1, 30))
    assert all(b["exact"] and b["reason"] is None for b in d["boundaries"])


def test_inspect_moe_and_refused_counts(model: Path, tmp_path: Path) -> None:
    moe = make(tmp_path / "moe.gguf", "qwen3moe", tokenizer_from=model)
    d = json.loads(cli("model", "inspect", str(moe), "--json").stdout)
    assert (d["architecture"], d["experts"], d["experts_used"], d["layers"]) == ("qwen3moe", 8, 2, 6)
    assert d["chat_template"] is True  # copied with the donor's tokenizer keys
    assert 0 < d["expert_bytes"] < d["size_bytes"]
    assert d["support"] == "cut exactly"
    text = cli("model", "inspect", str(moe)).stdout
    assert re.search(r"experts\s+8 \(2 used per token; \d+% of the file\)", text)
    # gemma3 with 62 layers (27B) picks its attention scale from the count: no boundary is exact
    g = make_tiny_model(tmp_path / "g62.gguf", "gemma3", n_layer=62, n_vocab=1024, tokenizer_from=model,
                        n_embd=64, n_ff=64)
    d = json.loads(cli("model", "inspect", str(g), "--json").stdout)
    assert d["sliding_window"] == 8
    assert d["sliding_window_layers"] == sum(il % 6 < 5 for il in range(62))
    assert not any(b["exact"] for b in d["boundaries"])
    assert all("62 layers" in b["reason"] for b in d["boundaries"])
    text = cli("model", "inspect", str(g)).stdout
    assert "0 of 61 exact" in text
    assert re.search(r"at 1-61\s+refused: gemma3 with 62 layers", text)


def test_inspect_bad_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    done = cli("model", "inspect", str(junk))
    assert done.returncode != 0
    assert "not a GGUF file" in done.stderr
    done = cli("model", "inspect", str(tmp_path / "missing.gguf"))
    assert done.returncode != 0
    assert "does not exist" in done.stderr
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 12)
    done = cli("model", "inspect", str(truncated))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr


def test_models_doc_is_current() -> None:
    doc = (ROOT / "docs" / "models.md").read_text()
    assert archdoc.render(doc) == doc, "docs/models.md is stale: run python -m meshnode.gguf.archdoc"
    for arch in [*POLICIES, *REFUSED]:
        assert f"| `{arch}` |" in doc


def test_models_doc_blocks_run(model: Path) -> None:
    doc = (ROOT / "docs" / "models.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", doc, re.S)
    assert blocks
    for block in blocks:
        script = block.replace("~/.cache/meshnode/models/SmolLM2-135M-Instruct.Q4_1.gguf", str(model))
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "architecture" in done.stdout


def test_hostile_metadata_gets_typed_errors(model: Path, tmp_path: Path) -> None:
    """Keys the cut decisions read, with values of the wrong type or out of range: ``model inspect`` and
    cutting answer with a typed error (or a verdict), never an untyped exception."""
    from meshnode.errors import MeshnodeError
    from meshnode.gguf.report import describe
    from meshnode.gguf.slicer import ensure_range

    bad = {
        "qwen3moe.nextn_predict_layers": [7, 99, "x"],
        "qwen3moe.attention.sliding_window": ["w", 3, True],
        "qwen3moe.attention.sliding_window_pattern": [[True], "p", 0],
        "qwen3moe.expert_used_count": ["two"],
        "qwen3moe.block_count": [0, 1000],
    }
    n = 0
    for key, values in bad.items():
        for v in values:
            path = make(tmp_path / f"bad{n}.gguf", "qwen3moe", tokenizer_from=model, extra_kv={key: v})
            n += 1
            for call in (lambda p=path: describe(p), lambda p=path: ensure_range(p, 0, 3)):
                try:
                    call()
                except MeshnodeError:
                    pass
    for arch, key in (("deepseek2", "leading_dense_block_count"), ("llama4", "interleave_moe_layer_step")):
        from meshnode.gguf.arch import boundary_verdicts, slice_kv

        meta = {f"{arch}.block_count": 8, f"{arch}.{key}": "many", f"{arch}.attention.sliding_window": 8}
        try:
            boundary_verdicts(meta, arch, 8)
            slice_kv(meta, arch, 8, 0, 4, head=True)
        except MeshnodeError:
            pass
