"""specplug distill on the tiny Llama (transformers engine): records train as data, the
prompt order is prefix-stable, reruns extend the file and other settings are refused."""

import json

import pytest
import torch

from specplug import distill as command
from specplug.common.training import distill as D
from specplug.common.training.samples import load_conversations, tokenize_conversation
from specplug.common.training.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def data(tmp_path):
    """Eight conversations: one duplicate first prompt, one with no user turn before the reply."""
    rows = [{"conversations": [{"from": "human", "value": f"count from {w}"}, {"from": "gpt", "value": "x"}]}
            for w in "one two three four five six".split()]
    rows.append({"conversations": [{"from": "human", "value": "count from one"}, {"from": "gpt", "value": "y"}]})
    rows.append({"conversations": [{"from": "gpt", "value": "hello"}]})
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(target, data, **kw):
    return D.DistillConfig(str(target), str(data), **{"max_new_tokens": 6, **kw})


def test_prompt_order_is_seeded_prefix_stable_and_skips_duplicates(tiny_llama_path, data):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    convs = load_conversations(str(data))
    full = D.select_prompts(tok, convs, _cfg(tiny_llama_path, data))
    assert len(full) == 6  # the duplicate is skipped (the reply-only conversation is dropped on load)
    assert [it.id for it in D.select_prompts(tok, convs, _cfg(tiny_llama_path, data, max_prompts=3))] == \
        [it.id for it in full[:3]]
    other_seed = D.select_prompts(tok, convs, _cfg(tiny_llama_path, data, seed=1))
    assert sorted(it.text for it in other_seed) == sorted(it.text for it in full)  # same prompts, other order


def test_records_are_the_targets_greedy_replies_and_train_as_data(tiny_llama_path, data, tmp_path):
    out = tmp_path / "replies.jsonl"
    summary = command.distill(_cfg(tiny_llama_path, data, max_prompts=2), out, engine="hf", batch_size=2)
    assert summary["answered_now"] == 2
    target, tok = load_target(str(tiny_llama_path))
    convs = load_conversations(str(out))  # what `specplug train --data OUT` reads
    assert len(convs) == 2
    for conv in convs:
        assert [m["role"] for m in conv] == ["user", "assistant"]
        from specplug.common.training.data import format_chat
        ids = tok(format_chat(tok, conv[:1]), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            first = int(target(torch.tensor([ids])).logits[0, -1].argmax())
        if first != tok.eos_token_id:
            assert conv[1]["content"].startswith(tok.decode([first], skip_special_tokens=True).strip())
        assert tokenize_conversation(tok, conv, 64) is not None or not conv[1]["content"]


def test_rerun_answers_only_new_prompts_and_other_settings_are_refused(tiny_llama_path, data, tmp_path,
                                                                       monkeypatch):
    asked = []

    def fake_generator(engine, cfg, batch_size, kv_cache_bytes):
        def generate(texts):
            asked.extend(texts)
            return [f"reply {len(asked)}"] * len(texts)
        return generate

    monkeypatch.setattr(command, "make_generator", fake_generator)
    out = tmp_path / "replies.jsonl"
    command.distill(_cfg(tiny_llama_path, data, max_prompts=2), out, chunk=1)
    command.distill(_cfg(tiny_llama_path, data, max_prompts=5), out, chunk=2)
    assert len(asked) == 5 and len(set(asked)) == 5
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 5
    with pytest.raises(ValueError, match=r"max_new_tokens \(file: 6, now: 7\)"):
        command.distill(_cfg(tiny_llama_path, data, max_new_tokens=7), out)
    with out.open("a") as f:
        f.write('{"id": "cut off')  # an interrupted write: the record is dropped and asked again
    command.distill(_cfg(tiny_llama_path, data, max_prompts=5), out)
    assert len(asked) == 5 and out.read_text().endswith("\n")
    stray = tmp_path / "other.jsonl"
    stray.write_text("{}\n")
    with pytest.raises(ValueError, match="not written by specplug distill"):
        command.distill(_cfg(tiny_llama_path, data), stray)


def test_bad_settings_name_the_flag(tiny_llama_path, data):
    with pytest.raises(ValueError, match="--max-prompts"):
        _cfg(tiny_llama_path, data, max_prompts=0)
    with pytest.raises(ValueError, match="--temperature"):
        _cfg(tiny_llama_path, data, temperature=-1.0)
