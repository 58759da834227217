"""`lengthgen export RUN --out DIR`: a run as a transformers model folder that loads with the native logits.

Offline: runs are tiny (written directly, or trained for two steps), nothing is downloaded.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="lengthgen.hf needs transformers (pip install lengthgen[hf])")

import lengthgen.hf as lhf  # noqa: E402
from lengthgen.cli import main  # noqa: E402
from lengthgen.config import ConfigError  # noqa: E402
from lengthgen.data.text import ByteTokenizer, HFTokenizer, make_text_data  # noqa: E402
from lengthgen.eval import RunEval, measure_gpt  # noqa: E402
from lengthgen.hf.model import LengthgenConfig, LengthgenForCausalLM  # noqa: E402
from lengthgen.model import GPT  # noqa: E402
from lengthgen.train import load_run, train  # noqa: E402
from lengthgen.train.checkpoint import rng_state, save_checkpoint  # noqa: E402
from lengthgen.train.config import RunConfig  # noqa: E402
from lengthgen.train.run_folder import RunFolderError  # noqa: E402

# Every parameterized attention knob at once, and each norm placement, with the GPT options around them.
FULL = {"softmax_p": 2.0, "query_scaling": "log_n", "learnable_scaling": "global", "distance": "alibi",
        "position": "nope", "out_norm": "head_layer", "out_norm_affine": True, "gate": "head",
        "gate_act": "2sigmoid"}
CASES = {
    "baseline-pre": {"attention": "baseline"},
    "full-post": {"attention": FULL, "norm_placement": "post", "norm": "rms", "tie_embeddings": False,
                  "logit_cap": 5.0},
    "sqrt_log_n-hybrid_star": {"attention": "sqrt_log_n", "norm_placement": "hybrid_star", "mlp": "relu2"},
    "prope_gqa-peri-batchnorm": {"attention": {"position": "prope", "kv_heads": 1, "distance": "scale_invariant",
                                               "learnable_scaling": "head", "query_scaling": "sqrt_log_n"},
                                 "norm_placement": "peri", "norm": "batch", "head_dim": 8},
    "layer_rules-mix": {"attention": {"window": 8, "gate": "elementwise"}, "norm_placement": "mix", "layers": 3,
                        "mix_alpha": 0.5, "layer_attention": [{"every": 2, "spec": "nope_avnorm"},
                                                              {"layers": [-1], "spec": "log_bias"}]},
}
VOCAB = 40


def written_run(folder, model: dict, seed: int = 0, data: dict | None = None):
    """A run folder holding one checkpoint of a GPT whose every weight and buffer is moved off its init."""
    cfg = RunConfig.from_dict({"model": {"dim": 32, "layers": 2, "heads": 2, "mlp_ratio": 2.0, "vocab_size": VOCAB,
                                         "head": "lm", **model}, "data": data or {}})
    torch.manual_seed(seed)
    gpt = GPT(cfg.model)
    with torch.no_grad():
        for name, t in gpt.state_dict().items():
            if t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.2)
    save_checkpoint(folder, 1, gpt, [], {"config": cfg.to_dict(), "history": [0.0], "rng": rng_state()})
    return folder


def tokens(length=24, seed=5):
    return torch.randint(VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_with_the_native_logits(case, tmp_path):
    run = written_run(tmp_path / "run", CASES[case])
    _, native = load_run(run)
    lines = lhf.export_run(run, tmp_path / "hf")
    assert "config.json" in lines[0] and "no tokenizer" in lines[1]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "lengthgen" and config["gpt"] == native.config.to_dict()
    ids = tokens()
    with torch.no_grad():
        want = native(ids)
        for model in (lhf.from_pretrained(tmp_path / "hf"),
                      transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")):
            assert isinstance(model, LengthgenForCausalLM) and not model.training
            torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=0)
        dense = lhf.from_pretrained(tmp_path / "hf", backend="dense")
        assert {a.backend for a in dense.model.attentions} == {"dense"}
        torch.testing.assert_close(dense(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_exported_model_generates_greedily_and_computes_the_lm_loss(tmp_path):
    run = written_run(tmp_path / "run", CASES["full-post"])
    _, native = load_run(run)
    lhf.export_run(run, tmp_path / "hf")
    model = lhf.from_pretrained(tmp_path / "hf")
    prompt = tokens(length=6)
    seq = prompt
    with torch.no_grad():
        for _ in range(5):
            seq = torch.cat([seq, native(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        got = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(got, seq)
        logits = native(seq)
        want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), seq[:, 1:].flatten())
        torch.testing.assert_close(model(input_ids=seq, labels=seq).loss, want)
    with pytest.raises(ValueError, match="no padding"):
        model(input_ids=seq, attention_mask=torch.ones_like(seq).index_fill(1, torch.tensor([0]), 0))


@pytest.mark.parametrize("case", list(CASES))
def test_exported_model_generates_with_lengthgens_kv_cache(case, tmp_path):
    run = written_run(tmp_path / "run", CASES[case])
    _, native = load_run(run)
    lhf.export_run(run, tmp_path / "hf")
    model = lhf.from_pretrained(tmp_path / "hf")
    prompt, kw = tokens(length=6), dict(max_new_tokens=7, min_new_tokens=7, pad_token_id=0)
    lengths = []
    model.model.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
    got = model.generate(prompt, do_sample=False, **kw)
    assert lengths == [6] + [1] * 6                        # the prompt, then one new token per step
    assert torch.equal(got, native.generate(prompt, 7, cache=False))
    assert torch.equal(model.generate(prompt, do_sample=False, use_cache=False, **kw), got)
    torch.manual_seed(3)
    sampled = model.generate(prompt, do_sample=True, top_k=5, **kw)
    torch.manual_seed(3)
    assert torch.equal(model.generate(prompt, do_sample=True, top_k=5, use_cache=False, **kw), sampled)


def test_export_refuses_other_heads_and_used_folders(tmp_path, capsys):
    run = written_run(tmp_path / "run", {"head": "regress"})
    with pytest.raises(ConfigError, match="model.head='regress' cannot be exported"):
        lhf.export_run(run, tmp_path / "hf")
    assert main(["export", str(run), "--out", str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run}: model.head='regress'" in err and "only runs with the lm head" in err
    with pytest.raises(ConfigError, match="only lm heads are exported"):
        LengthgenForCausalLM(LengthgenConfig(gpt={"vocab_size": VOCAB, "head": "regress"}))
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("keep me")
    lm_run = written_run(tmp_path / "lm", {})
    assert main(["export", str(lm_run), "--out", str(used)]) == 2
    assert "is not empty" in capsys.readouterr().err and (used / "notes.txt").read_text() == "keep me"
    with pytest.raises(ConfigError, match="GPTConfig.heads"):
        LengthgenConfig(gpt={"heads": 0})


def test_export_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """The folder was written in place: a failed export left a half-written model folder, and two exports into one
    new folder mixed their files. Now it is written beside and renamed, with a new folder's permissions."""
    import os

    from transformers import PreTrainedModel

    run = written_run(tmp_path / "run", {})
    save = PreTrainedModel.save_pretrained

    def fail_after_saving(self, folder, **kwargs):
        save(self, folder, **kwargs)
        raise OSError("disk full")
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", fail_after_saving)
    with pytest.raises(OSError, match="disk full"):
        lhf.export_run(run, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]          # no hf/, no temporary folder

    def another_export_meanwhile(self, folder, **kwargs):
        save(self, folder, **kwargs)
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "config.json").write_text("{}")
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", another_export_meanwhile)
    with pytest.raises(RunFolderError, match="was written by another process meanwhile"):
        lhf.export_run(run, tmp_path / "hf")
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save)
    (tmp_path / "empty").mkdir()
    lhf.export_run(run, tmp_path / "empty")                                    # an empty folder is taken
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    assert (tmp_path / "empty").stat().st_mode & 0o777 == 0o777 & ~umask
    # every file too: model.safetensors was private (0o600), unreadable by the group a folder is shared with
    assert {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "empty").iterdir()} == \
        {f.name: 0o666 & ~umask for f in (tmp_path / "empty").iterdir()}


def test_a_killed_exports_temporary_folder_goes_with_the_next_export(tmp_path):
    """A SIGKILL during export left its hidden .hf.XXXXXXXX.tmp folder beside --out for good. The next export of
    that folder removes it: only its own name's temporaries, and not one a live export still writes (locked)."""
    import fcntl
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    run, out = written_run(tmp_path / "run", {}), tmp_path / "hf"
    kill = ("import os, signal, lengthgen.atomic as atomic\nreplace = os.replace\n"
            "def killing(src, dst, *args, **kwargs):\n"
            f"    if str(dst) == {str(out)!r}:\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "    return replace(src, dst, *args, **kwargs)\n"
            "atomic.os.replace = killing\n"
            "from lengthgen.cli import main\nmain()")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    killed = subprocess.run([sys.executable, "-c", kill, "export", str(run), "--out", str(out)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    [stale] = tmp_path.glob(".hf.*.tmp")
    assert (stale / "model.safetensors").is_file()
    live, other, foreign = tmp_path / ".hf.live0000.tmp", tmp_path / ".hf2.dead0000.tmp", tmp_path / ".hf.mine.tmp"
    for folder in (live, other, foreign):
        folder.mkdir()
    held = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)             # an export writing it now
        assert main(["export", str(run), "--out", str(out)]) == 0
    finally:
        os.close(held)
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.glob(".*")) == sorted(p.name for p in (live, other, foreign))


def test_export_and_eval_hf_print_their_own_lines_without_transformers_bars(tmp_path, capsys):
    """export printed transformers' "Writing model shards" bar and eval --hf its "Loading weights" bar; the CLI
    turns them off inside those commands only: a library caller's transformers keeps its bars."""
    from transformers.utils import logging

    run = written_run(tmp_path / "run", {"vocab_size": 259})            # the byte tokenizer's ids
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert main(["eval", "--hf", str(tmp_path / "hf"), "--tokenizer", "byte", "--lengths", "16", "--tokens",
                 "32"]) == 0
    err = capsys.readouterr().err
    assert "Writing model shards" not in err and "Loading weights" not in err
    assert logging.is_progress_bar_enabled()
    lhf.export_run(run, tmp_path / "hf2")
    assert "Writing model shards" in capsys.readouterr().err


def test_export_saves_an_hf_tokenizer_and_says_why_not_for_tiktoken(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<s>": 0, **{c: i + 1 for i, c in enumerate("abc ")}, "<unk>": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    run = written_run(tmp_path / "run", {}, data={"kind": "text", "text": {"tokenizer": f"hf:{tmp_path / 'tok'}"}})
    assert lhf.export_run(run, tmp_path / "hf")[1] == (f"tokenizer: {tmp_path / 'tok' / 'tokenizer.json'} (BOS "
                                                       "'<s>' = id 0, as the run put it)")
    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert saved("ab ca", add_special_tokens=False)["input_ids"] == HFTokenizer(tmp_path / "tok").encode("ab ca")
    assert saved.bos_token_id == 0
    # a tokenizer that names no BOS: the run's appended id is saved as <|bos|>, and eval --hf starts rows with it
    plain = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    (tmp_path / "plain").mkdir()
    plain.save(str(tmp_path / "plain" / "tokenizer.json"))
    run = written_run(tmp_path / "run-plain", {},
                      data={"kind": "text", "text": {"tokenizer": f"hf:{tmp_path / 'plain'}"}})
    assert "(BOS '<|bos|>' = id 3, as the run put it)" in lhf.export_run(run, tmp_path / "hf-plain")[1]
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf-plain").bos_token_id == 3
    from lengthgen.hf.eval import _tokenizer
    assert _tokenizer(tmp_path / "hf-plain", None).bos_id == 3
    run = written_run(tmp_path / "gpt2", {}, data={"kind": "text", "text": {"tokenizer": "gpt2"}})
    note = lhf.export_run(run, tmp_path / "hf-gpt2")[1]
    assert note.startswith("no tokenizer: 'gpt2' is a tiktoken encoding")
    assert not (tmp_path / "hf-gpt2" / "tokenizer.json").exists()


def test_a_tiktoken_export_names_its_end_of_text_id(tmp_path, monkeypatch):
    """A tiktoken run's export recorded no BOS or EOS id, so its document-masked model's generate and eval --hf took
    each row as one document and generation never stopped at end-of-text: the encoding's id is BOS and EOS (as the
    run put it); where tiktoken cannot load it here, the export says so."""
    import lengthgen.hf.export as export
    from lengthgen.optional import MissingPackageError

    run = written_run(tmp_path / "gpt2", {}, data={"kind": "text", "text": {"tokenizer": "gpt2"}})

    def missing(name):
        raise MissingPackageError("TiktokenTokenizer('gpt2') needs tiktoken")
    monkeypatch.setattr(export, "make_tokenizer", missing)
    assert "config.json names no BOS or EOS id (tiktoken or its encoding's file is not here)" in \
        lhf.export_run(run, tmp_path / "none")[1]
    assert "bos_token_id" not in json.loads((tmp_path / "none" / "config.json").read_text())
    monkeypatch.setattr(export, "make_tokenizer", lambda name: types.SimpleNamespace(bos_id=7, eos_id=7))
    assert lhf.export_run(run, tmp_path / "hf")[1].endswith("; config.json names its end-of-text id 7 as BOS and "
                                                            "EOS, as the run put it")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (7, 7)


def test_a_tokenizer_file_changed_since_training_is_refused_by_export_and_sample(tmp_path, capsys):
    """An hf: tokenizer.json retrained in place after the run: export saved the new file beside the model, whose ids
    it does not share, and sample encoded the prompt with it, both without a word. Each checkpoint now keeps the
    tokenizer's id mapping (`Tokenizer.cache_key`); both refuse another one in one line."""
    tokenizers = pytest.importorskip("tokenizers")

    def save(chars: str) -> None:
        vocab = {"<s>": 0, **{c: i + 1 for i, c in enumerate(chars)}, "<unk>": len(chars) + 1}
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
        tok.save(str(tmp_path / "tokenizer.json"))

    save("abc ")
    (tmp_path / "docs.txt").write_text("abc cab bca " * 20)
    text = {"corpus": str(tmp_path / "docs.txt"), "tokenizer": f"hf:{tmp_path}", "split": "all", "cache": False}
    train(_tiny(kind="text", text=text), tmp_path / "run", progress=False)
    assert main(["sample", str(tmp_path / "run"), "--prompt", "ab", "--max-new-tokens", "2"]) == 0
    save(" cba")                                                          # the same size, other ids
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    assert main(["sample", str(tmp_path / "run"), "--prompt", "ab", "--max-new-tokens", "2"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors == [f"lengthgen {command}: error: data.text.tokenizer: hf:{tmp_path / 'tokenizer.json'} maps text "
                      "to other ids than when the run trained (its file changed since): restore the tokenizer the "
                      "run trained with" for command in ("export", "sample")]
    assert not (tmp_path / "hf").exists()


def test_byte_tokenizer_has_the_same_ids_and_decoding():
    text = "def f(x):\n\treturn x  # ünïcödé 日本語 🙂\r\n  trailing   "
    fast = lhf.byte_tokenizer()
    want = ByteTokenizer().encode(text)
    assert fast(text, add_special_tokens=False)["input_ids"] == want
    assert fast.decode(want) == text
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (256, 257, 258) and len(fast) == 259


# ---------------------------------------------------------------------------------------------------
# trained runs: a task run and a byte-level text run


def _tiny(**data):
    return RunConfig.from_dict({"model": {"dim": 32, "layers": 2, "heads": 2, "mlp_ratio": 2.0, "attention": "l2"},
                                "train": {"steps": 2, "batch_size": 4, "eval_batches": 1, "eval_batch_size": 2,
                                          "eval_lengths": [32], "lr": 3e-3},
                                "data": {"length": 32, **data}})


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A text run (byte tokenizer) on a folder of small documents, trained for two steps, and its export."""
    root = tmp_path_factory.mktemp("text")
    docs = root / "docs"
    docs.mkdir()
    for i in range(24):
        body = "def f(x):\n    return x * 2\n" * 6
        (docs / f"doc{i:02d}.txt").write_text(f"# document {i}: ünïcödé 🙂\n{body}")
    cfg = _tiny(kind="text", text={"corpus": str(docs), "tokenizer": "byte", "cache": False, "val_fraction": 0.3})
    train(cfg, root / "run", progress=False)
    lhf.export_run(root / "run", root / "hf")
    return root


def test_task_run_exports_with_its_logits_and_its_bema_weights(tmp_path):
    cfg = _tiny(kind="task", task="dyck").override("train.bema.enabled=true")
    train(cfg, tmp_path / "run", progress=False)
    vocab = load_run(tmp_path / "run")[1].config.vocab_size
    ids = torch.randint(vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    for bema in (False, True):
        out = tmp_path / f"hf-{bema}"
        assert main(["export", str(tmp_path / "run"), "--out", str(out)] + ["--bema"] * bema) == 0
        _, native = load_run(tmp_path / "run", bema=bema)
        with torch.no_grad():
            torch.testing.assert_close(lhf.from_pretrained(out)(input_ids=ids).logits, native(ids), rtol=0, atol=0)
    with torch.no_grad():
        assert not torch.equal(lhf.from_pretrained(tmp_path / "hf-True")(input_ids=ids).logits,
                               lhf.from_pretrained(tmp_path / "hf-False")(input_ids=ids).logits)


def test_text_run_exports_its_tokenizer_and_the_same_losses(text_run):
    out = text_run / "hf"
    assert (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == 256
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("ünï 🙂 x", add_special_tokens=False)["input_ids"] == ByteTokenizer().encode("ünï 🙂 x")
    # the same long documents through lengthgen's tokenizer + native model and the folder's tokenizer + HF model
    _, native = load_run(text_run / "run")
    model = lhf.load_local_model(out)
    docs = str(text_run / "docs")
    native_data = make_text_data(docs, "byte", split="all", cache=False)
    hf_data = make_text_data(docs, f"hf:{out}", split="all", cache=False)
    a, b = native_data.long_batch(48, 3, seed=1), hf_data.long_batch(48, 3, seed=1)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
    with torch.no_grad():
        want = measure_gpt(native, native_data, a)["loss"]
        got = lhf.measure_hf(model, hf_data, b)["loss"]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_eval_hf_without_a_tokenizer_says_what_to_do_or_takes_one(text_run, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((text_run / "hf" / name).read_bytes())
    corpus = ["--corpus", str(text_run / "docs"), "--lengths", "32", "--tokens", "64"]
    assert main(["eval", "--hf", str(bare), *corpus]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bare) in err and "--tokenizer byte" in err
    assert main(["eval", "--hf", str(bare), "--tokenizer", "byte", *corpus, "--out", str(tmp_path / "b.json")]) == 0
    assert main(["eval", "--hf", str(text_run / "hf"), *corpus, "--out", str(tmp_path / "own.json")]) == 0
    byte, own = RunEval.load(tmp_path / "b.json"), RunEval.load(tmp_path / "own.json")
    assert byte.at(32).at_length["loss"] == pytest.approx(own.at(32).at_length["loss"], rel=1e-6)
    assert main(["eval", "--hf", str(bare), "--tokenizer", "nonsense", *corpus]) == 2
    assert "unknown tokenizer 'nonsense'" in capsys.readouterr().err


def test_eval_hf_refuses_a_tokenizer_larger_than_the_model(tmp_path, capsys):
    run = written_run(tmp_path / "run", {})
    lhf.export_run(run, tmp_path / "hf")
    assert main(["eval", "--hf", str(tmp_path / "hf"), "--tokenizer", "byte", "--lengths", "32"]) == 2
    assert f"'byte' has 259 ids but the model at '{tmp_path / 'hf'}' embeds only {VOCAB}" in capsys.readouterr().err


def test_eval_of_an_export_masks_documents_in_packed_rows_as_the_run_did(tmp_path):
    """Packed rows (no document long enough) carry document ids: an exported doc-masking run must get them."""
    from lengthgen.data.tasks.base import Batch

    run = written_run(tmp_path / "run", {"attention": {"doc_masking": True}})
    lhf.export_run(run, tmp_path / "hf")
    _, native = load_run(run)
    ids = tokens(length=25)
    doc_ids = (torch.arange(24) >= 10).long().expand(2, -1)              # a document boundary at position 10
    batch = Batch(ids[:, :-1], ids[:, 1:], torch.ones(2, 24, dtype=torch.bool), doc_ids)
    with torch.no_grad():
        want = measure_gpt(native, None, batch)["loss"]
        got = lhf.measure_hf(lhf.load_local_model(tmp_path / "hf"), None, batch)["loss"]
        across = measure_gpt(native, None, Batch(batch.tokens, batch.targets, batch.loss_mask))["loss"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(want[:, 10:], across[:, 10:])             # the masking matters here


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_of_an_export_masks_documents_at_its_bos(tmp_path, use_cache):
    """transformers' generate on a doc-masking export starts a document at each BOS (the exported
    ``bos_token_id``), as the run trained and as `GPT.generate(bos_id=)` decodes."""
    bos = 3
    run = written_run(tmp_path / "run", {"attention": {"doc_masking": True}})
    _, native = load_run(run)
    model = LengthgenForCausalLM.from_gpt(native, bos_token_id=bos)
    prompt = tokens(length=8)
    prompt[:, 0] = prompt[:, 5] = bos                       # a second document starts inside the prompt
    kw = dict(max_new_tokens=6, min_new_tokens=6, pad_token_id=0, do_sample=False, use_cache=use_cache)
    got = model.generate(prompt, **kw)
    assert torch.equal(got, native.generate(prompt, 6, bos_id=bos))
    assert not torch.equal(got, native.generate(prompt, 6))           # the masking matters here
    plain = LengthgenForCausalLM.from_gpt(native)                     # no BOS declared: one document
    assert torch.equal(plain.generate(prompt, **kw), native.generate(prompt, 6))


def test_export_into_a_symlink_writes_the_folder_it_names(tmp_path, capsys):
    """An --out that is a link to an empty folder (or to a new one) was refused as 'written by another process
    meanwhile': the rename cannot replace a link. The folder the link names is written now, and the link stays."""
    run = written_run(tmp_path / "run", {})
    (tmp_path / "disk").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "disk")
    (tmp_path / "dangling").symlink_to(tmp_path / "new")
    for link, folder in (("link", "disk"), ("dangling", "new")):
        assert main(["export", str(run), "--out", str(tmp_path / link)]) == 0
        assert (tmp_path / link).is_symlink() and (tmp_path / folder / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "link")]) == 2
    assert capsys.readouterr().err == f"lengthgen export: error: export folder {tmp_path / 'link'} is not empty: " \
                                      "choose a new folder\n"


def test_an_export_of_a_gpu_run_runs_on_the_cpu_with_its_logits(tmp_path, capsys):
    """A run that trained with model.attention_backend = triton: its export loaded on a CPU raised a raw ValueError at
    its first forward (and ``lengthgen eval --hf`` a traceback), where the run itself falls back to auto. The export
    now does too, with a one-line warning, and keeps the native logits."""
    if torch.cuda.is_available():
        pytest.skip("the fallback is for machines without CUDA; this one has it")
    run = written_run(tmp_path / "run", {"attention_backend": "triton"})
    lhf.export_run(run, tmp_path / "hf")
    _, native = load_run(run)
    for attn in native.attentions:
        attn.backend = "auto"
    model = lhf.from_pretrained(tmp_path / "hf")
    ids = tokens()
    with pytest.warns(UserWarning, match=r"attention_backend='triton' cannot run on cpu .*; layers 0, 1 use 'auto'"):
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, native(ids), rtol=0, atol=0)
    prompt = tokens(length=6)
    assert torch.equal(model.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0),
                       native.generate(prompt, 3))


def test_export_names_the_checkpoint_it_wrote(tmp_path, capsys):
    """'weights of runs/lm' did not say which step a run still training (or one whose newest checkpoint is damaged)
    was exported at; the line names the checkpoint read, the newest readable one."""
    run = written_run(tmp_path / "run", {})
    _, older = load_run(run)
    newer = written_run(tmp_path / "newer", {}, seed=1)
    (run / "checkpoints" / "step_00000002").mkdir()
    for f in (newer / "checkpoints" / "step_00000001").iterdir():
        (run / "checkpoints" / "step_00000002" / f.name).write_bytes(f.read_bytes())
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert f"(weights of {run / 'checkpoints' / 'step_00000002'})" in capsys.readouterr().out
    (run / "checkpoints" / "step_00000002" / "model.safetensors").write_bytes(b"damaged")
    assert main(["export", str(run), "--out", str(tmp_path / "hf-older")]) == 0
    assert f"(weights of {run / 'checkpoints' / 'step_00000001'})" in capsys.readouterr().out
    with torch.no_grad():
        torch.testing.assert_close(lhf.from_pretrained(tmp_path / "hf-older")(input_ids=tokens()).logits,
                                   older(tokens()), rtol=0, atol=0)
