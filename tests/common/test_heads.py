"""Eagle3Head / Eagle1Head / MedusaHeads: canonical names, config round trips, the EAGLE-3
and EAGLE-1 math, cache and tree-mask consistency, strict loading."""

import math
import re

import pytest
import torch

from specplug.common.heads import Eagle1Config, Eagle1Head, Eagle3Config, Eagle3Head, MedusaConfig, MedusaHeads
from specplug.common.heads.eagle3 import check_capture_order, d2t_to_t2d, rope_inv_freq

SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100, draft_vocab_size=40, target_hidden_size=24)

EAGLE3_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                       "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
}


def randomized(head, seed=0):
    """`head` with N(0, 0.3) matrices and norms away from 1 (so a swapped norm shows up), in eval mode."""
    torch.manual_seed(seed)
    for p in head.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.5, 1.5)
    return head.eval()


def make_head(seed=0, **kw) -> Eagle3Head:
    return randomized(Eagle3Head(Eagle3Config(**{**SMALL, **kw}), own_embedding=True), seed)


def causal(t, past=0):
    return torch.ones(t, past + t, dtype=torch.bool).tril(past)[None]


# -- config ------------------------------------------------------------------------------
def test_eagle3_config_round_trip_keeps_unknown_keys_and_specplug():
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
           "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 100, "draft_vocab_size": 40, "target_hidden_size": 24, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "torch_dtype": "bfloat16", "bos_token_id": 1,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True},
           "specplug": {"version": 1, "method": "eagle3", "verification": "lossless"}}
    cfg = Eagle3Config.from_dict(raw)
    assert cfg.aux_layer_ids == (1, 3, 5) and cfg.head_dim == 8 and cfg.fc_input_size == 72
    out = cfg.to_dict()
    assert {k: out[k] for k in raw} == {**raw}
    assert Eagle3Config.from_dict(out) == cfg


def test_eagle3_config_defaults_and_errors():
    cfg = Eagle3Config.from_dict({"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                                  "vocab_size": 100})
    assert cfg.draft_vocab_size == 100 and cfg.target_hidden_size == 32 and cfg.num_key_value_heads == 4
    assert cfg.resolved_aux_layer_ids(30) == (2, 15, 27)
    with pytest.raises(ValueError, match="outside"):
        Eagle3Config(**SMALL, aux_layer_ids=(1, 2, 9)).resolved_aux_layer_ids(8)
    with pytest.raises(ValueError, match="num_hidden_layers must be an int >= 1"):
        Eagle3Config.from_dict({**SMALL, "num_hidden_layers": 0})
    assert Eagle3Config.from_dict({**SMALL, "num_hidden_layers": 2}).to_dict()["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="architectures"):
        Eagle3Config.from_dict({**SMALL, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="missing"):
        Eagle3Config.from_dict({"hidden_size": 32})


@pytest.mark.parametrize("ids", [[2, 15, 9], [4, 4, 9]])
def test_aux_layer_ids_out_of_order_or_repeated_are_refused_naming_the_engine(ids):
    message = re.escape(f"{ids} must be distinct and ascending: vLLM captures") + r".*\(config.json of H\)"
    with pytest.raises(ValueError, match=message):
        check_capture_order(ids, "vLLM", "config.json of H")
    check_capture_order(sorted(set(ids)), "vLLM", "config.json of H")  # the sorted head passes
    check_capture_order(None, "vLLM", "config.json of H")  # no ids in the config: nothing to check


def test_for_target_copies_the_target_shape(tiny_llama_path):
    from transformers import AutoConfig
    target = AutoConfig.from_pretrained(tiny_llama_path)
    cfg = Eagle3Config.for_target(target, draft_vocab_size=64)
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size, cfg.draft_vocab_size) == \
        (target.hidden_size, target.num_key_value_heads, target.vocab_size, 64)
    assert cfg.resolved_aux_layer_ids(target.num_hidden_layers) == (2, 2, 1)


# -- state dict ---------------------------------------------------------------------------
def test_eagle3_state_dict_names_are_eagle_specforge():
    head = Eagle3Head(Eagle3Config(**SMALL))
    sd = head.state_dict()
    assert set(sd) == EAGLE3_KEYS
    assert sd["fc.weight"].shape == (32, 72) and sd["lm_head.weight"].shape == (40, 32)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # q/k/v read 2H
    assert sd["d2t"].dtype == torch.long and sd["t2d"].dtype == torch.bool
    assert "embed_tokens.weight" in Eagle3Head(Eagle3Config(**SMALL), own_embedding=True).state_dict()


def test_eagle3_from_state_dict_strict():
    head = make_head()
    sd = head.state_dict()
    again = Eagle3Head.from_state_dict(head.config, sd)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in sd.items())
    with pytest.raises(ValueError, match=r"missing keys \['norm.weight'\]"):
        Eagle3Head.from_state_dict(head.config, {k: v for k, v in sd.items() if k != "norm.weight"})
    with pytest.raises(ValueError, match="unexpected keys.*layers.0"):
        Eagle3Head.from_state_dict(head.config, {**sd, "layers.0.foo": sd["norm.weight"]})
    with pytest.raises(ValueError, match="fc.weight has shape"):
        Eagle3Head.from_state_dict(head.config, {**sd, "fc.weight": sd["fc.weight"][:, :10]})
    no_t2d = {k: v for k, v in sd.items() if k != "t2d"}
    assert torch.equal(Eagle3Head.from_state_dict(head.config, no_t2d).t2d, sd["t2d"])


def test_eagle3_from_state_dict_takes_weight_dtype():
    head = make_head()
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in head.state_dict().items()}
    loaded = Eagle3Head.from_state_dict(head.config, sd)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.d2t.dtype == torch.long
    assert loaded.inv_freq.dtype == torch.float32


def test_d2t_t2d_mapping():
    head = Eagle3Head(Eagle3Config(**SMALL))
    target_ids = torch.tensor([3, 7, 8, 20, 50, 51, 60, 99] + list(range(100, 132)))[:40] % 100
    target_ids = torch.unique(torch.cat([target_ids, torch.arange(40)]))[:40]
    head.d2t.copy_(target_ids - torch.arange(40))
    head.t2d.copy_(d2t_to_t2d(head.d2t, 100))
    assert torch.equal(head.to_target_ids(torch.arange(40)), target_ids)
    assert head.t2d.sum() == 40 and head.t2d[target_ids].all()
    logits = torch.randn(2, 40)
    full = head.target_logits(logits)  # [2, 100]
    assert torch.equal(full[:, target_ids], logits) and torch.isinf(full[:, ~head.t2d]).all()
    assert torch.equal(full.argmax(-1), head.to_target_ids(logits.argmax(-1)))


def test_shared_target_embedding():
    head = Eagle3Head(Eagle3Config(**SMALL))
    with pytest.raises(ValueError, match="set_target_embedding"):
        head.embed(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="another target"):
        head.set_target_embedding(torch.nn.Embedding(99, 32))
    emb = torch.nn.Embedding(100, 32)
    head.set_target_embedding(emb)
    assert torch.equal(head.embed(torch.tensor([[5]]))[0, 0], emb.weight[5])
    assert "embed_tokens.weight" not in head.state_dict()


# -- math ---------------------------------------------------------------------------------
def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_attention(c, attn, x, pos):
    """Causal Llama attention with RoPE, one sequence: x [t, In] -> o_proj output [t, H]."""
    t, d, nh, nkv = len(x), c.head_dim, c.num_attention_heads, c.num_key_value_heads
    q = (x @ attn.q_proj.weight.T).view(t, nh, d)
    k = (x @ attn.k_proj.weight.T).view(t, nkv, d)
    v = (x @ attn.v_proj.weight.T).view(t, nkv, d)
    ang = pos[:, None].float() * rope_inv_freq(c)  # [t, d/2]
    cos, sin = ang.cos().repeat(1, 2)[:, None], ang.sin().repeat(1, 2)[:, None]
    rot = lambda z: torch.cat([-z[..., d // 2:], z[..., : d // 2]], -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(t, nh * d) @ attn.o_proj.weight.T


def reference_mlp(c, layer, r):
    """r + mlp(post_attention_layernorm(r))."""
    m, h = layer.mlp, rms(r, layer.post_attention_layernorm.weight, c.rms_norm_eps)
    return (torch.nn.functional.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T + r


def reference_step(head, ids, g, pos):
    """EAGLE-3 midlayer, then any later layers, written out from vLLM's llama_eagle3.py,
    one sequence, causal."""
    c, L = head.config, head.midlayer
    e = head.embed(ids[None])[0]
    x = torch.cat([rms(e, L.input_layernorm.weight, c.rms_norm_eps), rms(g, L.hidden_norm.weight, c.rms_norm_eps)], -1)
    out = reference_mlp(c, L, reference_attention(c, L.self_attn, x, pos) + g)
    for later in head.later_layers():
        r = reference_attention(c, later.self_attn, rms(out, later.input_layernorm.weight, c.rms_norm_eps), pos) + out
        out = reference_mlp(c, later, r)
    return out, rms(out, head.norm.weight, c.rms_norm_eps)


@pytest.mark.parametrize("layers", [1, 3])
def test_eagle3_forward_matches_written_out_math(layers):
    head = make_head(num_hidden_layers=layers)
    torch.manual_seed(1)
    ids, aux, pos = torch.randint(0, 100, (5,)), torch.randn(5, 72), torch.arange(3, 8)
    g = head.combine(aux)
    out = head(ids[None], g[None], pos[None], causal(5))
    ref_hidden, ref_normed = reference_step(head, ids, g, pos)
    torch.testing.assert_close(out.hidden[0], ref_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.normed[0], ref_normed, rtol=1e-4, atol=1e-4)
    assert head.compute_logits(out.normed).shape == (1, 5, 40)
    assert out.kv[0].shape == (1, 2 * layers, 5, 8)  # every layer's kv heads, side by side


def test_multi_layer_eagle3_names_are_vllms():
    """Layers after the midlayer are layers.1, layers.2, .. (vLLM's names; q/k/v read H)."""
    head = Eagle3Head(Eagle3Config(**SMALL, num_hidden_layers=3))
    later = set(head.state_dict()) - EAGLE3_KEYS
    assert later == {f"layers.{i}.{n}.weight" for i in (1, 2) for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert head.state_dict()["layers.2.self_attn.k_proj.weight"].shape == (16, 32)
    assert head.config.cache_kv_heads == 6


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
                                          {"rope_type": "linear", "factor": 2.0}])
def test_rope_matches_transformers(rope_scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = Eagle3Config(**SMALL, rope_theta=500000.0, rope_scaling=rope_scaling)
    hf = LlamaConfig(hidden_size=32, num_attention_heads=4, rope_theta=500000.0, rope_scaling=rope_scaling,
                     max_position_embeddings=4096)
    torch.testing.assert_close(rope_inv_freq(cfg), LlamaRotaryEmbedding(hf).inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("layers", [1, 2])
def test_incremental_cache_equals_full_forward(layers):
    """Feeding tokens one at a time with the returned (k, v) gives the full-pass result."""
    head = make_head(num_hidden_layers=layers)
    ids, g, pos = torch.randint(0, 100, (1, 6)), torch.randn(1, 6, 32), torch.arange(6)[None]
    full = head(ids, g, pos, causal(6))
    k = v = None
    for t in range(6):
        past = None if k is None else (k, v)
        step = head(ids[:, t:t + 1], g[:, t:t + 1], pos[:, t:t + 1], causal(1, t), past)
        k = step.kv[0] if k is None else torch.cat([k, step.kv[0]], 2)
        v = step.kv[1] if v is None else torch.cat([v, step.kv[1]], 2)
        torch.testing.assert_close(step.hidden[0, 0], full.hidden[0, t], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layers", [1, 2])
def test_tree_mask_equals_each_path_as_a_chain(layers):
    """Nodes of a tree drafted in one pass (ancestor mask, depth positions) get the same
    outputs as their root->node path run as a chain; a batch of two gives the same rows."""
    head = make_head(num_hidden_layers=layers)
    parents = [-1, 0, 0, 1, 2]  # node 0 is the first tree input after a 3-entry past
    ids, g = torch.randint(0, 100, (1, 5)), torch.randn(1, 5, 32)
    past_ids, past_g = torch.randint(0, 100, (1, 3)), torch.randn(1, 3, 32)
    past = head(past_ids, past_g, torch.arange(3)[None], causal(3)).kv
    anc = torch.eye(5, dtype=torch.bool)
    depth = [0] * 5
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
            depth[i] = depth[p] + 1
    mask = torch.cat([torch.ones(5, 3, dtype=torch.bool), anc], 1)[None]
    pos = 3 + torch.tensor(depth)[None]
    tree = head(ids, g, pos, mask, past)
    for node in range(5):
        path = anc[node].nonzero().flatten()
        n = len(path)
        chain = head(ids[:, path], g[:, path], torch.arange(3, 3 + n)[None], causal(n, 3), past)
        torch.testing.assert_close(tree.hidden[0, node], chain.hidden[0, -1], rtol=1e-4, atol=1e-4)
    both = head(ids.repeat(2, 1), g.repeat(2, 1, 1), pos.repeat(2, 1), mask.repeat(2, 1, 1),
                tuple(x.repeat(2, 1, 1, 1) for x in past))
    torch.testing.assert_close(both.hidden[1], tree.hidden[0], rtol=1e-5, atol=1e-4)  # fp32 rounding of batched matmuls


def test_norm_before_residual_changes_the_output():
    a, b = make_head(), make_head(norm_before_residual=True)
    args = (torch.tensor([[1, 2]]), torch.randn(1, 2, 32) * 3, torch.arange(2)[None], causal(2))
    assert not torch.allclose(a(*args).hidden, b(*args).hidden)
    assert b.config.to_dict()["norm_before_residual"] is True  # top level: where vLLM reads it
    assert Eagle3Config.from_dict(b.config.to_dict()).norm_before_residual


# -- EAGLE-1 ------------------------------------------------------------------------------
EAGLE1 = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
EAGLE1_KEYS = {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
               *(f"layers.0.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                  "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                  "mlp.down_proj"))}


def make_eagle1_head(seed=0, **kw) -> tuple[Eagle1Head, torch.nn.Linear]:
    """A random EAGLE-1 head with its own embedding, and the stand-in target lm_head it scores with."""
    head = randomized(Eagle1Head(Eagle1Config(**{**EAGLE1, "fc_bias": True, **kw}), own_embedding=True), seed)
    lm_head = torch.nn.Linear(32, 100, bias=False)
    head.set_target_lm_head(lm_head)
    return head, lm_head


def test_eagle1_names_config_round_trip_and_interface():
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, **EAGLE1,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "bias": False, "torch_dtype": "float16",
           "pretraining_tp": 1, "specplug": {"version": 1}}
    cfg = Eagle1Config.from_dict(raw)
    assert (cfg.fc_bias, cfg.head_dim, cfg.draft_vocab_size) == (False, 8, 100)
    out = cfg.to_dict()
    assert {k: out[k] for k in raw} == raw and Eagle1Config.from_dict(out) == cfg
    assert cfg.resolved_aux_layer_ids(30) == (30,)  # HF hidden_states[L]: the final-norm output
    head = Eagle1Head(Eagle1Config(**EAGLE1))
    assert set(head.state_dict()) == EAGLE1_KEYS  # no bias key: the EAGLE repo's default fc bias
    assert head.state_dict()["layers.0.self_attn.q_proj.weight"].shape == (32, 32)  # q/k/v read H
    assert head.state_dict()["fc.weight"].shape == (32, 64)
    assert "fc.bias" not in Eagle1Head(cfg).state_dict()
    ids = torch.tensor([[3, 99]])
    assert torch.equal(head.to_target_ids(ids), ids)
    feature = torch.randn(2, 32, dtype=torch.float64)
    assert torch.equal(head.combine(feature), feature.float())


def test_eagle1_config_errors():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        Eagle1Config.from_dict({**EAGLE1, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="not an EAGLE-1 head"):
        Eagle1Config.from_dict({**EAGLE1, "architectures": ["LlamaForCausalLMEagle3"]})
    with pytest.raises(ValueError, match="missing"):
        Eagle1Config.from_dict({"hidden_size": 32})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Eagle1Config(**{**EAGLE1, "num_key_value_heads": 3})
    head = Eagle1Head(Eagle1Config(**EAGLE1))
    with pytest.raises(ValueError, match="set_target_lm_head"):
        head.compute_logits(torch.zeros(1, 32))
    with pytest.raises(ValueError, match=r"target lm_head must be \[vocab_size, hidden_size\] = \[100, 32\]"):
        head.set_target_lm_head(torch.nn.Linear(32, 99, bias=False))
    with pytest.raises(ValueError, match="set_target_embedding"):
        head.embed(torch.tensor([[1]]))


def test_eagle1_from_state_dict_strict_and_bias_from_weights():
    head, _ = make_eagle1_head()
    sd = head.state_dict()
    again = Eagle1Head.from_state_dict(Eagle1Config(**EAGLE1), sd)  # fc_bias None: the weights decide
    assert again.config.fc_bias is True and all(torch.equal(v, again.state_dict()[k]) for k, v in sd.items())
    unbiased = Eagle1Head.from_state_dict(Eagle1Config(**EAGLE1), {k: v for k, v in sd.items() if k != "fc.bias"})
    assert unbiased.fc.bias is None and "embed_tokens.weight" in unbiased.state_dict()
    with pytest.raises(ValueError, match=r"unexpected keys \['fc.bias'\]"):
        Eagle1Head.from_state_dict(Eagle1Config(**EAGLE1, fc_bias=False), sd)
    with pytest.raises(ValueError, match="fc.weight has shape"):
        Eagle1Head.from_state_dict(head.config, {**sd, "fc.weight": torch.zeros(32, 96)})
    half = Eagle1Head.from_state_dict(head.config, {k: v.half() for k, v in sd.items()})
    assert half.fc.weight.dtype == torch.float16 and half.inv_freq.dtype == torch.float32


def test_eagle1_forward_matches_hand_computation_at_one_position():
    """One position attends only to itself (softmax weight 1, so RoPE drops out):
    x = fc([emb; f]), a = o(v(x)) + x (no input norm), r = mlp(post_norm(a)) + a,
    logits = target lm_head(r) with no norm."""
    head, lm_head = make_eagle1_head()
    layer, eps = head.layers[0], head.config.rms_norm_eps
    token, feature = 7, torch.randn(32)
    out = head(torch.tensor([[token]]), feature[None, None], torch.tensor([[5]]), causal(1))
    x = head.fc.weight @ torch.cat([head.embed_tokens.weight[token], feature]) + head.fc.bias
    v = (layer.self_attn.v_proj.weight @ x).view(2, 8)  # [kv_heads, head_dim]
    a = layer.self_attn.o_proj.weight @ v.repeat_interleave(2, 0).flatten() + x  # query head h reads kv head h // 2
    n = rms(a, layer.post_attention_layernorm.weight, eps)
    m = layer.mlp
    r = m.down_proj.weight @ (torch.nn.functional.silu(m.gate_proj.weight @ n) * (m.up_proj.weight @ n)) + a
    torch.testing.assert_close(out.hidden[0, 0], r, rtol=1e-5, atol=1e-5)
    assert out.normed is out.hidden  # no final norm in EAGLE-1
    torch.testing.assert_close(head.compute_logits(out.normed)[0, 0], lm_head.weight @ r, rtol=1e-5, atol=1e-4)
    assert out.kv[0].shape == (1, 2, 1, 8)


def test_eagle1_incremental_cache_equals_full_forward():
    """Token-by-token with the returned (k, v) equals the causal full pass."""
    head, _ = make_eagle1_head()
    ids, f, pos = torch.randint(0, 100, (1, 5)), torch.randn(1, 5, 32), torch.arange(5)[None]
    full = head(ids, f, pos, causal(5))
    k = v = None
    for t in range(5):
        step = head(ids[:, t:t + 1], f[:, t:t + 1], pos[:, t:t + 1], causal(1, t), None if k is None else (k, v))
        k = step.kv[0] if k is None else torch.cat([k, step.kv[0]], 2)
        v = step.kv[1] if v is None else torch.cat([v, step.kv[1]], 2)
        torch.testing.assert_close(step.hidden[0, 0], full.hidden[0, t], rtol=1e-4, atol=1e-4)


# -- Medusa -------------------------------------------------------------------------------
def test_medusa_names_shapes_and_config_round_trip():
    cfg = MedusaConfig(medusa_num_heads=3, medusa_num_layers=2, hidden_size=16, vocab_size=50,
                       base_model_name_or_path="tiny", specplug={"version": 1, "method": "medusa"})
    heads = MedusaHeads(cfg)
    sd = heads.state_dict()
    assert set(sd) == {f"{k}.{j}.linear.{p}" for k in range(3) for j in range(2) for p in ("weight", "bias")} | \
        {f"{k}.2.weight" for k in range(3)}
    assert sd["1.2.weight"].shape == (50, 16)
    assert heads(torch.randn(2, 4, 16)).shape == (3, 2, 4, 50)
    raw = {**cfg.to_dict(), "architectures": ["MedusaModel"]}
    assert MedusaConfig.from_dict(raw).to_dict() == raw
    with pytest.raises(ValueError, match="medusa_num_heads"):
        MedusaConfig.from_dict({"num_heads": 3})


def test_medusa_heads_compute_resblocks_then_projection():
    heads = MedusaHeads(MedusaConfig(2, 1, 8, 11))
    x = torch.randn(1, 3, 8)
    lin, proj = heads[1][0].linear, heads[1][1]
    want = (x + torch.nn.functional.silu(lin(x))) @ proj.weight.T
    torch.testing.assert_close(heads(x)[1], want)


def test_medusa_layers_are_independent_but_shared_checkpoints_load():
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(2, 3, 8, 11))
    assert heads[0][0].linear.weight.data_ptr() != heads[0][1].linear.weight.data_ptr()
    shared = heads.state_dict()
    for k in range(2):  # a checkpoint written by the `[ResBlock] * n` bug
        for j in (1, 2):
            shared[f"{k}.{j}.linear.weight"] = shared[f"{k}.0.linear.weight"]
            shared[f"{k}.{j}.linear.bias"] = shared[f"{k}.0.linear.bias"]
    loaded = MedusaHeads.from_state_dict(MedusaConfig(2, 3), shared)
    assert loaded.config.hidden_size == 8 and loaded.config.vocab_size == 11
    x = torch.randn(1, 2, 8)
    blk = heads[0][0]
    torch.testing.assert_close(loaded(x)[0], blk(blk(blk(x))) @ heads[0][3].weight.T)
    dedup = {k: v for k, v in shared.items() if ".1.linear" not in k and ".2.linear" not in k}
    with pytest.raises(ValueError, match="missing keys"):
        MedusaHeads.from_state_dict(MedusaConfig(2, 3), dedup)
    filled = MedusaHeads.from_state_dict(MedusaConfig(2, 3), dedup, fill_shared_layers=True)
    torch.testing.assert_close(filled(x), loaded(x))
