"""Prompt sets from the pinned PyPI packages: counts, categories, chat formatting, parsing."""

import json

import pytest

from specplug.common.training import data


def test_sharegpt_has_the_whole_conversations_of_the_truncated_file():
    convs = data.conversations("sharegpt")
    assert len(convs) == 17671  # the packaged JSON is cut off inside record 17,672
    roles = {m["role"] for conv in convs for m in conv}
    assert roles <= {"system", "user", "assistant"}
    assert sum(1 for c in convs if c and c[0]["role"] == "user") > 10000


def test_mtbench_has_80_questions_in_8_categories_of_10():
    items = data.prompts("mtbench")
    assert len(items) == 80
    cats = data.categories("mtbench")
    assert cats == ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    assert all(len(data.prompts("mtbench", category=c)) == 10 for c in cats)


def test_humaneval_has_164_python_problems():
    items = data.prompts("humaneval")
    assert len(items) == 164
    assert items[0].id == "HumanEval/0" and "def " in items[0].text


def test_prompts_are_formatted_with_the_chat_template(tiny_llama_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    item = data.prompts("mtbench", tok, category="math", limit=2)[1]
    user = item.messages[0]["content"]
    assert item.text == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    assert len(data.prompts("humaneval", tok, limit=3)) == 3


def test_bad_names_raise_clear_errors(tiny_llama_path):
    with pytest.raises(ValueError, match="prompt set 'nope' is unknown"):
        data.prompts("nope")
    with pytest.raises(ValueError, match="category 'poetry' is not in prompt set 'mtbench'"):
        data.prompts("mtbench", category="poetry")
    with pytest.raises(ValueError, match="asset name"):
        data.asset_path("nope")

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat_template"):
        data.prompts("mtbench", NoTemplate(), limit=1)


def test_truncated_json_array_keeps_whole_records_only():
    records = [{"id": i, "conversations": [{"from": "human", "value": "q" + str(i) + " ]},"}]} for i in range(3)]
    text = json.dumps(records, indent=2)
    cut = text[: text.rindex('"q2')]  # cut inside the last record
    assert data.parse_truncated_json_array(cut) == records[:2]
    assert data.parse_truncated_json_array(text) == records
    assert data.parse_truncated_json_array("[]") == []
    with pytest.raises(ValueError, match="expected a JSON array"):
        data.parse_truncated_json_array('{"a": 1}')


def test_sharegpt_style_file_at_a_path(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert data.conversations("sharegpt", path) == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]
