"""``lengthgen sample RUN --prompt TEXT``: a text run continues a prompt with its tokenizer; task runs are refused
in one line."""

from __future__ import annotations

import pytest
import torch

from lengthgen.cli import main
from lengthgen.data.text import ByteTokenizer
from lengthgen.model import GPT
from lengthgen.train.checkpoint import rng_state, save_checkpoint
from lengthgen.train.config import RunConfig

TEXT = {"kind": "text", "text": {"corpus": "stdlib", "tokenizer": "byte"}}


def written_run(folder, data: dict, vocab: int = 259, edit=None, train: dict | None = None, **model):
    """A run folder with one checkpoint of a small GPT (``model`` keys changed), its weights moved off their init
    (then ``edit(gpt)``)."""
    cfg = RunConfig.from_dict({"model": {"dim": 32, "layers": 2, "heads": 2, "vocab_size": vocab, "head": "lm",
                                         "tie_embeddings": False, **model}, "data": data, "train": train or {}})
    torch.manual_seed(0)
    gpt = GPT(cfg.model)
    with torch.no_grad():
        for t in gpt.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.3)
        if edit is not None:
            edit(gpt)
    save_checkpoint(folder, 1, gpt, [], {"config": cfg.to_dict(), "history": [0.0], "rng": rng_state()})
    return gpt


def sample(capsys, *args: str) -> str:
    assert main(["sample", *args]) == 0
    return capsys.readouterr().out


def test_greedy_sample_is_the_models_greedy_continuation(tmp_path, capsys):
    gpt = written_run(tmp_path / "run", TEXT)
    out = sample(capsys, str(tmp_path / "run"), "--prompt", "def f(", "--temperature", "0", "--max-new-tokens", "12")
    tok = ByteTokenizer()
    prompt = [tok.bos_id, *tok.encode("def f(")]
    new = gpt.eval().generate(torch.tensor([prompt]), 12)[0, len(prompt):].tolist()
    end = next((i for i, t in enumerate(new) if t in (tok.bos_id, tok.eos_id)), len(new))
    assert out == tok.decode(tok.encode("def f(") + new[:end]) + "\n" and out.startswith("def f(")


def test_sampling_follows_the_seed(tmp_path, capsys):
    written_run(tmp_path / "run", TEXT)
    args = [str(tmp_path / "run"), "--prompt", "x = ", "--max-new-tokens", "30", "--temperature", "1.5"]
    first = sample(capsys, *args, "--seed", "1")
    assert first == sample(capsys, *args, "--seed", "1")
    assert first != sample(capsys, *args, "--seed", "2")


def test_text_ends_at_an_id_the_tokenizer_lacks(tmp_path, capsys):
    def always_280(gpt):   # the final norm outputs e_0, and only id 280 (beyond the byte vocabulary) reads it
        gpt.final_norm.weight.zero_()
        gpt.final_norm.bias.zero_()
        gpt.final_norm.bias[0] = 1.0
        gpt.head.weight.zero_()
        gpt.head.weight[280, 0] = 10.0

    written_run(tmp_path / "run", TEXT, vocab=300, edit=always_280)
    assert sample(capsys, str(tmp_path / "run"), "--prompt", "abc", "--temperature", "0") == "abc\n"


def test_a_task_run_is_refused_in_one_line(tmp_path, capsys):
    written_run(tmp_path / "run", {"kind": "task", "task": "dyck"}, vocab=5)
    assert main(["sample", str(tmp_path / "run"), "--prompt", "(("]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lengthgen sample: error: ")
    assert "'dyck' task run" in err and f"lengthgen eval {tmp_path / 'run'}" in err


@pytest.mark.parametrize("args, match", [(["--temperature", "-1"], "--temperature: -1 is not valid"),
                                         (["--temperature", "nan"], "--temperature: nan is not valid"),
                                         # was temperature=1e+300 from GPT.generate, once the model had loaded
                                         (["--temperature", "1e300"], "--temperature: 1e300 is not valid; give a "
                                                                      "finite number >= 0, up to 3.4e+38"),
                                         (["--top-k", "0"], "--top-k: 0 is not valid"),
                                         (["--seed", str(10**20)], f"--seed: {10**20} is not valid"),
                                         (["--seed", "-1"], "--seed: -1 is not valid; give a seed from 0")])
def test_bad_sampling_arguments_are_one_line_errors(tmp_path, capsys, args, match):
    with pytest.raises(SystemExit) as exit_:
        main(["sample", str(tmp_path / "run"), "--prompt", "a", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and match in err


def test_a_folder_without_checkpoints_says_what_it_is(tmp_path, capsys):
    """sample (and export, eval) of a run that has no checkpoint yet, or of an exported Hugging Face model folder,
    said only 'no checkpoint in DIR (expected checkpoints/step_N ...)'."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(RunConfig().to_json())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "lengthgen", "gpt": {}}')
    for folder, what in (("run", "its run has written no checkpoint yet (one every train.checkpoint_every steps"),
                         ("hf", "it is a Hugging Face model folder, which eval --hf and needle --hf read")):
        assert main(["sample", str(tmp_path / folder), "--prompt", "a"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"no checkpoint in {tmp_path / folder} " in err and what in err


def test_a_diverged_model_is_one_line_exit_1(tmp_path, capsys):
    """Weights that make the logits NaN (diverged, or damaged by hand) were a ValueError traceback from next_token."""
    written_run(tmp_path / "run", TEXT, edit=lambda gpt: gpt.blocks[0].attn.v_proj.weight.fill_(float("nan")))
    assert main(["sample", str(tmp_path / "run"), "--prompt", "a"]) == 1
    err = capsys.readouterr().err
    assert err == ("lengthgen sample: error: next_token: the logits hold NaN or +inf (the model's weights or "
                   "activations diverged); there is no distribution to pick a token from\n")


def test_a_prompt_that_is_not_utf8_is_refused_in_one_line(tmp_path, capsys):
    """Bytes the shell passes that are not UTF-8 (here 0xff) reach Python as surrogates: the byte tokenizer encoded
    each as three other bytes, an hf: tokenizer as <unk>, and sample continued a prompt nobody typed."""
    written_run(tmp_path / "run", TEXT)
    prompt = b"ab\xffc".decode("utf-8", "surrogateescape")           # what sys.argv holds
    assert main(["sample", str(tmp_path / "run"), "--prompt", prompt]) == 2
    assert capsys.readouterr().err == ("lengthgen sample: error: --prompt is not UTF-8 text (byte b'\\xff' at "
                                       "character 2); give UTF-8 text, as the run's tokenizer reads\n")


def test_a_run_recorded_with_a_backend_this_machine_lacks_falls_back_to_auto(tmp_path, capsys):
    """A GPU run that named model.attention_backend = triton still samples and evaluates on a CPU (with a
    warning): every backend matches the same dense oracle."""
    if torch.cuda.is_available():
        pytest.skip("the fallback is for machines without CUDA; this one has it")
    from lengthgen.experiments.sample import sample_run

    run = tmp_path / "run"
    gpt = written_run(run, TEXT, attention_backend="triton")
    with pytest.warns(UserWarning, match=r"attention_backend='triton' cannot run on cpu .*; layers 0, 1 use 'auto'"):
        text = sample_run(run, "ab", max_new_tokens=3, temperature=0.0)
    gpt.attentions[0].backend = gpt.attentions[1].backend = "auto"
    prompt = torch.tensor([[ByteTokenizer().bos_id, *b"ab"]])
    assert text == "ab" + bytes(gpt.generate(prompt, 3)[0, 3:].tolist()).decode("utf-8", "replace")


def test_the_backend_fallback_is_a_one_line_warning(tmp_path, capsys):
    """The fallback's warning was a plain UserWarning: the command printed it with its source line under it."""
    if torch.cuda.is_available():
        pytest.skip("the fallback is for machines without CUDA; this one has it")
    written_run(tmp_path / "run", TEXT, attention_backend="triton")
    assert main(["sample", str(tmp_path / "run"), "--prompt", "ab", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lengthgen sample: warning: model.attention_backend='triton' ")


def test_sample_runs_under_the_runs_threads(tmp_path, capsys, monkeypatch):
    """train.threads applies to sampling as to training and evaluation; the caller's threads come back after."""
    written_run(tmp_path / "run", TEXT, train={"threads": 1})
    seen = []

    def generate(self, *args, original=GPT.generate, **kwargs):
        seen.append(torch.get_num_threads())
        return original(self, *args, **kwargs)
    monkeypatch.setattr(GPT, "generate", generate)
    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        sample(capsys, str(tmp_path / "run"), "--prompt", "ab", "--max-new-tokens", "2")
        assert seen == [1] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(saved)
