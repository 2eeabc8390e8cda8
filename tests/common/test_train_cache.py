"""Cached target states (`specplug.common.training.states`) on the tiny Llama: the cache holds
exactly the target's states in bf16, training from it gives the loss of bf16-rounded live
states, a cache made for other settings is refused by name, and an interrupted write
resumes without re-running finished shards."""

import json
import shutil

import pytest
import torch

from specplug.common.training import train as T
from specplug.common.training import states as C
from specplug.common.training import eagle3 as E
from specplug.common.training import medusa as M
from specplug.common.training.samples import batch_indices, build_samples, collate, load_conversations
from specplug.common.training.target import TargetOutput, load_target, target_pass
from tests.common.test_train import _config, counting_data  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")

AUX = (1, 2, 3)
SHARD_BYTES = 64 << 10  # several shards for 20 tiny samples (~640 bytes per token)


@pytest.fixture(scope="module")
def tiny(tiny_llama_path, counting_data):  # noqa: F811
    """(target, tokenizer, training samples, pad id) of the tiny Llama on the counting data."""
    target, tok = load_target(str(tiny_llama_path))
    cfg = _config("eagle3", tiny_llama_path, "unused", counting_data, max_samples=20)
    samples, _ = build_samples(tok, load_conversations(cfg.data), cfg)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return target, tok, samples, pad_id


def _open(tiny_llama_path, counting_data, folder, tiny, aux=AUX, samples=None, **kw):  # noqa: F811
    target, _, all_samples, pad_id = tiny
    cfg = _config("eagle3", tiny_llama_path, "unused", counting_data, states_cache_dir=str(folder), **kw)
    return C.open_states(cfg, target, samples or all_samples, aux, pad_id, shard_bytes=SHARD_BYTES)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).view(torch.int16)


def test_round_trip_is_the_target_pass_in_bf16_bit_for_bit(tiny_llama_path, counting_data, tiny, tmp_path):
    target, _, samples, pad_id = tiny
    reader, info = _open(tiny_llama_path, counting_data, tmp_path / "s", tiny)
    manifest = json.loads((tmp_path / "s" / C.MANIFEST).read_text())
    assert info["written"] and manifest["complete"] and len(manifest["shards"]) >= 3
    assert manifest["num_samples"] == len(samples) and manifest["aux_layer_ids"] == list(AUX)
    assert manifest["hidden_size"] == 128 and manifest["key"]["samples_sha256"] == C.samples_digest(samples)
    checked = 0
    for shard in manifest["shards"]:  # the writer's batches: batch_size consecutive samples of a shard
        end = shard["first_sample"] + shard["num_samples"]
        for first in range(shard["first_sample"], end, 4):
            ids = list(range(first, min(first + 4, end)))
            batch = collate([samples[i] for i in ids], pad_id)
            live = target_pass(target, batch, AUX)
            cached = reader.target_output(ids, batch.input_ids.shape[1])
            real = batch.attention_mask.bool()  # [b, T]
            assert cached.logits is None and cached.aux.dtype == torch.float32
            assert torch.equal(_bits(cached.aux)[real], _bits(live.aux)[real])
            assert torch.equal(_bits(cached.last_hidden)[real], _bits(live.last_hidden)[real])
            assert torch.equal(cached.argmax()[real], live.logits.argmax(-1)[real])
            assert not cached.last_hidden[~real].any()  # right padding is zeros
            checked += len(ids)
    assert checked == len(samples)
    again, info = _open(tiny_llama_path, counting_data, tmp_path / "s", tiny)  # reused, not rewritten
    assert not info["written"]
    assert torch.equal(again.target_output([0, 5], 48).aux, reader.target_output([0, 5], 48).aux)


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_loss_from_the_cache_equals_the_loss_on_bf16_rounded_live_states(tiny_llama_path, counting_data, tiny,
                                                                         tmp_path, method):
    """Same batch, same head: the cached view's loss equals the loss on live states rounded
    to bf16 (up to fp32 summation order: EAGLE-3 multiplies by the draft-vocab rows only),
    and stays within 0.2% of the live fp32 loss (measured: 4e-5 EAGLE-3, 3e-4 Medusa). The accuracy uses
    the target's own top-1."""
    target, _, samples, pad_id = tiny
    module = E if method == "eagle3" else M
    cfg = _config(method, tiny_llama_path, "unused", counting_data)
    torch.manual_seed(0)
    head = module.build_head(target, samples, cfg)
    aux = module.aux_ids(head, target)
    reader, _ = _open(tiny_llama_path, counting_data, tmp_path / "s", tiny, aux=aux)
    for index in range(3):
        ids = batch_indices(index, 4, len(samples))
        batch = collate([samples[i] for i in ids], pad_id)
        live = target_pass(target, batch, aux)
        last = live.last_hidden.to(torch.bfloat16).float()
        rounded = TargetOutput(last, target.get_output_embeddings()(last).float(),
                               live.aux.to(torch.bfloat16).float() if aux else None)
        cached_loss, cached_acc = module.loss(head, reader.target_output(ids, batch.input_ids.shape[1]), batch, cfg)
        rounded_loss, _ = module.loss(head, rounded, batch, cfg)
        live_loss, live_acc = module.loss(head, live, batch, cfg)
        assert cached_loss.item() == pytest.approx(rounded_loss.item(), rel=1e-6)
        assert cached_loss.item() == pytest.approx(live_loss.item(), rel=2e-3)
        assert torch.allclose(cached_acc, live_acc, atol=0.05)  # same top-1 labels; the draft's argmax may move


def test_a_cache_for_another_target_samples_or_aux_layers_is_refused_by_name(tiny_llama_path, counting_data, tiny,
                                                                              tmp_path):
    _, _, samples, _ = tiny
    folder = tmp_path / "s"
    _open(tiny_llama_path, counting_data, folder, tiny)
    other_target = tmp_path / "other-target"
    shutil.copytree(tiny_llama_path, other_target)
    (other_target / "config.json").write_text((other_target / "config.json").read_text().replace("\n", "\n\n", 1))
    with pytest.raises(ValueError, match=r"target = .*target_config_sha256 = .*delete") as refused:
        _open(other_target, counting_data, folder, tiny)
    assert "another --states-cache folder" in str(refused.value)
    with pytest.raises(ValueError, match=r"num_samples = .*samples_sha256 = the training samples' token ids"):
        _open(tiny_llama_path, counting_data, folder, tiny, samples=samples[:-1])
    with pytest.raises(ValueError,
                       match=r"aux_layer_ids = the EAGLE-3 aux layers .*cached \[1, 2, 3\], this run \[0, 1, 2\]"):
        _open(tiny_llama_path, counting_data, folder, tiny, aux=(0, 1, 2))
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds files .* but no manifest.json"):
        _open(tiny_llama_path, counting_data, stranger, tiny)
    # the whole run refuses too, before training: other --max-samples = other samples
    cfg = _config("eagle3", tiny_llama_path, tmp_path / "o", counting_data, max_samples=12, steps=2,
                  states_cache_dir=str(folder))
    with pytest.raises(ValueError, match="samples_sha256"):
        T.train(cfg)


def test_an_interrupted_write_resumes_at_the_first_missing_shard(tiny_llama_path, counting_data, tiny, tmp_path,
                                                                  monkeypatch):
    folder = tmp_path / "s"
    original, written = C._write_shard, []

    def write_two_then_crash(target, samples, folder, manifest, shard, batching, bar):
        if len(written) == 2:
            raise KeyboardInterrupt("killed mid-write")
        original(target, samples, folder, manifest, shard, batching, bar)
        written.append(shard["file"])

    monkeypatch.setattr(C, "_write_shard", write_two_then_crash)
    with pytest.raises(KeyboardInterrupt):
        _open(tiny_llama_path, counting_data, folder, tiny)
    manifest = json.loads((folder / C.MANIFEST).read_text())
    assert not manifest["complete"] and len(manifest["shards"]) > 2
    with pytest.raises(ValueError, match="incomplete"):
        C.StatesReader(folder, manifest, "cpu", torch.float32, None)
    monkeypatch.setattr(C, "_write_shard", lambda *a: (written.append(a[4]["file"]), original(*a)))
    reader, info = _open(tiny_llama_path, counting_data, folder, tiny)
    assert info["written"] and written[2:] == [s["file"] for s in manifest["shards"][2:]]  # only the missing ones
    fresh, _ = _open(tiny_llama_path, counting_data, tmp_path / "fresh", tiny)
    ids = list(range(len(tiny[2])))
    a, b = reader.target_output(ids, 48), fresh.target_output(ids, 48)
    assert torch.equal(a.aux, b.aux) and torch.equal(a.last_hidden, b.last_hidden) and torch.equal(a.top1, b.top1)
