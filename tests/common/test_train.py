"""specplug train on the tiny Llama: the loss falls, the checkpoint loads back, resume and
the up-front errors work, and the EAGLE-3 draft vocab stays aligned with its lm_head."""

import json

import pytest
import torch

from specplug.common import formats
from specplug.common.training import train as T
from specplug.common.training import states as C
from specplug.common.training import eagle3 as E
from specplug.common.training import loop as L
from specplug.common.training import medusa as M
from specplug.common.training import regenerate as R
from specplug.common.heads import Eagle3Head, MedusaHeads
from specplug.common.training.checks import check_memory
from specplug.common.training.cli import add_arguments, config_from_args
from specplug.common.training.config import TrainConfig
from specplug.common.training.samples import batch_indices, tokenize_conversation
from specplug.common.training.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", autouse=True)
def fresh_states_cache(tiny_llama_path, tmp_path_factory):
    """Cached target states of this module's runs go to a fresh $SPECPLUG_CACHE (the tiny
    model is built, or found, in the usual cache first)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECPLUG_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield




COUNT = "one two three four five six seven eight nine ten".split()


def _cycle(start: int, n: int) -> str:
    return " ".join(COUNT[(start + i) % len(COUNT)] for i in range(n))


@pytest.fixture(scope="module")
def counting_data(tmp_path_factory):
    """ShareGPT-style JSONL whose replies count in a cycle: the token two places ahead is a
    function of the current one, so a head CAN learn it even on a random target."""
    path = tmp_path_factory.mktemp("data") / "count.jsonl"
    rows = [{"conversations": [{"from": "human", "value": "count from " + COUNT[i % 10]},
                               {"from": "gpt", "value": _cycle(i, 24)}]} for i in range(60)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _config(method, target, out, data, **kw):
    base = dict(method=method, target=str(target), out=str(out), data=str(data), steps=24, batch_size=4,
                max_length=48, lr=3e-3, warmup_steps=3, heldout_samples=4, draft_vocab_size=128,
                checkpoint_every=10, topk=4, aux_layer_ids=(1, 2, 3), eval_prompts=0)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def trained(tiny_llama_path, counting_data, tmp_path_factory):
    """Each method trained once for 24 steps on the tiny Llama."""
    out = {}
    for method in ("eagle3", "medusa"):
        folder = tmp_path_factory.mktemp(method)
        cfg = _config(method, tiny_llama_path, folder, counting_data, eval_prompts=1, eval_tokens=6)
        out[method] = (T.train(cfg), folder)
    return out


def _falls(losses, factor):
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    return last < factor * first, (first, last)


@pytest.mark.timeout(600)
def test_eagle3_loss_falls_and_head_loads_back(trained, tiny_llama_path):
    result, folder = trained["eagle3"]
    state = json.loads((folder / "checkpoint" / "state.json").read_text())
    ok, ends = _falls(state["losses"], 0.7)
    assert ok, f"EAGLE-3 loss did not fall by 30% in 24 steps: {ends}"
    assert result.files == ["config.json", "model.safetensors"]
    assert result.eval["steps"] >= 1 and result.eval["tau"] >= 1.0  # the final reference-loop check ran
    assert json.loads((folder / "training.json").read_text())["eval"]["tau"] == result.eval["tau"]
    head = formats.load_head_module(folder, str(tiny_llama_path))
    assert isinstance(head, Eagle3Head)
    assert head.fc.weight.dtype == torch.bfloat16
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["specplug"]["method"] == "eagle3" and config["specplug"]["verification"] == "lossless"
    # d2t, t2d and lm_head were written together: t2d marks exactly the ids d2t maps to
    ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size))
    assert torch.equal(head.t2d.nonzero().flatten(), ids)
    assert bool((ids[1:] > ids[:-1]).all())


@pytest.mark.timeout(600)
def test_medusa_loss_falls_and_records_head_accuracies(trained, tiny_llama_path):
    result, folder = trained["medusa"]
    state = json.loads((folder / "checkpoint" / "state.json").read_text())
    ok, ends = _falls(state["losses"], 0.8)
    assert ok, f"Medusa loss did not fall by 20% in 24 steps: {ends}"
    heads = formats.load_head_module(folder, str(tiny_llama_path))
    assert isinstance(heads, MedusaHeads) and heads.num_heads == 4
    acc = json.loads((folder / "config.json").read_text())["specplug"]["head_accuracies"]
    assert len(acc) == 4 and all(len(row) == 4 for row in acc)
    assert all(0.0 <= sum(row) <= 1.0 + 1e-6 for row in acc)  # ranks are exclusive events
    assert acc[0][0] > 0.5  # the counting pattern is learnable (chance: ~1/10)


@pytest.mark.timeout(600)
def test_medusa_compact_form_materialises_bit_exactly(trained, tiny_llama_path, tmp_path):
    _, folder = trained["medusa"]
    small = M.compact(folder, tmp_path / "small", tiny_llama_path)
    assert sorted(p.name for p in small.iterdir()) == ["config.json", M.RESBLOCKS_FILE]
    full = M.materialise(small, tiny_llama_path, tmp_path / "full")
    a, b = formats.load_head(folder), formats.load_head(full)
    assert a.state_dict.keys() == b.state_dict.keys()
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    # `specplug convert` reads the compact form given the target, and says so without it
    from argparse import Namespace

    from specplug.common.formats import cli

    args = Namespace(src=str(small), dst=str(tmp_path / "vllm"), to="vllm-medusa", target=None, overwrite=False,
                     json=False)
    assert cli.run(args) == 2 and not (tmp_path / "vllm").exists()
    assert cli.run(Namespace(**{**vars(args), "target": str(tiny_llama_path)})) == 0
    c = formats.load_head(tmp_path / "vllm")
    assert c.format == "vllm-medusa" and all(torch.equal(a.state_dict[k], c.state_dict[k]) for k in a.state_dict)


@pytest.mark.timeout(600)
def test_resume_continues_from_the_checkpoint(tiny_llama_path, counting_data, tmp_path):
    cfg = _config("eagle3", tiny_llama_path, tmp_path / "h", counting_data, steps=4, checkpoint_every=2)
    T.train(cfg)
    first = formats.load_head(tmp_path / "h").state_dict["d2t"].clone()
    with pytest.raises(ValueError, match="already holds a head or checkpoint"):
        T.train(cfg)
    resumed = T.train(_config("eagle3", tiny_llama_path, tmp_path / "h", counting_data, steps=6, resume=True))
    assert resumed.steps == 6
    state = json.loads((tmp_path / "h" / "checkpoint" / "state.json").read_text())
    assert len(state["losses"]) == 6
    assert torch.equal(formats.load_head(tmp_path / "h").state_dict["d2t"], first)  # never re-derived


@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_init_starts_from_a_trained_head_and_adds_its_training(trained, tiny_llama_path, counting_data, tmp_path,
                                                               method):
    """--init: the new run starts where the trained head ended (first loss well below a
    scratch run's), keeps its draft vocabulary, and training.json totals both runs."""
    result, folder = trained[method]
    out = tmp_path / "more"
    more = T.train(_config(method, tiny_llama_path, out, counting_data, steps=3, init=str(folder)))
    scratch_first = json.loads((folder / "checkpoint" / "state.json").read_text())["losses"][0]
    assert more.first_loss < 0.8 * scratch_first
    record = json.loads((out / "training.json").read_text())
    first = json.loads((folder / "training.json").read_text())
    seen = sum(e["tokens"] for e in first["throughput"]["epochs"])
    assert record["init"] == {"head": str(folder), "steps": 24, "minutes": pytest.approx(result.seconds / 60, abs=0.01),
                              "tokens": seen}
    assert record["total"]["steps"] == 27
    assert record["total"]["tokens"] == seen + sum(e["tokens"] for e in record["throughput"]["epochs"]) > seen
    if method == "eagle3":
        assert torch.equal(formats.load_head(out).state_dict["d2t"], formats.load_head(folder).state_dict["d2t"])
    with pytest.raises(ValueError, match="exclude each other"):
        _config(method, tiny_llama_path, out, counting_data, resume=True, init=str(folder))
    other = trained["medusa" if method == "eagle3" else "eagle3"][1]
    with pytest.raises(ValueError, match=f"holds a {'medusa' if method == 'eagle3' else 'eagle3'} head"):
        T.train(_config(method, tiny_llama_path, tmp_path / "wrong", counting_data, init=str(other)))


@pytest.mark.timeout(600)
def test_init_reads_the_compact_medusa_form(trained, tiny_llama_path, counting_data, tmp_path):
    """--init with a compact Medusa folder (how specplug commits heads: config.json and
    residual blocks only) starts exactly where the full folder starts."""
    from specplug.common.training import medusa

    folder = trained["medusa"][1]
    compact = medusa.compact(folder, tmp_path / "compact", tiny_llama_path)
    full = T.train(_config("medusa", tiny_llama_path, tmp_path / "a", counting_data, steps=2, init=str(folder)))
    small = T.train(_config("medusa", tiny_llama_path, tmp_path / "b", counting_data, steps=2, init=str(compact)))
    assert small.first_loss == full.first_loss and small.last_loss == full.last_loss
    with pytest.raises(ValueError, match="holds a medusa head"):
        T.train(_config("eagle3", tiny_llama_path, tmp_path / "c", counting_data, init=str(compact)))


@pytest.mark.timeout(600)
def test_init_grows_medusa_heads_by_identity_blocks(trained, tiny_llama_path, counting_data, tmp_path):
    """--init with a larger --num-layers appends zero (identity) residual blocks: the grown
    heads compute exactly what HEAD did, so the run starts at the same loss as a plain
    --init; a smaller --num-layers is refused, naming the fix."""
    folder = trained["medusa"][1]
    target = load_target(str(tiny_llama_path))[0]
    heads = M.init_head(folder, target, _config("medusa", tiny_llama_path, tmp_path / "x", counting_data))
    hidden = torch.randn(2, 5, target.config.hidden_size)
    before = heads(hidden)
    big = M.grown(heads, 3)
    assert big.config.medusa_num_layers == 3 and all(len(head) == 4 for head in big)
    assert torch.equal(big(hidden), before)
    same = T.train(_config("medusa", tiny_llama_path, tmp_path / "a", counting_data, steps=2, init=str(folder)))
    deep = T.train(_config("medusa", tiny_llama_path, tmp_path / "b", counting_data, steps=2, init=str(folder),
                           num_layers=2))
    assert deep.first_loss == same.first_loss
    assert json.loads((tmp_path / "b" / "config.json").read_text())["medusa_num_layers"] == 2
    with pytest.raises(ValueError, match="--num-layers 2 or more"):
        T.train(_config("medusa", tiny_llama_path, tmp_path / "c", counting_data, init=str(tmp_path / "b")))


def test_init_grows_an_eagle3_head_by_identity_layers(trained, tiny_llama_path, counting_data, tmp_path):
    """--init with a larger --num-layers appends identity decoder layers (o_proj and
    down_proj zero): the grown head computes exactly what HEAD did, so the run starts at
    the same loss as a plain --init and trains the new layer; the saved head has 2 layers
    and a smaller --num-layers is refused, naming the fix."""
    folder = trained["eagle3"][1]
    target = load_target(str(tiny_llama_path))[0]
    head = E.init_head(folder, target, _config("eagle3", tiny_llama_path, tmp_path / "x", counting_data)).eval()
    ids, hidden = torch.randint(0, 100, (2, 5)), torch.randn(2, 5, head.config.hidden_size)
    pos, mask = torch.arange(5).expand(2, 5), torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5)
    before = head(ids, hidden, pos, mask)
    after = E.grown(head, 3)(ids, hidden, pos, mask)
    assert head.config.num_hidden_layers == 3 and len(head.later_layers()) == 2
    built = Eagle3Head(head.config)  # what --resume builds: the optimizer state indexes parameters() in order
    assert [n for n, _ in head.named_parameters()] == [n for n, _ in built.named_parameters()]
    assert torch.equal(after.hidden, before.hidden) and after.kv[0].shape[1] == 3 * before.kv[0].shape[1]
    same = T.train(_config("eagle3", tiny_llama_path, tmp_path / "a", counting_data, steps=2, init=str(folder)))
    deep = T.train(_config("eagle3", tiny_llama_path, tmp_path / "b", counting_data, steps=2, init=str(folder),
                           num_layers=2))
    assert deep.first_loss == pytest.approx(same.first_loss, rel=1e-6)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["num_hidden_layers"] == 2
    saved = formats.load_head_module(tmp_path / "b", target.config)
    assert saved.layers["1"].self_attn.o_proj.weight.abs().sum() > 0  # the new layer trained
    with pytest.raises(ValueError, match="--num-layers 2 or more"):
        T.train(_config("eagle3", tiny_llama_path, tmp_path / "c", counting_data, init=str(tmp_path / "b")))


def _sitting(cfg, monkeypatch, interrupt_at=None):
    """One `specplug train` sitting; with interrupt_at, SIGINT arrives during that step."""
    import os
    import signal
    update = L._update

    def update_then_interrupt(run, tgt, batch, state):
        update(run, tgt, batch, state)
        if state["step"] == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)

    with monkeypatch.context() as patch:
        patch.setattr(L, "_update", update_then_interrupt)
        return T.train(cfg)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cached", [False, True], ids=["live", "cached"])
def test_resume_reproduces_the_uninterrupted_run_exactly(tiny_llama_path, counting_data, tmp_path, monkeypatch,
                                                         cached):
    """7 steps with reuse 2 in one sitting, against: SIGINT during step 3 (mid target pass),
    a --minutes sitting that makes one step, and a --resume to the end. Same losses, same
    head, bit for bit; the later sittings read the cache the first one wrote."""
    def cfg(out, **kw):
        return _config("eagle3", tiny_llama_path, tmp_path / out, counting_data, steps=7, reuse=2,
                       checkpoint_every=100, states_cache=cached, **kw)

    whole = T.train(cfg("whole"))
    assert whole.stopped is None and whole.steps == whole.schedule_steps == 7
    first = _sitting(cfg("parts", log_file=str(tmp_path / "parts.log"), log_every=1), monkeypatch, interrupt_at=3)
    assert (first.steps, first.stopped, first.files) == (3, "SIGINT", [])  # checkpoint only, no head yet
    if cached:
        monkeypatch.setattr(C, "write_states", lambda *a, **k: pytest.fail("rewrote the cached states"))
    second = T.train(cfg("parts", resume=True, minutes=1e-9))
    assert (second.steps, second.stopped, second.schedule_steps) == (4, "minutes", 7) and second.files
    last = T.train(cfg("parts", resume=True))
    assert last.stopped is None and last.steps == 7
    losses = [json.loads((tmp_path / out / "checkpoint" / "state.json").read_text())["losses"]
              for out in ("whole", "parts")]
    assert len(losses[0]) == 7 and losses[0] == losses[1]
    a, b = formats.load_head(tmp_path / "whole"), formats.load_head(tmp_path / "parts")
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    record = json.loads((tmp_path / "parts" / "training.json").read_text())
    assert record["finished"] and record["schedule_steps"] == 7
    epochs = record["throughput"]["epochs"]  # 4 passes x 4 of the 56 samples: all in epoch 0
    assert [e["steps"] for e in epochs] == [7] and epochs[0]["tokens_per_s"] > 0
    assert (record["throughput"]["states_cache"] is not None) == cached
    log = (tmp_path / "parts.log").read_text()
    assert "step 3/7 epoch 0.14 loss" in log and "tok/s" in log and "eta" in log
    assert "SIGINT received: stopped at step 3 of 7" in log and "--resume" in log


def test_new_flags_reach_the_config(tmp_path):
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["eagle3", "--target", "t", "--out", str(tmp_path), "--epochs", "2.5", "--threads", "1",
                              "--log-file", "x.log", "--log-every", "5", "--states-cache", "/s", "--minutes", "30"])
    cfg = config_from_args(args)
    assert (cfg.epochs, cfg.threads, cfg.log_file, cfg.log_every, cfg.minutes) == (2.5, 1, "x.log", 5, 30.0)
    assert cfg.states_cache and cfg.states_cache_dir == "/s"
    off = config_from_args(parser.parse_args(["medusa", "--target", "t", "--out", "o", "--no-states-cache"]))
    assert not off.states_cache and off.states_cache_dir is None
    with pytest.raises(ValueError, match="exclude each other"):
        config_from_args(parser.parse_args(["medusa", "--target", "t", "--out", "o", "--no-states-cache",
                                            "--states-cache", "/s"]))


def test_clear_errors_before_any_work(tiny_llama_path, counting_data, tmp_path):
    not_lm = tmp_path / "encoder"
    not_lm.mkdir()
    (not_lm / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(ValueError, match="is not a causal LM"):
        T.train(_config("eagle3", not_lm, tmp_path / "o1", counting_data))
    with pytest.raises(ValueError, match="no config.json"):
        T.train(_config("eagle3", tmp_path / "missing", tmp_path / "o2", counting_data))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no conversation with an assistant turn"):
        T.train(_config("medusa", tiny_llama_path, tmp_path / "o3", empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": 5}\n')
    with pytest.raises(ValueError, match="not ShareGPT-style"):
        T.train(_config("medusa", tiny_llama_path, tmp_path / "o4", bad))
    with pytest.raises(ValueError, match="expected 'sharegpt' or a path"):
        T.train(_config("medusa", tiny_llama_path, tmp_path / "o5", tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="holds no checkpoint"):
        T.train(_config("medusa", tiny_llama_path, tmp_path / "o6", counting_data, resume=True))
    with pytest.raises(ValueError, match="exclude each other"):
        _config("medusa", tiny_llama_path, tmp_path / "o7", counting_data, resume=True, overwrite=True)
    from transformers import AutoConfig
    with pytest.raises(ValueError, match="lower --batch-size"):
        check_memory(_config("eagle3", tiny_llama_path, tmp_path / "o8", counting_data),
                     AutoConfig.from_pretrained(tiny_llama_path), available=1 << 20)


def test_draft_vocab_is_the_most_frequent_ids_sorted_and_installed_together():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    ids = E.draft_vocab_ids(counts, 3)
    assert ids.tolist() == [2, 3, 5]
    from specplug.common.heads import Eagle3Config
    head = Eagle3Head(Eagle3Config(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=6, draft_vocab_size=3, target_hidden_size=8))
    lm = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    E.install_draft_vocab(head, ids, lm)
    assert E.draft_token_ids(head).tolist() == [2, 3, 5]
    assert head.t2d.tolist() == [False, False, True, True, False, True]
    assert torch.equal(head.lm_head.weight, lm[[2, 3, 5]])
    with pytest.raises(ValueError, match="strictly ascending"):
        E.install_draft_vocab(head, torch.tensor([3, 2, 5]), lm)


def test_remap_draft_vocab_keeps_trained_rows_and_starts_new_ones_from_the_target():
    """--revocab's move: ids in both vocabularies keep their trained rows, new ids take
    the target's row, and d2t / t2d describe the new vocabulary (negative control: the
    rows of a dropped id are gone)."""
    from specplug.common.heads import Eagle3Config
    head = Eagle3Head(Eagle3Config(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=6, draft_vocab_size=3, target_hidden_size=8))
    lm = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    E.install_draft_vocab(head, torch.tensor([0, 2, 4]), lm)
    with torch.no_grad():
        head.lm_head.weight.copy_(-torch.arange(24, dtype=torch.float32).reshape(3, 8))  # "trained" rows
    trained = head.lm_head.weight.detach().clone()
    assert E.coverage(head, torch.tensor([1, 0, 1, 0, 1, 5])) == pytest.approx(3 / 8)
    kept = E.remap_draft_vocab(head, torch.tensor([2, 4, 5]), lm)
    assert kept == 2
    assert E.draft_token_ids(head).tolist() == [2, 4, 5]
    assert head.t2d.tolist() == [False, False, True, False, True, True]
    assert torch.equal(head.lm_head.weight[:2], trained[1:])  # ids 2 and 4: trained rows
    assert torch.equal(head.lm_head.weight[2], lm[5])  # id 5: the target's row
    assert not (head.lm_head.weight == trained[0]).all(dim=1).any()  # id 0's row dropped
    assert E.coverage(head, torch.tensor([1, 0, 1, 0, 1, 5])) == pytest.approx(7 / 8)


@pytest.mark.timeout(600)
def test_revocab_moves_an_init_head_to_this_runs_vocabulary(trained, tiny_llama_path, tmp_path):
    """--init HEAD --revocab on replies in other words: the run's head drafts every token
    of the new replies, HEAD did not; without --init (or for Medusa) the flag is refused
    before any work."""
    folder = trained["eagle3"][1]
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
    data = tmp_path / "words.jsonl"
    rows = [{"conversations": [{"from": "human", "value": "spell " + words[i % 12]},
                               {"from": "gpt", "value": " ".join(words[(i + j) % 12] for j in range(20))}]}
            for i in range(40)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    replies = torch.tensor(sorted({t for r in rows for t in tokenizer(r["conversations"][1]["value"],
                                                                      add_special_tokens=False)["input_ids"]}))
    before = formats.load_head(folder).state_dict["t2d"].bool()
    assert not before[replies].all()
    out = tmp_path / "revocab"
    T.train(_config("eagle3", tiny_llama_path, out, data, steps=2, init=str(folder), revocab=True))
    assert formats.load_head(out).state_dict["t2d"].bool()[replies].all()
    for kw in (dict(method="eagle3"), dict(method="medusa", init=str(folder))):
        with pytest.raises(ValueError, match="--revocab"):
            _config(kw.pop("method"), tiny_llama_path, tmp_path / "x", data, revocab=True, **kw)


def test_ttt_mask_is_causal_then_diagonal():
    attn = torch.tensor([[1, 1, 1, 0]])
    mask = E.ttt_mask(attn, 2)  # [1, 4, 12]
    assert mask.shape == (1, 4, 12)
    assert mask[0, 2, :4].tolist() == [True, True, True, False]
    assert mask[0, 3, :4].tolist() == [True, True, True, False]  # padding key never visible
    assert torch.equal(mask[0, :, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(mask[0, :, 8:], torch.eye(4, dtype=torch.bool))


def test_assistant_mask_covers_replies_only(tiny_llama_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    msgs = [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three four"}]
    sample = tokenize_conversation(tok, msgs, 64)
    masked = tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert masked.strip().startswith("three four") and "<|im_end|>" in masked and "one" not in masked


def test_eagle3_aux_layers_must_be_distinct_and_ascending(tiny_llama_path, counting_data, tmp_path):
    with pytest.raises(ValueError, match="3 distinct ascending ids"):  # default (2, 2, 1) for 4 layers
        T.train(_config("eagle3", tiny_llama_path, tmp_path / "o", counting_data, aux_layer_ids=None))
    with pytest.raises(ValueError, match="3 distinct ascending ids"):
        T.train(_config("eagle3", tiny_llama_path, tmp_path / "o", counting_data, aux_layer_ids=(1, 2, 4)))


# ---------------------------------------------------------------------------------------
# --regenerate (self-distillation)
# ---------------------------------------------------------------------------------------
def _greedy_reply(target, tokenizer, prompt, max_length):
    """Reference: a plain argmax loop on one unpadded prompt (no generate(), no batching)."""
    from specplug.common.training.data import format_chat
    ids = tokenizer(format_chat(tokenizer, prompt), add_special_tokens=False)["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(max_length - len(ids)):
            token = int(target(torch.tensor([ids + new])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
    return tokenizer.decode(new, skip_special_tokens=True).strip(), len(ids)


@pytest.mark.timeout(600)
def test_regenerate_writes_the_targets_greedy_reply_and_caches_it(tiny_llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLUG_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text("")  # only its name, size and mtime enter the cache key here
    target, tok = load_target(str(tiny_llama_path))
    tok.pad_token = tok.eos_token  # pad == <|im_end|>, as in ChatML models: it must not mask the prompt's end tokens
    convs = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "count from one two three"},
              {"role": "assistant", "content": "data reply"}, {"role": "user", "content": "later turn"}],
             [{"role": "user", "content": "seven"}, {"role": "assistant", "content": "other"}],
             [{"role": "user", "content": "nine ten"}, {"role": "assistant", "content": "x"}]]
    cfg = _config("medusa", tiny_llama_path, tmp_path / "o", data, batch_size=2, max_length=80, regenerate=True)
    out = R.regenerate(target, tok, convs, cfg)  # batches of 2 prompts of different lengths: left padding
    assert [c[:-1] for c in out] == [convs[0][:2], convs[1][:1], convs[2][:1]]  # first prompt kept, data reply gone
    lengths = [_greedy_reply(target, tok, c[:-1], 80)[1] for c in out]
    for i, conv in enumerate(out):
        assert conv[-1]["role"] == "assistant"
        expected, _ = _greedy_reply(target, tok, conv[:-1], 80 - max(lengths) + lengths[i])
        # the batch generates max_length - (shortest prompt in its batch) tokens: at least the reference's
        assert conv[-1]["content"].startswith(expected) and len(expected) > 0, (i, conv[-1]["content"], expected)
    assert R.regenerate_cache_path(cfg).is_file()

    def must_not_run(*a, **k):
        raise AssertionError("regenerated although the cache holds the replies")
    monkeypatch.setattr(R, "_generate_replies", must_not_run)
    assert R.regenerate(target, tok, convs, cfg) == out  # second call: read from the cache
    other = _config("medusa", tiny_llama_path, tmp_path / "o", data, batch_size=2, max_length=88, regenerate=True)
    assert R.regenerate_cache_path(other) != R.regenerate_cache_path(cfg)  # max-length is part of the key


def test_regenerate_skips_leading_replies_and_drops_conversations_without_a_prompt(tiny_llama_path, tmp_path,
                                                                                  monkeypatch):
    """ShareGPT has conversations that open with a reply (or hold nothing else): the prompt
    starts after the leading replies; one with no prompt at all, or a prompt too long to
    leave room for a reply, comes back empty."""
    monkeypatch.setenv("SPECPLUG_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text("")
    answered: list[str] = []
    monkeypatch.setattr(R, "_generate_replies", lambda target, tok, texts, cfg: answered.extend(texts) or
                        ["R"] * len(texts))
    _, tok = load_target(str(tiny_llama_path))
    convs = [[{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "data"}],
             [{"role": "assistant", "content": "only a reply"}],
             [{"role": "user", "content": "two"}, {"role": "assistant", "content": "data"}],
             [{"role": "user", "content": "long " * 40}, {"role": "assistant", "content": "data"}]]
    cfg = _config("medusa", tiny_llama_path, tmp_path / "o", data, batch_size=2, max_length=40, regenerate=True)
    out = R.regenerate(None, tok, convs, cfg)  # the last prompt is over max_length / 2 tokens: dropped
    assert out == [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "R"}], [],
                   [{"role": "user", "content": "two"}, {"role": "assistant", "content": "R"}], []]
    assert len(answered) == 2 and tokenize_conversation(tok, out[1], 40) is None


@pytest.mark.timeout(600)
def test_regenerate_training_run_writes_a_loadable_head(tiny_llama_path, counting_data, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLUG_CACHE", str(tmp_path / "cache"))
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["medusa", "--target", str(tiny_llama_path), "--out", str(tmp_path / "m"),
                              "--data", str(counting_data), "--regenerate"])
    assert config_from_args(args).regenerate and config_from_args(args).regen_temperature == 0.0
    for method in ("medusa", "eagle3"):
        cfg = _config(method, tiny_llama_path, tmp_path / method, counting_data, steps=3, max_samples=6,
                      regenerate=True)
        result = T.train(cfg)
        assert result.steps == 3
        head = formats.load_head_module(tmp_path / method, str(tiny_llama_path))
        assert isinstance(head, MedusaHeads if method == "medusa" else Eagle3Head)
        assert json.loads((tmp_path / method / "training.json").read_text())["config"]["regenerate"] is True
    cached = json.loads(R.regenerate_cache_path(cfg).read_text())  # both runs share one cache file
    assert len(cached) == 6 + 4 and all(c[-1]["role"] == "assistant" for c in cached)
    assert len(list((tmp_path / "cache" / "regenerated").glob("*.json"))) == 1


def test_learning_rate_follows_the_step_schedule_only(tmp_path):
    """Warm-up, then cosine to 10% of the peak at the schedule's last step; --epochs converts
    to steps, and --minutes (a per-sitting budget) never changes the schedule."""
    cfg = TrainConfig("medusa", "t", str(tmp_path), steps=110, warmup_steps=10, lr=1.0)
    schedule = cfg.schedule_steps(50)
    assert schedule == 110
    assert L.lr_at(0, cfg, schedule) == pytest.approx(0.1) and L.lr_at(10, cfg, schedule) == pytest.approx(1.0)
    assert L.lr_at(60, cfg, schedule) == pytest.approx(0.55) and L.lr_at(110, cfg, schedule) == pytest.approx(0.1)
    epochs = TrainConfig("medusa", "t", str(tmp_path), epochs=2, batch_size=4, reuse=3)
    assert epochs.schedule_steps(10) == 5 * 3  # ceil(2 * 10 / 4) target passes x reuse
    minutes = TrainConfig("medusa", "t", str(tmp_path), minutes=10)
    assert minutes.schedule_steps(10) == 1000 and TrainConfig("medusa", "t", str(tmp_path)).schedule_steps(1) == 1000
    with pytest.raises(ValueError, match="exclude --steps"):
        TrainConfig("medusa", "t", str(tmp_path), steps=5, epochs=1)


def test_each_epoch_visits_every_sample_once_in_its_own_order():
    n, batch = 10, 4  # 10 steps = 4 epochs
    order = [i for step in range(10) for i in batch_indices(step, batch, n, seed=3)]
    epochs = [order[e * n:(e + 1) * n] for e in range(4)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4  # reshuffled every epoch
    assert batch_indices(7, batch, n, seed=3) == batch_indices(7, batch, n, seed=3)  # pure
    assert batch_indices(2, batch, n) == [8, 9, 0, 1]  # seed None: in order, wrapping
