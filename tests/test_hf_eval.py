"""`lengthgen eval --hf DIR`: loss by position of a local Hugging Face model, offline."""

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra (lengthgen[hf])")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers comes with transformers")

from lengthgen.cli import main  # noqa: E402
from lengthgen.eval import RunEval  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A random tiny Llama and a byte-level WordLevel tokenizer saved with save_pretrained."""
    import torch

    folder = tmp_path_factory.mktemp("tiny-llama")
    vocab = {"<s>": 0, **{chr(i): i - 31 for i in range(32, 127)}, "<unk>": 96}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=len(vocab), max_position_embeddings=4096)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def test_eval_hf_writes_loss_by_position(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "hf.json"
    assert main(["eval", "--hf", str(tiny_llama_dir), "--lengths", "64,256", "--tokens", "512",
                 "--out", str(out)]) == 0
    rows = RunEval.load(out).lengths
    assert [r.length for r in rows] == [64, 256]
    assert rows[1].batch_size == 2 and rows[1].batch == "2 long documents (val split)"
    assert [(b.lo, b.hi) for b in rows[1].buckets["loss"]][-1] == (128, 256)
    # a random model over ~97 tokens has a loss near log(97) = 4.57 at every position
    assert 3.5 < rows[1].at_length["loss"] < 6.0
    assert "loss by position (columns: eval length)" in capsys.readouterr().out


def test_eval_hf_runs_forward_passes_of_at_most_its_cap(tiny_llama_dir, monkeypatch):
    """Memory stays that of a few rows whatever --tokens asks for; the numbers are those of one pass."""
    import torch

    from lengthgen.hf import eval as hf_eval

    rows, measure = [], hf_eval.measure_hf
    monkeypatch.setattr(hf_eval, "measure_hf", lambda model, source, batch: rows.append(batch.tokens.shape[0])
                        or measure(model, source, batch))
    capped = hf_eval.evaluate_hf(tiny_llama_dir, lengths=[64], tokens=64 * 6, forward_tokens=128)
    assert rows == [2, 2, 2]
    whole = hf_eval.evaluate_hf(tiny_llama_dir, lengths=[64], tokens=64 * 6, forward_tokens=None)
    assert rows[3:] == [6]
    torch.testing.assert_close(capped.lengths[0].at_length["loss"], whole.lengths[0].at_length["loss"])
    assert hf_eval.evaluate_hf.__kwdefaults__["forward_tokens"] == hf_eval.needle_hf.__kwdefaults__[
        "forward_tokens"] == hf_eval.HF_FORWARD_TOKENS


def test_eval_hf_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["eval", "--hf", str(tmp_path / "absent")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["eval", "needle"])
def test_a_corpus_without_documents_in_the_split_is_one_line(tiny_llama_dir, tmp_path, capsys, command):
    """A --corpus whose val split is empty went to a CorpusError traceback (train names it in one line)."""
    (tmp_path / "a.txt").write_text("hello world\n")
    out = tmp_path / ("out.json" if command == "eval" else "out")
    code = main([command, "--hf", str(tiny_llama_dir), "--corpus", str(tmp_path / "a.txt"), "--lengths", "8",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"lengthgen {command}: error: --corpus: corpus {tmp_path / 'a.txt'}/val has no documents")
    assert not out.exists()


@pytest.mark.parametrize("command", ["eval", "needle"])
def test_a_model_folder_without_weights_is_one_line(tiny_llama_dir, tmp_path, capsys, command):
    """A folder with config.json and tokenizer but no weights went to transformers' OSError traceback (a saved
    retrofit gave one line); now one line naming the folder, exit 2, nothing written."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_llama_dir, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    out = tmp_path / ("out.json" if command == "eval" else "out")
    code = main([command, "--hf", str(bare), "--lengths", "32", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not out.exists()
    assert err.startswith(f"lengthgen {command}: error: HF model path '{bare}' has no weights: expected "
                          "model.safetensors or pytorch_model.bin")


@pytest.mark.parametrize("command, weights", [("eval", "model.safetensors"), ("needle", "model.safetensors"),
                                              ("eval", "pytorch_model.bin")])
def test_a_truncated_weight_file_is_one_line(tiny_llama_dir, tmp_path, capsys, command, weights):
    """A weight file cut short (an interrupted copy or download) went to safetensors' SafetensorError (torch's
    OSError) traceback, where a damaged checkpoint of a lengthgen run is one line; now one line naming the file,
    exit 2, nothing written."""
    import shutil

    import torch

    cut = tmp_path / "cut"
    shutil.copytree(tiny_llama_dir, cut)
    if weights == "pytorch_model.bin":
        torch.save(transformers.AutoModelForCausalLM.from_pretrained(cut).state_dict(), cut / weights)
        (cut / "model.safetensors").unlink()
        capsys.readouterr()         # transformers' loading bar
    (cut / weights).write_bytes((cut / weights).read_bytes()[:2000])
    out = tmp_path / ("out.json" if command == "eval" else "out")
    code = main([command, "--hf", str(cut), "--lengths", "32", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not out.exists()
    assert err.startswith(f"lengthgen {command}: error: {cut / weights} is unreadable ("), err


@pytest.mark.parametrize("model_type, message", [
    ("not_a_model_yet", "has model type `not_a_model_yet` but Transformers does not recognize this architecture"),
    ("t5", "T5Config has no causal-LM class in transformers' AutoModelForCausalLM")])
def test_a_model_type_transformers_cannot_load_as_a_causal_lm_is_one_line(tiny_llama_dir, tmp_path, capsys,
                                                                         model_type, message):
    """A folder of a model type the installed transformers does not know (saved with a newer one) or of one with no
    causal LM (an encoder-decoder) went to transformers' multi-line ValueError traceback; now one line, exit 2."""
    import json
    import shutil

    other = tmp_path / model_type
    shutil.copytree(tiny_llama_dir, other)
    (other / "config.json").write_text(json.dumps({"model_type": model_type}))
    out = tmp_path / "out.json"
    code = main(["eval", "--hf", str(other), "--lengths", "32", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and str(other) in err and not out.exists()


def test_eval_hf_starts_rows_with_the_bos_token_the_folder_declares(tmp_path):
    """The folder's own BOS, not the first usual name its vocabulary holds (here <|endoftext|>, its EOS); a
    folder that declares none and has no usual name gets a warning."""
    import json

    from lengthgen.hf.eval import _tokenizer

    vocab = {"a": 0, "b": 1, "<|startoftext|>": 2, "<|endoftext|>": 3, "<unk>": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    for name, bos in (("declared", "<|startoftext|>"), ("by_id", None)):
        folder = tmp_path / name
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|endoftext|>",
                                             unk_token="<unk>").save_pretrained(folder)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "bos_token_id": 2}))
        assert _tokenizer(folder, None).bos_id == 2
    plain = {"a": 0, "b": 1, "<unk>": 2}
    bare = tmp_path / "bare"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(
        plain, unk_token="<unk>")), unk_token="<unk>").save_pretrained(bare)
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.warns(UserWarning, match="names no BOS token: every row starts with id 3, past its vocabulary"):
        assert _tokenizer(bare, None).bos_id == 3


def test_eval_hf_refuses_a_length_whose_one_row_cannot_fit_in_memory(tiny_llama_dir, monkeypatch, capsys):
    """On the CPU, `lengthgen eval --hf` ran any length (the memory check knew lengthgen's models only), and one
    whose logits alone outgrow the memory was killed by Linux with no message; now one line naming the length, what
    it needs at least (`measure_hf_memory`) and what is left beside the loaded model, exit 2, before anything runs."""
    import importlib

    from lengthgen.hf import eval as hf_eval
    from lengthgen.memory import gib

    evaluate_module = importlib.import_module("lengthgen.eval.evaluate")
    monkeypatch.setattr(evaluate_module, "available_memory", lambda: (2**27, "host"))
    monkeypatch.setattr(hf_eval, "measure_hf", lambda *a: pytest.fail("a length ran"))
    need = 8 * 2**20 + hf_eval.measure_hf_memory(hf_eval.load_local_model(tiny_llama_dir), 2**20)
    assert main(["eval", "--hf", str(tiny_llama_dir), "--lengths", f"64,{2**20}"]) == 2
    err = capsys.readouterr().err           # after transformers' own progress bar of the weights it loaded
    assert err.endswith(f"\nlengthgen eval: error: lengths: evaluating length 1048576 (1 sequence) needs at least "
                        f"{gib(need)} of memory, 0.1 GiB available\n")


_HF_PEAK = """
import sys, torch, transformers
from lengthgen.data.tasks.base import Batch
from lengthgen.hf.eval import measure_hf, measure_hf_memory
torch.set_num_threads(1)
torch.manual_seed(0)
length, vocab = 4096, 8192
if sys.argv[1] == "gpt2":
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=vocab,
                                                                 n_positions=length + 1))
else:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=vocab, max_position_embeddings=length + 1))
model.eval()
def batch(n):
    tokens = torch.randint(0, vocab, (1, n + 1))
    return Batch(tokens=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=torch.ones(1, n, dtype=torch.bool))
def kib(field):
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field)).split()[1]) * 1024
with torch.no_grad():
    measure_hf(model, None, batch(16))
    with open("/proc/self/clear_refs", "w") as refs:    # the peak from here on, not the imports' (Linux >= 4.0)
        refs.write("5")
    before = kib("VmRSS:")
    measure_hf(model, None, batch(length))
print(kib("VmHWM:") - before, measure_hf_memory(model, length))
"""


@pytest.mark.parametrize("model", ["llama", "gpt2"])       # a plain decoder LM (chunked logits) and another
def test_the_hf_memory_estimate_is_a_lower_bound_of_the_measured_peak(model):
    """`measure_hf_memory` (what the CPU check compares with the available memory for an HF model) against the peak
    resident memory `measure_hf` adds over one row of 4096 tokens in a fresh process: below it (1.5x on a quiet
    host), loosely: a busy host may page out some of the process's library code while it runs."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HF_PEAK, model], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    peak, estimate = map(int, out.stdout.split())
    assert 0.8 * estimate <= peak <= 3 * estimate, (peak, estimate)
