"""Model/tokenizer IO and the tiny model: offline round trips."""

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

from hpcrl.model.hf_io import encode_prompt, load_model, load_tokenizer, save_model, unknown_characters  # noqa: E402
from hpcrl.model.tiny import CHARSET, TinyModelConfig, build_char_tokenizer, build_tiny_model, main  # noqa: E402

SMALL = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                        intermediate_size=64, seed=3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", SMALL)


def test_char_tokenizer_round_trip_keeps_spaces():
    tok = build_char_tokenizer()
    for text in ["12+47=59", "  a  b ", "What is 3 * (4 - 1)? \\boxed{9}", CHARSET]:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)  # one token per character
        assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert len(tok) == len(CHARSET) + 3
    assert len(set(CHARSET)) == len(CHARSET)
    assert tok.decode([4, 1, 0], skip_special_tokens=True) == CHARSET[1]


def test_unknown_characters():
    tok = build_char_tokenizer()
    assert unknown_characters(tok, "12+3 é=€") == {"é", "€"}
    assert unknown_characters(tok, "all known 0-9") == set()


def test_reload_is_bit_identical_and_keeps_vocab(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["tie_word_embeddings"] is True
    tok = load_tokenizer(tiny_dir)
    text = " 12 + 47 = 59 "
    assert tok.encode(text, add_special_tokens=False) == build_char_tokenizer().encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    m1, m2 = load_model(tiny_dir), load_model(tiny_dir)
    ids = torch.tensor([encode_prompt(tok, "12+47=")])
    with torch.no_grad():
        l1, l2 = m1(ids).logits, m2(ids).logits
    assert torch.equal(l1, l2)
    # saving the reloaded model again gives the same logits (and the same seed gives the same init)
    again = save_model(m1, tok, tiny_dir.parent / "again")
    with torch.no_grad():
        assert torch.equal(load_model(again)(ids).logits, l1)
    other = build_tiny_model(tiny_dir.parent / "same_seed", SMALL)
    with torch.no_grad():
        assert torch.equal(load_model(other)(ids).logits, l1)


def test_save_model_refuses_existing_path(tiny_dir):
    with pytest.raises(ValueError, match="exist"):
        save_model(load_model(tiny_dir), None, tiny_dir)


def test_missing_paths_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_pad_defaults_to_eos(tmp_path):
    tok = build_char_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id == 1


def test_encode_prompt_chat_template():
    tok = build_char_tokenizer()
    assert encode_prompt(tok, "1+2=") == [tok.convert_tokens_to_ids(c) for c in "1+2="]
    assert tok.decode(encode_prompt(tok, "1+2=", chat_template=True)) == "user: 1+2=<eos>\nassistant: "
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        encode_prompt(tok, "1+2=", chat_template=True)
    tok.chat_template = "{% for m in messages %}U:{{ m['content'] }}\n{% endfor %}A:"
    assert tok.decode(encode_prompt(tok, "1+2=", chat_template=True)) == "U:1+2=\nA:"


def test_cli(tmp_path, capsys):
    main(["--out", str(tmp_path / "cli"), "--hidden-size", "32", "--num-layers", "1", "--head-dim", "8",
          "--intermediate-size", "32"])
    out = capsys.readouterr().out
    n_params = sum(p.numel() for p in load_model(tmp_path / "cli").parameters())
    assert f"{n_params} parameters" in out and str(tmp_path / "cli") in out


def test_config_validation():
    with pytest.raises(ValueError, match="^hidden_size"):
        TinyModelConfig(hidden_size=0)
    with pytest.raises(ValueError, match="^num_kv_heads"):
        TinyModelConfig(num_heads=4, num_kv_heads=3)
