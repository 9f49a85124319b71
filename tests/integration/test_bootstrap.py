import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sdpo_core.teacher_context import FEEDBACK_TEMPLATE, REPROMPT_TEMPLATE, SOLUTION_TEMPLATE, build_teacher_messages
from sdpo_core.verifiers.arithmetic import FORMAT_ERROR, TRUNCATED
from tasks.config import BootstrapConfig
from tasks.data.bootstrap import bootstrap_checkpoint, warmup_messages, wrong_answer
from tasks.data.bootstrap_model import IM_END, UNK_TOKEN, build_model, build_tokenizer, phrase_tokens, prompt_ids
from tasks.data.demo import make_splits

TEXTS = [
    "37+45=82",
    "Hello, World! (a-b)*c / d; x_1 = [y] {z} ~ `q` 'r' \"s\" #$%&@^|\\<>?",
    "line one\nline two\n\n  indented\tand tabbed",
    SOLUTION_TEMPLATE + FEEDBACK_TEMPLATE + REPROMPT_TEMPLATE,
    "Wrong answer. Your output: 83. Expected: 82.",
    FORMAT_ERROR + " Your output ended with: 'abc'.",
    TRUNCATED,
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_text_exactly_without_unknowns(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_characters_are_single_tokens_and_unknowns_map_to_unk(tokenizer):
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("12+3=", add_special_tokens=False)) == list("12+3=")
    assert tokenizer.encode("é", add_special_tokens=False) == [tokenizer.unk_token_id]
    assert tokenizer.unk_token == UNK_TOKEN


def test_template_phrases_are_single_tokens(tokenizer):
    phrases = phrase_tokens()
    assert "Correct solution:" in phrases and "Correctly solve the original question." in phrases
    assert "The following is feedback from your unsuccessful earlier attempt:" in phrases
    for phrase in phrases:
        assert len(tokenizer.encode(phrase, add_special_tokens=False)) == 1, phrase


def test_special_tokens_and_eos(tokenizer):
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[
        0
    ] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.encode("7", add_special_tokens=True) == tokenizer.encode("7", add_special_tokens=False)


def test_chat_template_renders_chatml_with_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    assert no_prompt.endswith("1+1=<|im_end|>\n")
    ids = prompt_ids(tokenizer, messages)
    assert tokenizer.decode(ids) == text


def test_saved_tokenizer_reloads_identically(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": TEXTS[3]}]
    assert prompt_ids(reloaded, messages) == prompt_ids(tokenizer, messages)
    assert len(reloaded) == len(tokenizer) and reloaded.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("architecture", ["qwen3", "llama"])
def test_build_model_is_seeded_and_sized_for_the_tokenizer(tokenizer, architecture):
    kwargs = dict(
        hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, max_positions=64, architecture=architecture
    )
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(tokenizer, seed=0, **kwargs)
    assert torch.rand(1) == before  # the global RNG is untouched
    b = build_model(tokenizer, seed=0, **kwargs)
    c = build_model(tokenizer, seed=1, **kwargs)
    assert a.config.vocab_size == len(tokenizer)
    assert not a.config.tie_word_embeddings
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters(), strict=True))


def test_build_model_rejects_indivisible_heads(tokenizer):
    with pytest.raises(ValueError, match="heads"):
        build_model(tokenizer, hidden=30, layers=1, heads=4, kv_heads=2, intermediate=8, max_positions=16, seed=0)


def test_warmup_examples_use_the_teacher_templates():
    row = {"prompt_id": "add-37-45", "prompt_messages": [{"role": "user", "content": "37+45="}], "label": "82"}
    rng = random.Random(0)
    assert warmup_messages(row, "plain", rng) == tuple(row["prompt_messages"])
    assert warmup_messages(row, "solution", rng) == build_teacher_messages(
        row["prompt_messages"], solution="82", feedback=None
    )
    feedback = warmup_messages(row, "feedback", rng)[-1]["content"]
    assert feedback.startswith("37+45=\nThe following is feedback")
    assert "Wrong answer. Your output: " in feedback and "Expected: 82." in feedback
    assert all(wrong_answer(82, rng) not in (82,) for _ in range(200))


def test_short_bootstrap_writes_a_loadable_checkpoint(tmp_path):
    train, held_out = make_splits(seed=0, max_operand=20, eval_fraction=0.2)
    metrics = bootstrap_checkpoint(
        tmp_path,
        train_rows=train,
        eval_rows=held_out,
        seed=0,
        steps=8,
        batch_size=8,
        lr=3e-3,
        architecture="qwen3",
        hidden=32,
        layers=1,
        heads=2,
        kv_heads=1,
        intermediate=64,
        max_positions=128,
        num_eval=10,
        mix=dict(BootstrapConfig().warmup_mix),
        progress=False,
    )
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]:
        assert (tmp_path / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.chat_template is not None
    assert metrics["bootstrap/warmup_steps"] == 8
    assert metrics["bootstrap/warmup_loss_last"] < metrics["bootstrap/warmup_loss_first"]
    for name in ["plain", "teacher_solution", "teacher_feedback"]:
        assert 0.0 <= metrics[f"bootstrap/{name}_accuracy"] <= 1.0
